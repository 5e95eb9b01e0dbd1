"""MarketModel and MarketStream: the run directory round trip, streaming == batch for many instruments
joining and leaving (NaN bars included), the torch whole-model decode path, and bad inputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("databento_dbn")
from portable_ssm.backends.cpu_source import ENV  # noqa: E402
from portable_ssm.backends.numpy import kernels as numpy_kernels  # noqa: E402
from portable_ssm.market import (  # noqa: E402
    FEATURES,
    Bars,
    MarketDataError,
    MarketModel,
    MarketStream,
    Normaliser,
    bar_features,
    synthetic_bars,
)

from portable_ssm import Mamba2Config, init_params, to_backend  # noqa: E402

CONFIG = Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8)


def _model(backend: str = "numpy", device=None, seed: int = 0) -> MarketModel:
    rng = np.random.default_rng(seed)
    d = CONFIG.d_model
    head = {"inp.weight": rng.standard_normal((d, len(FEATURES))) / 2, "inp.bias": rng.standard_normal(d) / 4,
            "head.weight": rng.standard_normal((1, d)) / 4, "head.bias": rng.standard_normal(1)}
    head = {k: to_backend(v.astype(np.float32), backend, device=device) for k, v in head.items()}
    bars = synthetic_bars("planted", 200, seed=seed)
    return MarketModel(config=CONFIG, params=init_params(CONFIG, seed=seed, backend=backend, device=device),
                       head=head, normaliser=Normaliser.fit(bar_features(bars), 150), target="return", horizon=2,
                       target_scale=1e-3, seq_len=20, instruments=(7,), info={"data": "synthetic"})


def _with_nan(bars: Bars, t: int) -> Bars:
    close = bars.close.copy()
    close[t] = np.nan
    return Bars(ts_event=bars.ts_event, open=bars.open, high=bars.high, low=bars.low, close=close, volume=bars.volume)


def test_a_saved_run_directory_loads_back_in_one_call_with_every_setting(tmp_path):
    model = _model()
    model.save(tmp_path / "run")
    assert sorted(os.listdir(tmp_path / "run")) == ["head.safetensors", "market.json", "model.safetensors"]
    back = MarketModel.load(tmp_path / "run")
    assert (back.target, back.horizon, back.target_scale, back.seq_len, back.instruments, back.info) == \
        ("return", 2, 1e-3, 20, (7,), {"data": "synthetic"})
    assert back.config == CONFIG
    np.testing.assert_array_equal(back.normaliser.mean, model.normaliser.mean)
    np.testing.assert_array_equal(back.normaliser.std, model.normaliser.std)
    bars = synthetic_bars("random-walk", 40, seed=3)
    np.testing.assert_array_equal(back.predict(bars), model.predict(bars))
    assert np.isnan(back.predict(bars)[0]) and np.isfinite(back.predict(bars)[1:]).all()


@pytest.mark.parametrize(("fast", "kernels_on"), [(True, True), (True, False), (False, True)],
                         ids=["fast path", "fast path without the compiled kernels", "portable_ssm.step"])
def test_streaming_many_instruments_joining_and_leaving_equals_the_batch_forward_of_each(xp, fast, kernels_on,
                                                                                         monkeypatch):
    if not kernels_on:
        monkeypatch.setenv(ENV, "0")
    model = _model(xp.name, xp.device)
    series = {3: synthetic_bars("planted", 30, seed=1), 9: _with_nan(synthetic_bars("planted", 30, seed=2), 12),
              4: synthetic_bars("random-walk", 30, seed=5)}
    joins, leaves = {3: 0, 9: 0, 4: 10}, {9: 25}  # 4 joins at bar 10; 9 leaves after bar 24
    stream = model.stream(instruments=[], fast=fast)
    compiled = fast and numpy_kernels.library() is not None  # NumPy's whole-model step
    on_host = xp.name == "numpy" or xp.name == "torch" and str(xp.device) == "cpu"  # torch: through host views
    assert (stream._bar is not None) == (compiled and on_host)  # every row in one call per bar
    assert (stream._numpy is not None) == (fast and not compiled and xp.name == "numpy")  # only without it
    _stream_and_compare(model, stream, series, joins, leaves, skipping=3)
    assert stream.instruments == (3, 4)


def test_a_jax_stream_steps_through_one_compiled_bar_and_without_fast_op_by_op():
    pytest.importorskip("jax")
    from portable_ssm.backends import jax as jax_backend

    model, bars = _model("jax"), synthetic_bars("planted", 12, seed=1)
    for fast in (True, False):
        stream = model.stream(instruments=[3, 9], fast=fast)
        before = jax_backend.TRACES["market bar"]
        for t in range(len(bars)):
            stream.update(np.array([3, 9]), *(np.full(2, getattr(bars, f)[t]) for f in
                                              ("open", "high", "low", "close", "volume")))
        after = jax_backend.TRACES["market bar"]
        if fast:  # traced at most once for its two rows (earlier streams of two rows may have traced it)
            assert before <= after <= before + 1 and after >= 1
        else:
            assert after == before


def _stream_and_compare(model, stream, series, joins, leaves, *, skipping, count=30):
    """Streams ``series`` (instrument id -> Bars) through ``stream`` with instruments joining at
    ``joins`` and leaving at ``leaves`` (id -> bar), ``skipping`` updating only on some bars (subsets
    of the rows), and holds each instrument's predictions to the batch forward of its own bars."""
    streamed: dict[int, list[float]] = {i: [] for i in series}
    for t in range(count):
        for i, at in joins.items():
            if at == t:
                stream.add(i)
        for i, at in leaves.items():
            if at == t:
                stream.remove(i)
        ids = [i for i in stream.instruments if t % 4 != 1 or i != skipping]  # skipping misses some bars: subsets
        bars = {i: series[i] for i in ids}
        start = {i: joins[i] for i in ids}
        out = stream.update(np.array(ids), *(np.array([getattr(bars[i], f)[t] for i in ids])
                                             for f in ("open", "high", "low", "close", "volume")))
        for i, value in zip(ids, out):
            streamed[i].append((t - start[i], value))
    for i, values in streamed.items():
        taken = np.array([k for k, _ in values])
        bars = series[i].slice(joins[i], leaves.get(i, count))
        bars = Bars(**{f: getattr(bars, f)[taken] for f in ("ts_event", "open", "high", "low", "close", "volume")})
        batch = model.predict(bars)
        got = np.array([v for _, v in values])
        assert np.isnan(got[0]) and np.isnan(batch[0])
        np.testing.assert_allclose(got[1:], batch[1:], rtol=2e-4, atol=2e-5, err_msg=f"instrument {i}")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("gemm_rows", [0, 1], ids=["row kernel", "sgemm"])
