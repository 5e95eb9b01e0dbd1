"""RMSNorm and the grouped gated RMSNorm: equal to the formula on every backend; NumPy's tiled path agrees."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, tol

from portable_ssm.norm import gated_rms_norm, gated_rms_norm_ref, rms_norm


def formula(y: np.ndarray, z: np.ndarray | None, weight: np.ndarray, groups: int, eps: float) -> np.ndarray:
    """``rmsnorm(y · silu(z))`` per group, written out in float64."""
    v = y if z is None else y * z / (1 + np.exp(-z))
    v = v.reshape(*v.shape[:-1], groups, -1)
    v = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    return v.reshape(y.shape) * weight


def data(rows: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, rows, d)), rng.standard_normal((2, rows, d)), rng.standard_normal(d)


@pytest.mark.parametrize(("groups", "gated"), [(1, True), (2, True), (1, False), (4, False)])
def test_gated_rms_norm_equals_the_formula(xp, dtype, groups, gated):
    y, z, w = data(5, 8)
    out = gated_rms_norm(xp.asarray_from(y, dtype), xp.asarray_from(z, dtype) if gated else None,
                         xp.asarray_from(w, dtype), groups, 1e-5, xp=xp.namespace)
    assert_close(xp, out, formula(y, z if gated else None, w, groups, 1e-5), rtol=tol(dtype), dtype=dtype,
                 shape=(2, 5, 8))


def test_rms_norm_is_the_ungated_norm_of_one_group(xp, dtype):
    y, _, w = data(3, 6, seed=1)
    out = rms_norm(xp.asarray_from(y, dtype), xp.asarray_from(w, dtype), 1e-6, xp=xp.namespace)
    assert_close(xp, out, formula(y, None, w, 1, 1e-6), rtol=tol(dtype), dtype=dtype, shape=(2, 3, 6))


@pytest.mark.parametrize("rows", [1, 31, 32, 33, 100])
@pytest.mark.parametrize(("groups", "gated"), [(1, True), (3, True), (1, False)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_numpy_tiled_norm_agrees_with_the_reference(rows, groups, gated, dtype, numpy_path, monkeypatch):
    import array_api_compat.numpy as nxp
    from portable_ssm.backends import fast_op
    from portable_ssm.backends.numpy import ops

    monkeypatch.setattr(ops, "TILE_ELEMENTS", 32 * 12)  # tiles of 32 rows of 12: 2·rows rows span several

    native = fast_op(nxp, "gated_rms_norm")
    assert native is not None
    y, z, w = (v.astype(dtype) for v in data(rows, 12, seed=rows))
    inputs = (y.copy(), z.copy())
    out = native(y, z if gated else None, w, groups, 1e-5)
    ref = gated_rms_norm_ref(y, z if gated else None, w, groups, 1e-5, xp=nxp)
    assert out.dtype == ref.dtype == np.dtype(dtype) and out.shape == ref.shape == (2, rows, 12)
    rtol = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-13}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(y, inputs[0])
    np.testing.assert_array_equal(z, inputs[1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_tiled_norm_gates_very_negative_z_to_zero_without_overflow_warnings(dtype, numpy_path):
    """NumPy's gate is ``z / (1 + exp(-z))``: exp overflows to inf below -88 (float32) or -709
    (float64), and the gate must then be SiLU's limit 0, silently, as the reference's."""
    import warnings

    import array_api_compat.numpy as nxp
    from portable_ssm.backends import fast_op

    y, z, w = (v.astype(dtype) for v in data(40, 12, seed=3))
    z[:, ::2] = -1e4  # every other row's gate underflows to (minus) zero
    z[:, 1::4] = 30.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fast_op(nxp, "gated_rms_norm")(y, z, w, 2, 1e-5)
    ref = gated_rms_norm_ref(y, z, w, 2, 1e-5, xp=nxp)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-6 if dtype == "float32" else 1e-13, atol=1e-6)
    np.testing.assert_array_equal(out[:, ::2], 0.0)


@pytest.mark.parametrize(("groups", "gated"), [(1, True), (3, True), (1, False)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_torch_native_norm_agrees_with_the_reference_in_value_and_gradient(groups, gated, dtype):
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as txp
    from portable_ssm.backends import fast_op

    native = fast_op(txp, "gated_rms_norm")
    assert native is not None
    y, z, w = (torch.from_numpy(v).to(getattr(torch, dtype)).requires_grad_() for v in data(7, 12, seed=groups))
    zz = z if gated else None
    out, ref = native(y, zz, w, groups, 1e-5), gated_rms_norm_ref(y, zz, w, groups, 1e-5, xp=txp)
    assert out.dtype == ref.dtype == getattr(torch, dtype) and out.shape == ref.shape == (2, 7, 12)
    rtol = {"bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-13}[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
    leaves = [y, w] + ([z] if gated else [])
    grads = torch.autograd.grad(out, leaves, cotangent)
    grads_ref = torch.autograd.grad(ref, leaves, cotangent)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=10 * rtol, atol=10 * rtol)
