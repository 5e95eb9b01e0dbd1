"""The causal depthwise conv: equals a direct convolution, carries its window, native path agrees."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from portable_ssm.conv import causal_conv1d, causal_conv1d_ref, conv_step


def direct(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """y[t, c] = bias[c] + Σ_j w[c, j] · x[t - (k-1) + j, c], zeros before the start."""
    b, l, d = x.shape
    k = w.shape[1]
    y = np.broadcast_to(bias, (b, l, d)).copy()
    for t in range(l):
        for j in range(k):
            s = t - (k - 1) + j
            if s >= 0:
                y[:, t] += w[:, j] * x[:, s]
    return y


def data(l: int, d: int = 5, k: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, l, d)), rng.standard_normal((d, k)), rng.standard_normal(d)


@pytest.mark.parametrize("l,k", [(1, 4), (3, 4), (10, 4), (9, 2), (6, 1)])
def test_reference_conv_equals_direct_convolution(xp, l, k):
    x, w, bias = data(l, k=k)
    y, state = causal_conv1d_ref(*(xp.asarray_from(v, "float64") for v in (x, w, bias)), None, xp=xp.namespace)
    assert_close(xp, y, direct(x, w, bias), rtol=1e-14, dtype="float64", shape=x.shape)
    padded = np.concatenate([np.zeros((2, k - 1, 5)), x], axis=1)
    assert_close(xp, state, padded[:, -k:].transpose(0, 2, 1), rtol=0, shape=(2, 5, k))


def test_conv_state_carries_the_window_across_a_split(xp):
    x, w, bias = (xp.asarray_from(v, "float64") for v in data(13))
    whole, end = causal_conv1d(x, w, bias, None, xp=xp.namespace)
    first, mid = causal_conv1d(x[:, :5, :], w, bias, None, xp=xp.namespace)
    second, end2 = causal_conv1d(x[:, 5:, :], w, bias, mid, xp=xp.namespace)
    assert_close(xp, second, xp.numpy(whole)[:, 5:], rtol=1e-14)
    assert_close(xp, end2, xp.numpy(end), rtol=0)


def test_conv_step_loop_equals_the_sequence_conv(xp):
    x, w, bias = (xp.asarray_from(v, "float64") for v in data(7))
    expected, end = causal_conv1d(x, w, bias, None, xp=xp.namespace)
    state = xp.asarray_from(np.zeros((2, 5, 4)), "float64")
    ys = []
    for t in range(7):
        y_t, state = conv_step(x[:, t, :], w, bias, state, xp=xp.namespace)
        ys.append(xp.numpy(y_t))
    np.testing.assert_allclose(np.stack(ys, axis=1), xp.numpy(expected), rtol=1e-14)
    assert_close(xp, state, xp.numpy(end), rtol=0)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_native_conv_agrees_with_the_reference(with_state, dtype):
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as txp
    from portable_ssm.backends import fast_op

    native = fast_op(txp, "causal_conv1d")
    assert native is not None
    x, w, bias = (torch.from_numpy(v).to(getattr(torch, dtype)) for v in data(11, d=7, k=4, seed=3))
    state = torch.randn(2, 7, 4, dtype=getattr(torch, dtype)) if with_state else None
    y_native, s_native = native(x, w, bias, state)
    y_ref, s_ref = causal_conv1d_ref(x, w, bias, state, xp=txp)
    torch.testing.assert_close(y_native, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s_native, s_ref, rtol=0, atol=0)


@pytest.mark.parametrize("with_state", [False, True])
def test_torch_native_conv_silu_agrees_with_the_conv_then_silu(with_state):
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as txp
    from portable_ssm.backends import fast_op

    from portable_ssm._array import silu

    native = fast_op(txp, "causal_conv1d_silu")
    assert native is not None
    x, w, bias = (torch.from_numpy(v) for v in data(33, d=7, k=4, seed=9))
    state = torch.randn(2, 7, 4, dtype=torch.float64) if with_state else None
    y, s = native(x, w, bias, state)
    y_ref, s_ref = causal_conv1d_ref(x, w, bias, state, xp=txp)
    torch.testing.assert_close(y, silu(y_ref, xp=txp), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)


def test_torch_native_conv_under_autograd_is_the_reference_with_its_gradients():
    """Where autograd records, the torch conv is the reference's shifted slices (whose backward is
    elementwise), not conv1d: the same values and gradients, and no convolution in the graph."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as txp
    from portable_ssm.backends import fast_op

    native = fast_op(txp, "causal_conv1d")
    x, w, bias = (torch.from_numpy(v).requires_grad_() for v in data(20, d=5, k=4, seed=2))
    state = torch.randn(2, 5, 4, dtype=torch.float64)
    y, s = native(x, w, bias, state)
    y_ref, s_ref = causal_conv1d_ref(x, w, bias, state, xp=txp)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    nodes, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack.extend(next_fn for next_fn, _ in node.next_functions)
    assert not any("Convolution" in type(node).__name__ for node in nodes)
    cotangent = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((y * cotangent).sum() + s.sum(), (x, w, bias))
    grads_ref = torch.autograd.grad((y_ref * cotangent).sum() + s_ref.sum(), (x, w, bias))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # without autograd: torch's conv1d, the same values
        y_conv, _ = native(x, w, bias, state)
    torch.testing.assert_close(y_conv, y_ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("l", [1, 31, 32, 75])
def test_numpy_tiled_conv_agrees_with_the_reference(with_state, dtype, l, monkeypatch):
    import array_api_compat.numpy as nxp
    from portable_ssm.backends import fast_op
    from portable_ssm.backends.numpy import ops

    monkeypatch.setattr(ops, "TILE_ELEMENTS", 2 * 32 * 7)  # tiles of 32 steps of [2, 7]: l=75 spans three

    native = fast_op(nxp, "causal_conv1d")
    assert native is not None
    x, w, bias = (v.astype(dtype) for v in data(l, d=7, k=4, seed=5))
    state = np.random.default_rng(1).standard_normal((2, 7, 4)).astype(dtype) if with_state else None
    y_native, s_native = native(x, w, bias, state)
    y_ref, s_ref = causal_conv1d_ref(x, w, bias, state, xp=nxp)
    assert y_native.dtype == y_ref.dtype and y_native.shape == y_ref.shape == (2, l, 7)
    np.testing.assert_allclose(y_native, y_ref, rtol=1e-6 if dtype == "float32" else 1e-14, atol=1e-6)
    np.testing.assert_array_equal(s_native, s_ref)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("l,k", [(1, 4), (2, 4), (33, 4), (75, 4), (40, 9)])
def test_numpy_fused_conv_silu_agrees_with_the_conv_then_silu(with_state, dtype, l, k, numpy_path, monkeypatch):
    import array_api_compat.numpy as nxp
    from portable_ssm.backends import fast_op
    from portable_ssm.backends.numpy import ops

    from portable_ssm._array import silu

    monkeypatch.setattr(ops, "TILE_ELEMENTS", 2 * 32 * 7)  # tiles of 32 steps of [2, 7]: l=33 spans two

    native = fast_op(nxp, "causal_conv1d_silu")
    assert native is not None
    x, w, bias = (v.astype(dtype) for v in data(l, d=7, k=k, seed=7))
    state = np.random.default_rng(2).standard_normal((2, 7, k)).astype(dtype) if with_state else None
    x_before = x.copy()
    y_native, s_native = native(x, w, bias, state)
    y_ref, s_ref = causal_conv1d_ref(x, w, bias, state, xp=nxp)
    assert y_native.dtype == y_ref.dtype and y_native.shape == (2, l, 7)
    np.testing.assert_allclose(y_native, silu(y_ref, xp=nxp), rtol=1e-6 if dtype == "float32" else 1e-14, atol=1e-6)
    np.testing.assert_array_equal(s_native, s_ref)
    np.testing.assert_array_equal(x, x_before)


def test_numpy_fused_conv_silu_is_silent_and_exact_where_exp_overflows(numpy_path):
    """NumPy's SiLU is ``y / (1 + exp(-y))``: for y below -88 exp overflows to inf and the result
    must be SiLU's limit (minus) zero, with no overflow warning, like the reference's. The conv sums
    terms of about 1e4 there, so its rounding is bounded by the sum of the terms' magnitudes (the
    compiled kernel adds them in another order than the reference)."""
    import warnings

    import array_api_compat.numpy as nxp
    from portable_ssm.backends import fast_op

    from portable_ssm._array import silu

    x, w, bias = (v.astype("float32") for v in data(40, d=7, k=4, seed=8))
    x[:, 10:20] = -1e4  # the conv output there is far below -88
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, _ = fast_op(nxp, "causal_conv1d_silu")(x, w, bias, None)
    y_ref, _ = causal_conv1d_ref(x, w, bias, None, xp=nxp)
    want = silu(y_ref, xp=nxp)
    magnitude, _ = causal_conv1d_ref(np.abs(x), np.abs(w), np.abs(bias), None, xp=nxp)  # Σ |terms|
    assert np.isfinite(y).all() and (y_ref < -88).any()
    assert (np.abs(y - want) <= 1e-6 + 1e-6 * np.abs(want) + 1e-6 * magnitude).all()
    np.testing.assert_array_equal(y[y_ref < -88], 0.0)


def test_conv_silu_equals_conv_then_silu_on_every_backend(xp):
    from portable_ssm._array import silu
    from portable_ssm.conv import causal_conv1d_silu

    x, w, bias = (xp.asarray_from(v, "float64") for v in data(12, d=5, k=4, seed=4))
    y, state = causal_conv1d_silu(x, w, bias, None, xp=xp.namespace)
    y_ref, state_ref = causal_conv1d_ref(x, w, bias, None, xp=xp.namespace)
    assert_close(xp, y, xp.numpy(silu(y_ref, xp=xp.namespace)), rtol=1e-6)
    assert_close(xp, state, xp.numpy(state_ref), rtol=0)