def test_many_instruments_stepped_together_in_one_native_call_per_bar_equal_the_batch_forward(backend, gemm_rows,
                                                                                              monkeypatch):
    if backend == "torch":
        pytest.importorskip("torch")
    if numpy_kernels.library() is None:
        pytest.skip("NumPy's compiled kernels are not built here")
    from portable_ssm.backends.numpy import rows as rows_module

    calls = []
    real = rows_module.MarketBar.__call__
    monkeypatch.setattr(rows_module, "GEMM_ROWS", gemm_rows)
    monkeypatch.setattr(rows_module.MarketBar, "__call__", lambda self, rows, k: calls.append(k) or real(self, rows, k))
    model = _model(backend)
    kinds = ("planted", "random-walk")
    series = {i: synthetic_bars(kinds[i % 2], 24, seed=10 + i) for i in range(12)}
    series[5] = _with_nan(series[5], 9)
    joins = {i: 0 if i < 8 else 3 + i for i in series}  # 8 to 11 join one by one later
    leaves = {2: 14, 6: 20}
    stream = model.stream(instruments=[], fast=True)
    _stream_and_compare(model, stream, series, joins, leaves, skipping=4, count=24)
    assert stream.instruments == (0, 1, 3, 4, 5, 7, 8, 9, 10, 11)
    assert max(calls) >= 8 and len(calls) == 24  # one library call a bar for all its rows


