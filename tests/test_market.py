"""portable_ssm.market: DBN / table reading, leak-free features and splits, baselines, streaming == batch."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

dbn = pytest.importorskip("databento_dbn")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from portable_ssm.market import (  # noqa: E402
    FEATURES,
    LOOKBACK,
    Normaliser,
    StreamPredictor,
    bar_features,
    baselines,
    compare,
    fixed_to_float,
    predict,
    read_bars,
    read_dbn_columns,
    read_table,
    synthetic_bars,
    targets,
    trailing_return,
    walk_forward,
    windows,
    write_ohlcv_dbn,
)

from portable_ssm import Mamba2Config, init_params, to_backend  # noqa: E402

CONFIG = Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8)


def _metadata(schema: str) -> bytes:
    return dbn.Metadata(dataset="TEST", start=0, stype_in=dbn.SType.RAW_SYMBOL, stype_out=dbn.SType.INSTRUMENT_ID,
                        schema=dbn.Schema.from_str(schema), symbols=["X"]).encode()


def _head(seed: int) -> dict[str, np.ndarray]:
    """Random ``inp`` / ``head`` maps (float64 NumPy) for CONFIG."""
    rng = np.random.default_rng(seed)
    d = CONFIG.d_model
    return {"inp.weight": rng.standard_normal((d, len(FEATURES))) / 2, "inp.bias": rng.standard_normal(d),
            "head.weight": rng.standard_normal((1, d)) / 4, "head.bias": rng.standard_normal(1)}


def test_ohlcv_dbn_round_trip_keeps_fixed_point_prices_and_nanosecond_times_exactly(tmp_path):
    bars = synthetic_bars("planted", 50, seed=3)
    write_ohlcv_dbn(tmp_path / "bars.dbn", bars, instrument_id=9)
    back = read_bars(tmp_path / "bars.dbn")
    assert back.ts_event.dtype == np.int64 and back.close.dtype == np.float64
    for name in ("ts_event", "open", "high", "low", "close", "volume"):
        np.testing.assert_array_equal(getattr(back, name), getattr(bars, name), err_msg=name)
    schema, columns = read_dbn_columns(tmp_path / "bars.dbn")
    assert schema == "ohlcv-1m" and columns["volume"].dtype == np.int64


def test_fixed_point_conversion_is_the_correctly_rounded_quotient_and_undefined_is_nan():
    rng = np.random.default_rng(0)
    fixed = np.concatenate([rng.integers(-2**53, 2**53, 200), [0, 1, -1, 2**53, 100_250_000_001]])
    expected = [float(Fraction(int(p), 10**9)) for p in fixed]
    np.testing.assert_array_equal(fixed_to_float(fixed), expected)
    assert np.isnan(fixed_to_float(np.array([dbn.UNDEF_PRICE]))).all()
    with pytest.raises(ValueError, match="2\\*\\*53"):
        fixed_to_float(np.array([2**53 + 1]))


def test_trades_dbn_become_bars_of_the_interval_with_exact_prices(tmp_path):
    # (ts_event ns, price fixed-point, size): two trades in second 0, one in second 2
    trades = [(100, 100_000_000_001, 3), (900_000_000, 99_500_000_000, 2), (2_100_000_000, 101_000_000_000, 5)]
    data = _metadata("trades") + b"".join(
        bytes(dbn.TradeMsg(1, 7, ts, px, sz, dbn.Action.TRADE, dbn.Side.BID, 0, ts + 1)) for ts, px, sz in trades)
    (tmp_path / "t.dbn").write_bytes(data)
    schema, columns = read_dbn_columns(tmp_path / "t.dbn")
    assert schema == "trades" and columns["price"][0] == 100.000000001 and columns["ts_event"].dtype == np.int64
    bars = read_bars(tmp_path / "t.dbn", interval_ns=1_000_000_000)
    np.testing.assert_array_equal(bars.ts_event, [0, 2_000_000_000])
    np.testing.assert_array_equal(bars.open, [100.000000001, 101.0])
    np.testing.assert_array_equal(bars.close, [99.5, 101.0])
    np.testing.assert_array_equal(bars.high, [100.000000001, 101.0])
    np.testing.assert_array_equal(bars.volume, [5.0, 5.0])
    with pytest.raises(ValueError, match="interval_ns"):
        read_bars(tmp_path / "t.dbn")


def test_mbp1_dbn_become_bars_of_the_mid_price_with_traded_volume(tmp_path):
    quotes = [(10, dbn.Action.ADD, 0, 99_000_000_000, 101_000_000_000), (20, dbn.Action.TRADE, 4, 99_000_000_000,
              102_000_000_000), (1_000_000_010, dbn.Action.CANCEL, 0, 98_000_000_000, 100_000_000_000)]
    data = _metadata("mbp-1") + b"".join(bytes(dbn.MBP1Msg(
        1, 7, ts, bid, size, action, dbn.Side.BID, 0, ts, levels=dbn.BidAskPair(bid_px=bid, ask_px=ask, bid_sz=1,
                                                                                 ask_sz=2)))
        for ts, action, size, bid, ask in quotes)
    (tmp_path / "q.dbn").write_bytes(data)
    _, columns = read_dbn_columns(tmp_path / "q.dbn")
    np.testing.assert_array_equal(columns["ask_px"], [101.0, 102.0, 100.0])
    bars = read_bars(tmp_path / "q.dbn", interval_ns=1_000_000_000)
    np.testing.assert_array_equal(bars.open, [100.0, 99.0])
    np.testing.assert_array_equal(bars.close, [100.5, 99.0])
    np.testing.assert_array_equal(bars.volume, [4.0, 0.0])


def test_a_file_of_several_instruments_needs_one_chosen(tmp_path):
    data = _metadata("ohlcv-1s") + b"".join(bytes(dbn.OHLCVMsg(dbn.RType.OHLCV_1S, 1, i, 1, 5, 5, 5, 5, 1))
                                              for i in (3, 4))
    (tmp_path / "two.dbn").write_bytes(data)
    with pytest.raises(ValueError, match="instruments \\[3, 4\\]"):
        read_bars(tmp_path / "two.dbn")
    assert len(read_bars(tmp_path / "two.dbn", instrument_id=4)) == 1


def test_tables_read_only_the_named_columns_with_dates_as_int64_nanoseconds(tmp_path):
    pd = pytest.importorskip("pandas")
    table = pd.DataFrame({"date": ["2024-01-02", "2024-01-01"], "px": [11.0, 10.0], "vol": [7, 5], "other": [1, 2]})
    table.to_csv(tmp_path / "p.csv", index=False)
    bars = read_table(tmp_path / "p.csv", time="date", close="px", volume="vol")
    np.testing.assert_array_equal(bars.ts_event, [1704067200 * 10**9, 1704153600 * 10**9])
    np.testing.assert_array_equal(bars.close, [10.0, 11.0])
    np.testing.assert_array_equal(bars.volume, [5.0, 7.0])
    with pytest.raises(ValueError, match="'close': 'price'"):
        read_table(tmp_path / "p.csv", time="date", close="price")


def test_targets_look_k_bars_ahead_and_direction_is_their_sign():
    bars = synthetic_bars("random-walk", 20, seed=1)
    ahead = targets(bars, horizon=3, kind="return")
    log_close = np.log(bars.close)
    np.testing.assert_allclose(ahead[:-3], log_close[3:] - log_close[:-3])
    assert np.isnan(ahead[-3:]).all()
    np.testing.assert_array_equal(targets(bars, horizon=3, kind="direction")[:-3], (ahead[:-3] > 0) * 1.0)
    np.testing.assert_allclose(trailing_return(bars, horizon=3)[3:], ahead[:-3])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(200, 400), window=st.integers(2, 12), horizon=st.integers(1, 5), embargo=st.integers(0, 6),
       folds=st.integers(1, 3), stride=st.integers(1, 4))
def test_walk_forward_windows_never_straddle_the_boundary(n, window, horizon, embargo, folds, stride):
    for split in walk_forward(n, window=window, horizon=horizon, embargo=embargo, folds=folds, stride=stride,
                              val_fraction=0.4):
        assert split.train_ends.max() + horizon < split.boundary  # every training target lies before B
        assert split.train_ends.min() - window + 1 >= LOOKBACK - 1  # training rows all have features
        assert split.val_ends.min() - window + 1 >= split.boundary + embargo  # validation starts after the gap
        assert split.val_ends.max() + horizon < n  # validation targets exist


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), t=st.integers(2, 38), boundary=st.integers(3, 40))
def test_changing_data_after_t_changes_no_feature_window_or_prediction_at_or_before_t(seed, t, boundary):
    bars = synthetic_bars("planted", 40, seed=seed)
    other = synthetic_bars("random-walk", 40, seed=seed + 1)
    edited = bars.replace_after(t, other)
    raw, raw_edited = bar_features(bars), bar_features(edited)
    np.testing.assert_array_equal(raw[:t + 1], raw_edited[:t + 1])
    boundary = min(boundary, t + 1)  # a normaliser fitted before the edit (training span ends by t)
    norm, norm_edited = Normaliser.fit(raw, boundary), Normaliser.fit(raw_edited, boundary)
    np.testing.assert_array_equal(norm.mean, norm_edited.mean)
    x, x_edited = np.nan_to_num(norm(raw)), np.nan_to_num(norm(raw_edited))
    ends = np.arange(4, t + 1)
    np.testing.assert_array_equal(windows(x, ends, 5), windows(x_edited, ends, 5))
    params = init_params(CONFIG, seed=0, dtype="float64")
    head = _head(0)
    y, y_edited = predict(x[None], head, params, config=CONFIG), predict(x_edited[None], head, params, config=CONFIG)
    np.testing.assert_array_equal(y[0, :t + 1], y_edited[0, :t + 1])
    streams = []
    for series in (bars, edited):
        predictor = StreamPredictor(head, params, config=CONFIG, normaliser=norm)
        streams.append([predictor.update(series.open[i], series.high[i], series.low[i], series.close[i],
                                         series.volume[i]) for i in range(t + 1)])
    assert streams[0] == streams[1]


def test_ar_baseline_recovers_an_ar1_coefficient_and_majority_takes_the_training_class():
    rng = np.random.default_rng(0)
    r = np.zeros(4000)
    for i in range(1, r.size):
        r[i] = 0.3 * r[i - 1] + rng.standard_normal()
    target = np.concatenate([r[1:], [np.nan]])
    ends = np.arange(5, 3000)
    out = baselines("return", returns=r, trailing=r, target=target, train_ends=ends, val_ends=np.arange(3000, 3999),
                    order=2)
    np.testing.assert_allclose(out["ar2"], 0.3 * r[3000:3999], atol=0.05)
    np.testing.assert_array_equal(out["zero"], 0.0)
    up = (target > 0) * 1.0
    direction = baselines("direction", returns=r, trailing=r, target=up, train_ends=ends, val_ends=ends, order=2)
    assert set(np.unique(direction["majority"])) == {float(up[ends].mean() >= 0.5)}


def test_compare_calls_a_win_only_beyond_two_standard_errors():
    rng = np.random.default_rng(0)
    base = rng.random(1000)
    assert compare(base, base, block=1) == {"gain": 0.0, "z": 0.0, "beaten": False}
    assert compare(base - 0.1, base, block=1)["beaten"] is True
    noise = compare(base + 0.01 * rng.standard_normal(1000), base, block=5)
    assert abs(noise["z"]) < 4 and noise["gain"] == pytest.approx(0.0, abs=0.01)


def test_streaming_predictions_equal_the_batch_forward_over_the_same_bars(xp):
    bars = synthetic_bars("planted", 12, seed=5)
    raw = bar_features(bars)
    norm = Normaliser.fit(raw, 10)
    head = {k: xp.asarray_from(v, "float32") for k, v in _head(1).items()}
    params = init_params(CONFIG, seed=2, backend=xp.name, device=xp.device)
    predictor = StreamPredictor(head, params, config=CONFIG, normaliser=norm)
    stream = [predictor.update(bars.open[i], bars.high[i], bars.low[i], bars.close[i], bars.volume[i])
              for i in range(len(bars))]
    assert stream[:LOOKBACK - 1] == [None] * (LOOKBACK - 1)
    x = xp.asarray_from(norm(raw)[LOOKBACK - 1:][None], "float32")  # [1, N - 1, F]
    batch = predict(x, head, params, config=CONFIG)
    assert tuple(batch.shape) == (1, len(bars) - 1) and batch.dtype == xp.float32
    np.testing.assert_allclose(stream[LOOKBACK - 1:], xp.numpy(batch)[0], rtol=2e-4, atol=2e-5)
    assert predictor.state is not None and to_backend(predictor.state.ssm[0], "numpy").shape == (1, 4, 8, 8)
