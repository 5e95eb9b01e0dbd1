"""portable_ssm.market under hostile inputs: every size, horizon, order and split argument is checked
(TypeError / ValueError naming it), nothing reads the future, a NaN bar never travels backwards in
time, and files that are FIFOs, truncated, malformed or out of time order raise MarketDataError
naming the file (and record), never hang, never come back short or unsorted."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

dbn = pytest.importorskip("databento_dbn")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from portable_ssm.market import (  # noqa: E402
    Bars,
    MarketDataError,
    Normaliser,
    bar_features,
    baselines,
    compare,
    fixed_to_float,
    model_inputs,
    ohlcv_records,
    read_bars,
    read_bars_by_instrument,
    read_dbn_columns,
    read_table,
    resample,
    synthetic_bars,
    targets,
    trailing_return,
    walk_forward,
    windows,
    write_ohlcv_dbn,
)

BARS = synthetic_bars("planted", 60, seed=0)
SERIES = np.linspace(-1.0, 1.0, 60)
ENDS = np.arange(10, 40)

# (what, call, exception, message): every bad size, horizon, order or split argument
BAD_ARGUMENTS = [
    ("horizon 0", lambda: targets(BARS, horizon=0, kind="return"), ValueError, "horizon: expected an int in \\[1"),
    ("horizon -2", lambda: targets(BARS, horizon=-2, kind="return"), ValueError, "horizon"),
    ("horizon 1.5", lambda: targets(BARS, horizon=1.5, kind="return"), TypeError, "horizon: expected an int"),
    ("horizon True", lambda: targets(BARS, horizon=True, kind="return"), TypeError, "got bool"),
    ("kind", lambda: targets(BARS, horizon=1, kind="price"), ValueError, "kind: expected one of"),
    ("trailing horizon -1", lambda: trailing_return(BARS, horizon=-1), ValueError, "horizon"),
    ("trailing horizon 0", lambda: trailing_return(BARS, horizon=0), ValueError, "horizon"),
    ("window length 0", lambda: windows(SERIES, ENDS, 0), ValueError, "length: expected an int in \\[1"),
    ("window length -3", lambda: windows(SERIES, ENDS, -3), ValueError, "length"),
    ("window float ends", lambda: windows(SERIES, ENDS * 1.0, 3), TypeError, "ends: expected integer indices"),
    ("window bool ends", lambda: windows(SERIES, ENDS > 0, 3), TypeError, "ends"),
    ("walk window 0", lambda: walk_forward(200, window=0, horizon=1, embargo=0), ValueError, "window"),
    ("walk horizon 0", lambda: walk_forward(200, window=5, horizon=0, embargo=0), ValueError, "horizon"),
    ("walk horizon -3", lambda: walk_forward(200, window=5, horizon=-3, embargo=0), ValueError, "horizon"),
    ("walk embargo -1", lambda: walk_forward(200, window=5, horizon=1, embargo=-1), ValueError, "embargo"),
    ("walk stride 0", lambda: walk_forward(200, window=5, horizon=1, embargo=0, stride=0), ValueError, "stride"),
    ("walk folds 0", lambda: walk_forward(200, window=5, horizon=1, embargo=0, folds=0), ValueError, "folds"),
    ("walk n float", lambda: walk_forward(200.0, window=5, horizon=1, embargo=0), TypeError, "n_bars"),
    ("walk fraction 1", lambda: walk_forward(200, window=5, horizon=1, embargo=0, val_fraction=1.0), ValueError,
     "val_fraction"),
    ("walk fraction nan", lambda: walk_forward(200, window=5, horizon=1, embargo=0, val_fraction=float("nan")),
     ValueError, "val_fraction"),
    ("walk fraction bool", lambda: walk_forward(200, window=5, horizon=1, embargo=0, val_fraction=True), TypeError,
     "val_fraction"),
    ("AR order 0", lambda: baselines("return", returns=SERIES, trailing=SERIES, target=SERIES, train_ends=ENDS,
                                     val_ends=ENDS + 10, order=0), ValueError, "order"),
    ("AR order -2", lambda: baselines("return", returns=SERIES, trailing=SERIES, target=SERIES, train_ends=ENDS,
                                      val_ends=ENDS + 10, order=-2), ValueError, "order"),
    ("AR ends before the lags", lambda: baselines("return", returns=SERIES, trailing=SERIES, target=SERIES,
                                                  train_ends=np.arange(0, 30), val_ends=ENDS + 10, order=5),
     ValueError, "ends: AR\\(5\\) lags need ends in \\[4"),
    ("AR val ends past the data", lambda: baselines("return", returns=SERIES, trailing=SERIES, target=SERIES,
                                                    train_ends=ENDS, val_ends=ENDS + 40, order=2), ValueError,
     "val_ends"),
    ("normaliser stop -1", lambda: Normaliser.fit(bar_features(BARS), -1), ValueError, "stop: expected an int in"),
    ("normaliser stop past N", lambda: Normaliser.fit(bar_features(BARS), 61), ValueError, "stop"),
    ("normaliser stop float", lambda: Normaliser.fit(bar_features(BARS), 30.0), TypeError, "stop"),
    ("normaliser zero std", lambda: Normaliser(mean=np.zeros(5), std=np.zeros(5)), ValueError, "std"),
    ("compare block 0", lambda: compare(SERIES ** 2, SERIES ** 2, block=0), ValueError, "block"),
    ("compare NaN loss", lambda: compare(np.full(60, np.nan), SERIES ** 2, block=1), ValueError, "finite"),
    ("synthetic n 0", lambda: synthetic_bars("planted", 0, seed=0), ValueError, "n: expected"),
    ("synthetic n bool", lambda: synthetic_bars("planted", True, seed=0), TypeError, "n: expected an int"),
    ("resample interval 0", lambda: resample(BARS.ts_event, BARS.close, BARS.volume, 0), ValueError, "interval_ns"),
    ("resample interval float", lambda: resample(BARS.ts_event, BARS.close, BARS.volume, 1e9), TypeError,
     "interval_ns"),
    ("fixed point from floats", lambda: fixed_to_float(np.array([1.5e9])), TypeError, "fixed: expected an integer"),
    ("bars float timestamps", lambda: Bars(BARS.ts_event * 1.0, BARS.open, BARS.high, BARS.low, BARS.close,
                                           BARS.volume), TypeError, "ts_event: expected a int64"),
    ("bars ragged", lambda: Bars(BARS.ts_event, BARS.open[:5], BARS.high, BARS.low, BARS.close, BARS.volume),
     ValueError, "open: expected shape"),
    ("bars slice past the end", lambda: BARS.slice(0, 61), ValueError, "stop"),
    ("bars replace_after -1", lambda: BARS.replace_after(-1, BARS), ValueError, "t: expected"),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_every_bad_size_horizon_order_and_split_argument_is_refused_by_name(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_negative_trailing_horizon_no_longer_returns_future_returns():
    # before the check, horizon=-1 filled the last bar with log(close[N-1] / close[0]) and more: the future
    with pytest.raises(ValueError, match="horizon"):
        trailing_return(BARS, horizon=-1)


def test_ar_lags_of_an_early_end_would_wrap_to_the_last_bars_and_are_refused():
    # an end e < order - 1 indexed returns[e - j] < 0: numpy wraps it to the last bars (look-ahead)
    with pytest.raises(ValueError, match="lags need ends"):
        baselines("return", returns=SERIES, trailing=SERIES, target=SERIES, train_ends=np.arange(2, 30),
                  val_ends=ENDS + 10, order=5)


def _with_nan_bar(bars: Bars, j: int) -> Bars:
    close = bars.close.copy()
    close[j] = np.nan
    return Bars(ts_event=bars.ts_event, open=bars.open, high=bars.high, low=bars.low, close=close, volume=bars.volume)


@settings(max_examples=25, deadline=None)
@given(j=st.integers(1, 58), stop=st.integers(10, 60))
def test_a_nan_bar_in_the_training_span_changes_no_other_normalised_row(j, stop):
    bars = synthetic_bars("planted", 60, seed=j)
    raw, raw_nan = bar_features(bars), bar_features(_with_nan_bar(bars, j))
    np.testing.assert_array_equal(raw_nan[:j], raw[:j])  # features never look back past a NaN: rows before j equal
    norm = Normaliser.fit(raw_nan, stop)
    rows = raw_nan[1:stop]  # the span fit reads (LOOKBACK - 1 .. stop - 1)
    kept = rows[~np.isin(np.arange(1, stop), [j, j + 1])]  # the rows that read bar j deleted
    np.testing.assert_array_equal(norm.mean, kept.mean(axis=0))  # a NaN row counts as a deleted row, bit for bit
    np.testing.assert_array_equal(norm.std, kept.std(axis=0) + 1e-12)
    x = norm(raw_nan)
    finite_rows = np.isfinite(x).all(axis=1)
    assert finite_rows[1:j].all() and finite_rows[j + 2:].all()
    assert np.isfinite(model_inputs(raw_nan, norm)).all()


def test_a_missing_bar_of_zero_or_negative_price_is_nan_in_its_rows_only():
    close = BARS.close.copy()
    close[20], close[40] = 0.0, -5.0
    bad = Bars(ts_event=BARS.ts_event, open=BARS.open, high=BARS.high, low=BARS.low, close=close, volume=BARS.volume)
    raw, clean = bar_features(bad), bar_features(BARS)
    missing = np.zeros(60, bool)
    missing[[20, 21, 40, 41]] = True
    assert np.isnan(raw[missing]).any(axis=1).all()
    np.testing.assert_array_equal(raw[~missing][1:, 1:4], clean[~missing][1:, 1:4])


def _fifo_is_refused(tmp_path, read, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    outcome: list = []

    def target() -> None:
        try:
            read(fifo)
        except Exception as err:  # noqa: BLE001 (the assertion below names what came)
            outcome.append(err)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), f"{read} blocked on a FIFO"
    assert isinstance(outcome[0], MarketDataError) and "FIFO" in str(outcome[0]) and str(fifo) in str(outcome[0])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("reader", ["read_bars", "read_dbn_columns", "read_bars_by_instrument", "read_table"])
def test_a_fifo_in_place_of_a_data_file_is_refused_without_blocking(tmp_path, reader):
    read = {"read_bars": read_bars, "read_dbn_columns": read_dbn_columns,
            "read_bars_by_instrument": read_bars_by_instrument,
            "read_table": lambda p: read_table(p, time="t", close="c")}[reader]
    _fifo_is_refused(tmp_path, read, "feed.csv" if reader == "read_table" else "feed.dbn")


def test_a_directory_in_place_of_a_data_file_is_refused(tmp_path):
    (tmp_path / "d.dbn").mkdir()
    with pytest.raises(MarketDataError, match="directory"):
        read_bars(tmp_path / "d.dbn")


def _dbn_file(tmp_path, n: int = 40, name: str = "bars.dbn") -> tuple[bytes, int]:
    """A valid OHLCV DBN file of n bars; its bytes and the metadata length."""
    write_ohlcv_dbn(tmp_path / name, synthetic_bars("planted", n, seed=1))
    data = (tmp_path / name).read_bytes()
    return data, 8 + int.from_bytes(data[4:8], "little")


def test_a_dbn_file_cut_inside_a_record_is_refused_not_read_short(tmp_path):
    data, head = _dbn_file(tmp_path)
    (tmp_path / "cut.dbn").write_bytes(data[:head + 56 * 10 + 20])
    with pytest.raises(MarketDataError, match=r"cut\.dbn: truncated: 20 bytes of a partial 56-byte record 10"):
        read_bars(tmp_path / "cut.dbn")


def test_a_dbn_file_cut_inside_its_metadata_is_refused(tmp_path):
    data, head = _dbn_file(tmp_path)
    (tmp_path / "cut.dbn").write_bytes(data[:head - 3])
    with pytest.raises(MarketDataError, match="truncated: the file ends inside its"):
        read_dbn_columns(tmp_path / "cut.dbn")


def test_a_truncated_zstd_dbn_file_is_refused_not_read_short(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data, _ = _dbn_file(tmp_path, n=2000)
    packed = zstandard.ZstdCompressor().compress(data)
    (tmp_path / "whole.dbn.zst").write_bytes(packed)
    assert len(read_bars(tmp_path / "whole.dbn.zst")) == 2000
    (tmp_path / "cut.dbn.zst").write_bytes(packed[:-7])
    with pytest.raises(MarketDataError, match=r"cut\.dbn\.zst: truncated"):
        read_bars(tmp_path / "cut.dbn.zst")


def test_a_zstd_dbn_file_cut_anywhere_is_refused_even_between_frames_or_blocks(tmp_path):
    """Two frames (the first ends on a record boundary, the second of several blocks, with a
    checksum) and a skippable frame between them: every cut inside a frame is refused as
    truncated, cuts between blocks and in frame headers included (a decompressor alone would end
    there quietly, short). A cut between frames leaves whole frames: a shorter file, not a cut one."""
    zstandard = pytest.importorskip("zstandard")
    data, head = _dbn_file(tmp_path, n=8000)  # 8000 bars: the second frame holds several 128 KiB blocks
    one = zstandard.ZstdCompressor().compress(data[:head + 56 * 100])
    two = zstandard.ZstdCompressor(write_checksum=True).compress(data[head + 56 * 100:])
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"skip!"
    packed = one + skippable + two
    (tmp_path / "whole.dbn.zst").write_bytes(packed)
    assert len(read_bars(tmp_path / "whole.dbn.zst")) == 8000
    between = (len(one), len(one) + len(skippable))
    cuts = [*range(len(one) + 1, len(one) + len(skippable) + 40), *range(len(packed) - 12, len(packed)),
            *range(97, len(packed), 997)]
    for cut in between:
        (tmp_path / "short.dbn.zst").write_bytes(packed[:cut])
        assert len(read_bars(tmp_path / "short.dbn.zst")) == 100
    cuts = [cut for cut in cuts if cut not in between]
    for cut in cuts:
        (tmp_path / "cut.dbn.zst").write_bytes(packed[:cut])
        with pytest.raises(MarketDataError, match=r"cut\.dbn\.zst: truncated"):
            read_bars(tmp_path / "cut.dbn.zst")


def test_bytes_after_the_last_zstd_frame_are_refused_as_corrupt(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data, _ = _dbn_file(tmp_path, n=50)
    (tmp_path / "tail.dbn.zst").write_bytes(zstandard.ZstdCompressor().compress(data) + b"junk at the end")
    with pytest.raises(MarketDataError, match=r"tail\.dbn\.zst: corrupt zstd stream \(no frame starts at byte"):
        read_bars(tmp_path / "tail.dbn.zst")


def test_records_out_of_time_order_are_refused_naming_the_record(tmp_path):
    bars = synthetic_bars("planted", 30, seed=2)
    swapped = bars.ts_event.copy()
    swapped[[11, 12]] = swapped[[12, 11]]
    write_ohlcv_dbn(tmp_path / "o.dbn", Bars(ts_event=swapped, open=bars.open, high=bars.high, low=bars.low,
                                              close=bars.close, volume=bars.volume))
    with pytest.raises(MarketDataError, match=r"o\.dbn: records out of time order: record 12 has ts_event"):
        read_bars(tmp_path / "o.dbn")


def test_records_out_of_order_across_chunks_are_refused_too(tmp_path):
    bars = synthetic_bars("planted", 30, seed=2)
    ts = bars.ts_event.copy()
    ts[16:] -= 10**12  # record 16 (the first of the second 16-record chunk) steps back in time
    write_ohlcv_dbn(tmp_path / "o.dbn", Bars(ts_event=ts, open=bars.open, high=bars.high, low=bars.low,
                                              close=bars.close, volume=bars.volume))
    with pytest.raises(MarketDataError, match="record 16 has ts_event .* earlier than record 15"):
        read_bars(tmp_path / "o.dbn", chunk_records=16)


def test_a_record_of_another_length_or_rtype_is_refused_naming_it(tmp_path):
    data, head = _dbn_file(tmp_path)
    bad = bytearray(data)
    bad[head + 56 * 7 + 1] = 32  # record 7 claims rtype ohlcv-1s in an ohlcv-1m file
    (tmp_path / "bad.dbn").write_bytes(bytes(bad))
    with pytest.raises(MarketDataError, match="record 7 has length 56 bytes and rtype 32"):
        read_bars(tmp_path / "bad.dbn")


def test_a_file_that_is_not_dbn_is_refused(tmp_path):
    (tmp_path / "x.dbn").write_bytes(b"PK\x03\x04 not a dbn file at all")
    with pytest.raises(MarketDataError, match="not a DBN file"):
        read_bars(tmp_path / "x.dbn")


@pytest.mark.parametrize("compressed", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 3000), flips=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 255)), max_size=4))
def test_mangled_dbn_files_raise_only_market_data_errors(tmp_path, compressed, cut, flips):
    """Plain files and zstd frames (with a checksum) cut and flipped anywhere."""
    data, _ = _dbn_file(tmp_path, n=40, name="good.dbn")
    if compressed:
        data = pytest.importorskip("zstandard").ZstdCompressor(write_checksum=True).compress(data)
    mangled = bytearray(data[:cut])
    for at, value in flips:
        if at < len(mangled):
            mangled[at] = value
    (tmp_path / "m.dbn").write_bytes(bytes(mangled))
    try:
        bars = read_bars(tmp_path / "m.dbn", instrument_id=1)
    except MarketDataError as err:
        assert "m.dbn" in str(err)
        return
    assert len(bars) <= 40 and (np.diff(bars.ts_event) >= 0).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from("t,c0123456789.-e\nnaNx\""), max_size=120))
def test_arbitrary_csv_text_raises_only_market_data_errors(tmp_path, text):
    (tmp_path / "p.csv").write_text("t,c\n" + text)
    try:
        bars = read_table(tmp_path / "p.csv", time="t", close="c")
    except MarketDataError as err:
        assert "p.csv" in str(err)
        return
    assert (np.diff(bars.ts_event) >= 0).all()


_ANY = st.one_of(st.integers(-5, 300), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=3))


@settings(max_examples=150, deadline=None)
@given(n=_ANY, window=_ANY, horizon=_ANY, embargo=_ANY, folds=_ANY, stride=_ANY, fraction=_ANY)
def test_walk_forward_with_any_arguments_raises_only_type_and_value_errors(n, window, horizon, embargo, folds,
                                                                           stride, fraction):
    try:
        splits = walk_forward(n, window=window, horizon=horizon, embargo=embargo, folds=folds, stride=stride,
                              val_fraction=fraction)
    except (TypeError, ValueError):
        return
    for split in splits:  # what it does return never lets a training target reach the boundary
        assert split.train_ends.max() + horizon < split.boundary <= split.val_ends.min() - window + 1


_PRICE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-3, 1e3))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.tuples(_PRICE, _PRICE, _PRICE, _PRICE, _PRICE), min_size=2, max_size=30),
       t=st.integers(0, 28))
def test_features_of_any_bars_never_raise_and_never_look_past_their_bar(values, t):
    o, h, lo, c, v = (np.array(col, dtype=np.float64) for col in zip(*values))
    n = o.shape[0]
    bars = Bars(ts_event=np.arange(n, dtype=np.int64), open=o, high=h, low=lo, close=c, volume=v)
    raw = bar_features(bars)
    assert raw.shape == (n, 5)
    t = min(t, n - 1)
    edited = bars.replace_after(t, Bars(ts_event=bars.ts_event, open=o[::-1].copy(), high=h[::-1].copy(),
                                        low=lo[::-1].copy(), close=c[::-1].copy(), volume=v[::-1].copy()))
    np.testing.assert_array_equal(bar_features(edited)[:t + 1], raw[:t + 1])


def test_ohlcv_records_round_trip_through_the_chunked_reader(tmp_path):
    bars = synthetic_bars("planted", 100, seed=4)
    records = ohlcv_records(bars, instrument_id=3)
    assert records.dtype.itemsize == 56 and (records["instrument_id"] == 3).all()
    write_ohlcv_dbn(tmp_path / "b.dbn", bars, instrument_id=3)
    for chunk in (1, 7, 1 << 18):
        back = read_bars(tmp_path / "b.dbn", chunk_records=chunk)
        np.testing.assert_array_equal(back.close, bars.close)