def test_without_numpy_kernels_a_torch_instrument_streams_through_the_whole_model_decode_and_equals_batch(
        monkeypatch):
    torch = pytest.importorskip("torch")
    from portable_ssm.backends import torch as torch_backend

    monkeypatch.setattr(numpy_kernels, "library", lambda: None)  # no host-view step: the torch op row by row
    real, taken = torch_backend.decode_model, []
    monkeypatch.setattr(torch_backend, "decode_model", lambda *a: taken.append(r := real(*a)) or r)
    model = _model("torch")
    bars = synthetic_bars("planted", 25, seed=4)
    stream = model.stream([1])
    assert stream._bar is None
    with torch.no_grad():
        got = [stream.update(np.array([1]), *(getattr(bars, f)[t:t + 1] for f in ("open", "high", "low", "close",
                                                                                      "volume")))[0]
               for t in range(25)]
    assert len(taken) == 24  # every bar after the first asked the native decode
    if any(r is not None for r in taken):  # the kernel built here: its result is what came back
        assert all(r is not None for r in taken)
    np.testing.assert_allclose(got[1:], model.predict(bars)[1:], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "portable_ssm.step"])
def test_a_head_of_mixed_float_dtypes_is_refused_by_the_stream_as_by_the_batch_forward(fast):
    model = _model()
    head = {**model.head, "inp.bias": model.head["inp.bias"].astype(np.float64)}
    mixed = MarketModel(config=CONFIG, params=model.params, head=head, normaliser=model.normaliser)
    bars = synthetic_bars("planted", 3, seed=0)
    with pytest.raises(TypeError, match="mixed float dtypes"):
        mixed.predict(bars)
    stream = mixed.stream([1], fast=fast)
    fields = [getattr(bars, f)[:1] for f in ("open", "high", "low", "close", "volume")]
    assert np.isnan(stream.update(np.array([1]), *fields)[0])  # the first bar steps nothing
    with pytest.raises(TypeError, match="mixed float dtypes"):
        stream.update(np.array([1]), *(f * 1.01 for f in fields))


BAD_UPDATES = [
    ("unknown instrument", dict(ids=[5]), ValueError, "not streaming"),
    ("twice in one update", dict(ids=[1, 1]), ValueError, "appears twice"),
    ("bool ids", dict(ids=[True]), TypeError, "instrument_ids"),
    ("float ids", dict(ids=[1.0]), TypeError, "instrument_ids"),
    ("2-D ids", dict(ids=[[1, 2]], n=2), TypeError, "instrument_ids"),
    ("uint64 id past 2^63", dict(ids=[2**64 - 1]), ValueError, "not streaming"),
    ("ragged prices", dict(ids=[1, 2], n=3), ValueError, "open: expected shape \\[2\\]"),
    ("integer prices", dict(ids=[1], dtype=np.int64), TypeError, "open: expected a floating array"),
]


@pytest.mark.parametrize("case, error, message", [c[1:] for c in BAD_UPDATES], ids=[c[0] for c in BAD_UPDATES])
def test_bad_updates_are_refused_by_name_and_change_no_state(case, error, message):
    stream = _model().stream([1, 2])
    ids = np.array(case["ids"])
    field = np.ones(case.get("n", ids.size), dtype=case.get("dtype", np.float64))
    with pytest.raises(error, match=message):
        stream.update(ids, field, field, field, field, field)
    assert stream.instruments == (1, 2) and not stream._seen.any()


def test_ids_and_fields_of_other_types_predict_as_int64_and_float64_arrays():
    """int32 or list ids and float32 or list fields take the checked path and give the same
    predictions, bit for bit, as the usual int64 and float64 arrays of the same values."""
    model = _model()
    bars = synthetic_bars("planted", 6, seed=1)
    fields = [np.stack([getattr(bars, f), getattr(bars, f) * 1.01], axis=1).astype(np.float32)
              for f in ("open", "high", "low", "close", "volume")]  # [6, 2]: float32 values, exact in float64
    usual, other = model.stream([3, 7]), model.stream([3, 7])
    for i in range(6):
        a = usual.update(np.array([7, 3]), *(f[i].astype(np.float64) for f in fields))
        b = other.update([7, 3] if i % 2 else np.array([7, 3], np.int32),
                         *(f[i].tolist() if i % 2 else f[i] for f in fields))
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(a).all()


def test_joining_twice_or_leaving_unknown_is_refused():
    stream = _model().stream([1])
    with pytest.raises(ValueError, match="already streaming"):
        stream.add(1)
    with pytest.raises(ValueError, match="not streaming"):
        stream.remove(2)
    with pytest.raises(TypeError, match="instrument_id"):
        stream.add(2.0)


