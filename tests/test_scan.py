"""The chunked scan equals the sequential recurrence, on every backend and dtype.

The oracle is ``selective_scan`` on NumPy float64; each backend's ``ssd_scan`` must match it (and,
in float64, match it to 1e-10). ``selective_scan`` itself runs on every backend on short inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, tol

import portable_ssm as ps


def scan_inputs(seed: int, b: int, l: int, h: int, p: int, g: int, n: int, *, dt_scale: float = 1.0,
                with_state: bool = True) -> dict:
    """Random float64 host inputs (A negative, as -exp(A_log))."""
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.standard_normal((b, l, h, p)),
        dt=dt_scale * rng.standard_normal((b, l, h)),
        A=-np.exp(rng.uniform(-1.0, 1.5, h)),
        B=rng.standard_normal((b, l, g, n)),
        C=rng.standard_normal((b, l, g, n)),
        D=rng.standard_normal(h),
        z=rng.standard_normal((b, l, h, p)),
        dt_bias=rng.standard_normal(h),
        initial_states=rng.standard_normal((b, h, p, n)) if with_state else None,
    )


def on(xp, host: dict, dtype: str) -> dict:
    """The host inputs on ``xp`` in ``dtype`` (states in the compute dtype, float32 at least)."""
    out = {k: None if v is None else xp.asarray_from(v, dtype) for k, v in host.items()}
    if host.get("initial_states") is not None:
        out["initial_states"] = xp.asarray_from(host["initial_states"], "float64" if dtype == "float64" else "float32")
    return out


def oracle(host: dict, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The sequential recurrence on NumPy float64."""
    return ps.selective_scan(**host, dt_softplus=True, return_final_states=True, **kw)


SHAPES = [  # (b, l, h, p, g, n, chunk_size)
    (1, 1, 1, 1, 1, 1, None),
    (2, 7, 4, 3, 2, 5, 3),
    (2, 64, 6, 4, 3, 8, 16),
    (1, 65, 4, 8, 1, 16, None),
    (3, 130, 8, 2, 4, 4, 32),
    (1, 300, 2, 4, 2, 6, 64),
]


@pytest.mark.parametrize("b,l,h,p,g,n,Q", SHAPES)
def test_ssd_scan_equals_sequential_recurrence(xp, dtype, b, l, h, p, g, n, Q):
    host = scan_inputs(l * 7 + h, b, l, h, p, g, n)
    y_ref, s_ref = oracle(host)
    y, s = xp.call(ps.ssd_scan, **on(xp, host, dtype), chunk_size=Q, dt_softplus=True, return_final_states=True)
    assert_close(xp, y, y_ref, rtol=tol(dtype), dtype=dtype, shape=(b, l, h, p))
    assert_close(xp, s, s_ref, rtol=tol(dtype), dtype=dtype, shape=(b, h, p, n))


def test_selective_scan_runs_on_every_backend(xp, dtype):
    host = scan_inputs(3, 2, 9, 4, 2, 2, 3)
    y_ref, s_ref = oracle(host)
    y, s = xp.call(ps.selective_scan, **on(xp, host, dtype), dt_softplus=True, return_final_states=True)
    assert_close(xp, y, y_ref, rtol=tol(dtype), dtype=dtype)
    assert_close(xp, s, s_ref, rtol=tol(dtype), dtype=dtype)


@pytest.mark.parametrize("l", [1, 2, 5, 17, 31, 63, 64, 65, 100, 129, 255, 256, 257, 300])
@pytest.mark.parametrize("Q", [1, 4, 16, 64, 256, None])
def test_ssd_scan_is_chunk_size_invariant_in_float64(l, Q):
    host = scan_inputs(l, 2, l, 4, 3, 2, 5)
    y_ref, s_ref = oracle(host)
    y, s = ps.ssd_scan(**host, chunk_size=Q, dt_softplus=True, return_final_states=True)
    assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max()
    assert np.abs(s - s_ref).max() <= 1e-10 * np.abs(s_ref).max()


def test_ssd_scan_without_optional_arguments_returns_y_only(xp):
    host = scan_inputs(5, 1, 20, 2, 3, 1, 4, with_state=False)
    core = {k: host[k] for k in ("x", "dt", "A", "B", "C")}
    expected = ps.selective_scan(**core)
    y = xp.call(ps.ssd_scan, **on(xp, core, "float32"))
    assert_close(xp, y, expected, rtol=tol("float32"), dtype="float32", shape=(1, 20, 2, 3))


def test_long_segments_carry_the_state_across_segment_boundaries(monkeypatch):
    import portable_ssm.ssd as ssd

    host = scan_inputs(11, 1, 200, 2, 2, 1, 3)
    y_ref, s_ref = oracle(host)
    monkeypatch.setattr(ssd, "SEGMENT_TOKENS", 48)  # 200 steps in 5 segments of 3 chunks of 16
    y, s = ps.ssd_scan(**host, chunk_size=16, dt_softplus=True, return_final_states=True)
    assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max()
    assert np.abs(s - s_ref).max() <= 1e-10 * np.abs(s_ref).max()


@pytest.mark.parametrize("D_shape", ["h", "hp"])
def test_skip_D_per_head_or_per_channel_and_gate(xp, D_shape):
    host = scan_inputs(13, 2, 33, 4, 3, 2, 4)
    if D_shape == "hp":
        host["D"] = np.random.default_rng(0).standard_normal((4, 3))
    y_ref, _ = oracle(host)
    no_skip = dict(host, D=None, z=None)
    y_plain, _ = oracle(no_skip)
    D = host["D"][:, None] if D_shape == "h" else host["D"]
    silu = host["z"] / (1 + np.exp(-host["z"]))
    np.testing.assert_allclose(y_ref, (y_plain + D * host["x"]) * silu, rtol=1e-10, atol=1e-12)
    y = xp.call(ps.ssd_scan, **on(xp, host, "float64"), dt_softplus=True, chunk_size=8)
    assert_close(xp, y, y_ref, rtol=1e-10, dtype="float64")


def test_chunk_size_selection_avoids_padding_short_sequences():
    assert ps.choose_chunk_size(60) == 60  # the seed shape: one chunk, no padding
    assert ps.choose_chunk_size(1) == 1
    assert ps.choose_chunk_size(300) == 60  # 5 chunks of 60 rather than 5 of 64 with 20 padded
    for l in range(1, 2000, 37):
        Q = ps.choose_chunk_size(l)
        c = -(-l // Q)
        assert Q <= max(l, 1) and c * Q - l < c, (l, Q)


def test_jax_native_state_passing_agrees_with_the_loop():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from portable_ssm.backends import fast_op

    from portable_ssm.ssd import pass_states_ref

    native = fast_op(jnp, "pass_states")
    assert native is not None
    rng = np.random.default_rng(0)
    state, S = jnp.asarray(rng.standard_normal((2, 3, 4, 5))), jnp.asarray(rng.standard_normal((2, 7, 3, 4, 5)))
    decay = jnp.asarray(rng.uniform(0, 1, (2, 7, 3, 1, 5)))
    entering, final = native(state, decay, S)
    entering_ref, final_ref = pass_states_ref(state, decay, S, xp=jnp)
    np.testing.assert_allclose(np.asarray(entering), np.asarray(entering_ref), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_ref), rtol=1e-12)
