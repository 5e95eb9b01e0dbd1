"""The full stack: every backend equals NumPy float64, state carries across splits, steps equal forward."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, rel_err, tol

import portable_ssm as ps

CFG = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, ngroups=2)


def host_model(cfg: ps.Mamba2Config = CFG, seed: int = 0) -> dict:
    return ps.init_params(cfg, seed=seed, dtype="float64")


def inputs(b: int, l: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((b, l, d))


@pytest.fixture(scope="module")
def reference():
    """NumPy float64 forward of a fixed model and input: what every backend must reproduce."""
    params, x = host_model(), inputs(2, 37, CFG.d_model)
    return params, x, ps.forward(x, params, config=CFG)


def test_every_backend_equals_numpy_float64(xp, dtype, reference):
    params, x, expected = reference
    y = xp.call(ps.forward, xp.asarray_from(x, dtype), ps.cast_params(params, dtype, backend=xp.name,
                                                                        device=xp.device), config=CFG)
    assert_close(xp, y, expected, rtol=1e-10 if dtype == "float64" else 1e-5, dtype=dtype, shape=x.shape)


def test_forward_on_second_half_from_first_half_state_equals_whole(xp, dtype):
    params = ps.cast_params(host_model(seed=1), dtype, backend=xp.name, device=xp.device)
    x = xp.asarray_from(inputs(2, 50, CFG.d_model, seed=1), dtype)
    whole, end_state = xp.call(ps.forward, x, params, config=CFG, return_state=True)
    first, mid_state = xp.call(ps.forward, x[:, :23, :], params, config=CFG, return_state=True)
    second, split_end = xp.call(ps.forward, x[:, 23:, :], params, config=CFG, initial_state=mid_state,
                                return_state=True)
    joined = np.concatenate([xp.numpy(first), xp.numpy(second)], axis=1)
    assert_close(xp, whole, joined, rtol=tol(dtype), dtype=dtype)
    for a, b in zip(end_state.conv + end_state.ssm, split_end.conv + split_end.ssm):
        assert_close(xp, b, xp.numpy(a), rtol=tol(dtype))


def test_step_loop_equals_forward(xp, dtype):
    params = ps.cast_params(host_model(seed=2), dtype, backend=xp.name, device=xp.device)
    x = xp.asarray_from(inputs(3, 12, CFG.d_model, seed=2), dtype)
    expected, final = xp.call(ps.forward, x, params, config=CFG, return_state=True)
    state, ys = None, []
    for t in range(12):
        y_t, state = xp.call(ps.step, x[:, t, :], state, params, config=CFG)
        ys.append(xp.numpy(y_t))
    assert_close(xp, expected, np.stack(ys, axis=1), rtol=tol(dtype), dtype=dtype)
    for a, b in zip(final.ssm, state.ssm):
        assert_close(xp, b, xp.numpy(a), rtol=tol(dtype))


def test_step_after_prefill_equals_forward_over_the_whole_sequence():
    params, x = host_model(seed=3), inputs(2, 30, CFG.d_model, seed=3)
    whole = ps.forward(x, params, config=CFG)
    _, state = ps.forward(x[:, :29], params, config=CFG, return_state=True)
    y_last, _ = ps.step(x[:, 29], state, params, config=CFG)
    assert rel_err(y_last, whole[:, 29]) <= 1e-12


def test_step_does_not_mutate_its_state():
    params, x = host_model(), inputs(1, 5, CFG.d_model)
    _, state = ps.forward(x, params, config=CFG, return_state=True)
    before = [a.copy() for a in state.conv + state.ssm]
    ps.step(x[:, 0], state, params, config=CFG)
    assert all(np.array_equal(a, b) for a, b in zip(before, state.conv + state.ssm))


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax", "array_api_strict"])
def test_one_liner_converts_and_builds_the_default_model(backend):
    pytest.importorskip(backend)
    from portable_ssm._array import array_backend

    x = np.random.default_rng(0).standard_normal((2, 10, 24)).astype(np.float32)
    y = ps.forward(x, backend=backend)
    assert array_backend(y) == backend and tuple(y.shape) == (2, 10, 24)
    expected = ps.forward(x, ps.init_params(ps.default_config(24)), config=ps.default_config(24))
    assert rel_err(ps.to_backend(y, "numpy"), expected) <= 1e-5


def test_converted_params_are_cached_between_calls():
    torch = pytest.importorskip("torch")
    import portable_ssm.model as model

    params, x = host_model(), inputs(1, 4, CFG.d_model)
    ps.forward(x, params, config=CFG, backend="torch")
    cached = [entry for entry in model._CACHE.values() if entry[0] is params]
    assert len(cached) == 1 and all(isinstance(v, torch.Tensor) for v in cached[0][1].values())
    ps.forward(x, params, config=CFG, backend="torch")
    assert [entry for entry in model._CACHE.values() if entry[0] is params] == cached


def test_default_config_fits_any_width():
    for d in (1, 7, 24, 100, 256):
        cfg = ps.default_config(d)
        assert cfg.d_model == d and cfg.d_inner % cfg.headdim == 0 and cfg.headdim <= 64


def test_whole_forward_runs_on_array_api_strict():
    xps = pytest.importorskip("array_api_strict")
    params, x = host_model(), inputs(2, 70, CFG.d_model)
    y, state = ps.forward(xps.asarray(x), ps.cast_params(params, "float64", backend="array_api_strict"),
                          config=CFG, return_state=True)
    assert type(y).__module__.startswith("array_api_strict")
    assert rel_err(np.asarray(y), ps.forward(x, params, config=CFG)) <= 1e-12
    y_t, _ = ps.step(xps.asarray(x[:, 0]), state, ps.cast_params(params, "float64", backend="array_api_strict"),
                     config=CFG)
    assert tuple(y_t.shape) == (2, CFG.d_model)


def test_100k_step_sequence_with_large_dt_stays_finite():
    cfg = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4)
    params = ps.init_params(cfg)
    params["layers.0.mixer.dt_bias"] = params["layers.0.mixer.dt_bias"] + np.float32(8.0)  # Δ ≈ 8: A·Δ ≈ -128
    x = 3.0 * np.random.default_rng(0).standard_normal((1, 100_000, 8)).astype(np.float32)
    y, state = ps.forward(x, params, config=cfg, return_state=True)
    assert np.isfinite(y).all() and all(np.isfinite(s).all() for s in state.ssm)


def test_100k_step_scan_with_large_dt_stays_finite_and_matches_its_tail():
    rng = np.random.default_rng(1)
    b, l, h, p, g, n = 1, 100_000, 2, 2, 1, 2
    x, B, C = rng.standard_normal((b, l, h, p)), rng.standard_normal((b, l, g, n)), rng.standard_normal((b, l, g, n))
    dt, A = 50.0 + rng.standard_normal((b, l, h)), -np.exp(rng.uniform(0, 2.7, h))  # A·Δ down to -750
    f32 = [v.astype(np.float32) for v in (x, dt, A, B, C)]
    y, s = ps.ssd_scan(*f32, dt_softplus=True, return_final_states=True)
    assert np.isfinite(y).all() and np.isfinite(s).all()
    tail = ps.selective_scan(*[v[:, -40:] if v.ndim > 1 else v for v in f32], dt_softplus=True)
    assert rel_err(y[:, -30:], tail[:, -30:]) <= 1e-5  # Δ is huge, so the distant past is forgotten


def test_long_inputs_run_in_token_blocks_with_the_same_result(monkeypatch):
    import portable_ssm.model as model

    params, x = host_model(seed=4), inputs(2, 100, CFG.d_model, seed=4)
    whole, whole_state = ps.forward(x, params, config=CFG, return_state=True)
    monkeypatch.setattr(model, "BLOCK_TOKENS", 24)  # 100 tokens in 5 blocks
    blocked, blocked_state = ps.forward(x, params, config=CFG, return_state=True)
    assert rel_err(blocked, whole) <= 1e-12
    for a, b in zip(whole_state.conv + whole_state.ssm, blocked_state.conv + blocked_state.ssm):
        assert rel_err(b, a) <= 1e-12


def test_layer_stands_in_for_each_mixer_over_the_whole_sequence(monkeypatch):
    import portable_ssm.model as model
    from portable_ssm.mixer import mixer

    params, x = host_model(seed=5), inputs(2, 30, CFG.d_model, seed=5)
    seq_idx = np.repeat(np.array([[0] * 12 + [1] * 18]), 2, axis=0)
    monkeypatch.setattr(model, "BLOCK_TOKENS", 8)  # the plain mixer would run in 4 blocks
    calls = []

    def layer(u, *args, **kwargs):
        calls.append((u.shape, "seq_idx" in kwargs))
        return mixer(u, *args, **kwargs)

    for ids in (None, seq_idx):
        expected = ps.forward(x, params, config=CFG, seq_idx=ids)
        calls.clear()
        got = ps.forward(x, params, config=CFG, seq_idx=ids, layer=layer)
        assert rel_err(got, expected) <= 1e-12
        assert calls == [((2, 30, CFG.d_model), ids is not None)] * CFG.n_layer
    with pytest.raises(TypeError, match="layer: expected None or a callable"):
        ps.forward(x, params, config=CFG, layer="checkpoint")