def test_a_stream_needs_a_whole_head():
    model = _model()
    with pytest.raises(ValueError, match="head: missing 'head.bias'"):
        MarketStream({k: v for k, v in model.head.items() if k != "head.bias"}, model.params, config=CONFIG,
                     normaliser=model.normaliser)


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"format": "other"}', "not a market model file"),
    ("[1, 2]", "not a market model file"),
])
def test_a_malformed_market_json_is_a_market_data_error_naming_it(tmp_path, text, message):
    _model().save(tmp_path)
    (tmp_path / "market.json").write_text(text)
    with pytest.raises(MarketDataError, match=message):
        MarketModel.load(tmp_path)


def test_a_market_json_with_a_bad_field_is_refused_naming_the_file(tmp_path):
    _model().save(tmp_path)
    data = json.loads((tmp_path / "market.json").read_text())
    data["horizon"] = 0
    (tmp_path / "market.json").write_text(json.dumps(data))
    with pytest.raises(MarketDataError, match="market.json|horizon"):
        MarketModel.load(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_as_market_json_is_refused_without_blocking(tmp_path):
    _model().save(tmp_path)
    os.remove(tmp_path / "market.json")
    os.mkfifo(tmp_path / "market.json")
    with pytest.raises(MarketDataError, match="FIFO"):
        MarketModel.load(tmp_path)


_FIELD = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-3, 1e3))


@settings(max_examples=40, deadline=None)
@given(bars=st.lists(st.tuples(_FIELD, _FIELD, _FIELD, _FIELD, _FIELD), min_size=1, max_size=12))
def test_any_bar_values_stream_to_finite_predictions_and_never_raise(bars):
    stream = _model().stream([1, 2])
    for i, values in enumerate(bars):
        out = stream.update(np.array([1, 2]), *(np.array([v, 1.0]) for v in values))
        assert out.shape == (2,) and out.dtype == np.float64
        assert np.isnan(out).all() if i == 0 else np.isfinite(out).all()  # a bad bar reads as the training mean


def test_a_stream_whose_state_is_replaced_steps_the_new_state_not_the_old_arrays():
    from portable_ssm import Mamba2State

    model = _model()
    bars = synthetic_bars("planted", 12, seed=6)
    fields = ("open", "high", "low", "close", "volume")
    kept, replaced = model.stream([1]), model.stream([1])
    for t in range(12):
        if t == 6:  # a copy of the same values, in new arrays
            old = replaced.state
            replaced.state = Mamba2State(*(tuple(a.copy() for a in part) for part in old))
            frozen = [a.copy() for a in (*old.conv, *old.ssm)]
        want = kept.update(np.array([1]), *(getattr(bars, f)[t:t + 1] for f in fields))
        got = replaced.update(np.array([1]), *(getattr(bars, f)[t:t + 1] for f in fields))
        np.testing.assert_array_equal(got, want)
    assert all(np.array_equal(a, b) for a, b in zip((*old.conv, *old.ssm), frozen))  # the old arrays untouched
    for a, b in zip((*kept.state.conv, *kept.state.ssm), (*replaced.state.conv, *replaced.state.ssm)):
        np.testing.assert_array_equal(a, b)


def test_a_bfloat16_torch_stream_is_built_and_steps_without_numpy_views():
    torch = pytest.importorskip("torch")
    config = Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8)
    params = init_params(config, seed=0, backend="torch", dtype="bfloat16")
    head = {"inp.weight": torch.ones(16, len(FEATURES)), "inp.bias": torch.zeros(16), "head.weight": torch.ones(1, 16),
            "head.bias": torch.zeros(1)}
    head = {k: v.to(torch.bfloat16) for k, v in head.items()}
    stream = MarketStream(head, params, config=config, instruments=[1],
                          normaliser=Normaliser(mean=np.zeros(len(FEATURES)), std=np.ones(len(FEATURES))))
    assert stream._bar is None
    bars = synthetic_bars("planted", 3, seed=0)
    got = [stream.update(np.array([1]), *(getattr(bars, f)[t:t + 1] for f in ("open", "high", "low", "close",
                                                                              "volume")))[0] for t in range(3)]
    assert np.isnan(got[0]) and np.isfinite(got[1:]).all()
