"""The chunked scan equals the sequential recurrence, on every backend and dtype.

The oracle is ``selective_scan`` on NumPy float64; each backend's ``ssd_scan`` must match it (and,
in float64, match it to 1e-10). ``selective_scan`` itself runs on every backend on short inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import assert_close, rel_err, tol

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
    from portable_ssm.backends import numpy as numpy_backend

    import portable_ssm.ssd as ssd

    host = scan_inputs(11, 1, 200, 2, 2, 1, 3)
    y_ref, s_ref = oracle(host)
    monkeypatch.delitem(numpy_backend.FAST_OPS, "ssd_chunked")  # the reference, which runs in segments
    monkeypatch.setattr(ssd, "SEGMENT_TOKENS", 48)  # 200 steps in 5 segments of 3 chunks of 16
    y, s = ps.ssd_scan(**host, chunk_size=16, dt_softplus=True, return_final_states=True)
    assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max()
    assert np.abs(s - s_ref).max() <= 1e-10 * np.abs(s_ref).max()


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_decay_flushes_factors_below_the_floor_to_zero_never_subnormal(xp, dtype_name):
    from portable_ssm.ssd import decay

    if dtype_name == "float64" and xp.name == "jax":
        pytest.importorskip("jax").config.update("jax_enable_x64", True)
    exponents = np.array([-800.0, -400.0, -100.0, -43.0, -1.0, 0.0, -math.inf])
    keep = np.array([True, True, True, True, True, False, True])
    out = xp.numpy(xp.call(decay, xp.asarray_from(exponents, dtype_name), keep=xp.asarray_from(keep), xp=xp.namespace))
    expected = np.where(keep, np.exp(exponents), 0.0)
    floor = np.log(np.finfo(dtype_name).smallest_normal) / 2  # exp(floor) ~ 1e-19 (float32), 1e-154 (float64)
    expected[exponents < floor] = 0.0
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=0)
    assert not np.any((out != 0) & (np.abs(out) < np.finfo(dtype_name).smallest_normal))
    assert out[5] == 0.0  # masked: 0 even where exp would give 1


class _MatmulSpy:
    """Stands in for the numpy module inside the NumPy backend, recording every matmul operand."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def __getattr__(self, name: str):
        return getattr(np, name)

    def matmul(self, a, b, **kwargs):
        self.seen.extend(np.array(v) for v in (a, b))
        return np.matmul(a, b, **kwargs)


@pytest.mark.parametrize("path", ["reference", "numpy native", "numpy compiled"])
def test_strongly_decaying_scan_has_no_subnormal_operands_and_matches_the_recurrence(path, monkeypatch):
    """The reference's and NumPy's loop's matmul operands hold no subnormal (they cost 100x in a
    BLAS); NumPy's compiled scan, whose products run in C++, matches the recurrence all the same."""
    from portable_ssm.backends import numpy as numpy_backend
    from portable_ssm.backends.cpu_source import ENV
    from portable_ssm.backends.numpy import kernels
    from portable_ssm.backends.numpy import ops as numpy_ops

    import portable_ssm.ssd as ssd

    host = scan_inputs(17, 1, 256, 4, 8, 1, 16)
    host["A"] = -np.full(4, 30.0)  # A·Δ of -10 to -60 per step: most decays within a chunk underflow float32
    f32 = {k: None if v is None else v.astype(np.float32) for k, v in host.items()}
    seen: list = []
    if path == "reference":
        monkeypatch.delitem(numpy_backend.FAST_OPS, "ssd_chunked")
        matmul = ssd._matmul

        def spy(a, b, *, xp):
            seen.extend(np.asarray(v) for v in (a, b))
            return matmul(a, b, xp=xp)

        monkeypatch.setattr(ssd, "_matmul", spy)
    elif path == "numpy native":
        monkeypatch.setenv(ENV, "0")
        monkeypatch.setattr(numpy_ops, "np", _MatmulSpy(seen))
    else:
        if kernels.library() is None or kernels.blas_sgemm() is None:
            pytest.skip("NumPy's compiled scan: not usable here (needs its CPU kernels and OpenBLAS's sgemm)")
        scan = kernels.ssd_chunked
        monkeypatch.setattr(kernels, "ssd_chunked", lambda *a: seen.append(scan(*a)) or seen[-1])
    y = ps.ssd_scan(**f32, dt_softplus=True, chunk_size=64)
    tiny = np.finfo(np.float32).smallest_normal
    if path == "numpy compiled":
        assert len(seen) == 1 and seen[0] is not None
    else:
        assert seen and not any(np.any((v != 0) & (np.abs(v) < tiny)) for v in seen)
    y_ref, _ = oracle({k: None if v is None else v.astype(np.float64) for k, v in f32.items()})
    assert rel_err(y, y_ref) < tol("float32")


def test_final_state_comes_back_row_major_on_numpy():
    # a strided [b, h, p, n] view (the scan keeps states n-major) made every decode step's update
    # walk n with a large stride: 4x slower per token
    host = scan_inputs(19, 1, 70, 4, 8, 1, 16)
    _, final = ps.ssd_scan(**{k: v.astype(np.float32) for k, v in host.items()}, dt_softplus=True,
                           return_final_states=True)
    assert final.shape == (1, 4, 8, 16) and final.flags.c_contiguous


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


@pytest.mark.parametrize("injected", [False, True])
@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_native_state_passing_agrees_with_the_loop(backend, injected):
    if backend == "jax":
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
    from portable_ssm.backends import fast_op, load

    from portable_ssm.ssd import pass_states_ref

    xp = load(backend).namespace()
    native = fast_op(xp, "pass_states")
    assert native is not None
    rng = np.random.default_rng(0)
    b, c, g, n, r, p, Q = 2, 7, 2, 4, 3, 5, 6
    state = xp.asarray(rng.standard_normal((b, g, n, r, p)))
    decay = xp.asarray(rng.uniform(0, 1, (b, c, g, 1, r, 1)))
    Bt, C = (xp.asarray(rng.standard_normal(s)) for s in ((b, c, g, n, Q), (b, c, g, Q, n)))
    X = xp.permute_dims(xp.asarray(rng.standard_normal((b, c, Q, g, r * p))), (0, 1, 3, 2, 4))  # as the scan: a view
    before = np.array(state, copy=True)
    if injected:  # per-sequence initial states (cu_seqlens): the states leaving every chunk come back
        inject = xp.asarray(rng.standard_normal((b, c, g, n, r, p)))
        outputs, final = native(state, decay, Bt, X, C, inject)
        outputs_ref, final_ref = pass_states_ref(state, decay, Bt, X, C, xp=xp, inject=inject)
        assert final.shape == (b, c, g, n, r, p)
    else:
        outputs, final = native(state, decay, Bt, X, C)
        outputs_ref, final_ref = pass_states_ref(state, decay, Bt, X, C, xp=xp)
        assert final.shape == state.shape
    assert outputs.shape == (b, c, g, Q, r * p)
    np.testing.assert_allclose(np.asarray(outputs), np.asarray(outputs_ref), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_ref), rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(state), before)  # the caller's state is left alone


@pytest.mark.parametrize(("l", "Q", "g", "D", "initial"),
                         [(1, None, 1, None, False), (45, 7, 3, "h", True), (64, None, 1, "hp", True),
                          (130, 64, 2, "h", False), (300, None, 1, "h", True), (5, 16, 1, "hp", False)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("head_block", [None, 3])
@pytest.mark.parametrize("group_chunks", [None, 1, 3])
def test_numpy_native_scan_agrees_with_the_reference(l, Q, g, D, initial, dtype, head_block, group_chunks,
                                                     numpy_path, monkeypatch):
    import array_api_compat.numpy as nxp
    from portable_ssm.backends import fast_op
    from portable_ssm.backends.numpy import ops as numpy_ops

    from portable_ssm.ssd import ssd_chunked_ref

    native = fast_op(nxp, "ssd_chunked")
    assert native is not None
    if head_block is not None:  # groups of 4 heads, scanned in blocks of 3 and 1
        monkeypatch.setattr(numpy_ops, "SCAN_HEAD_BLOCK", head_block)
    if group_chunks is not None:  # 3: whole chunks in groups of 3 and fewer, a short last chunk alone
        monkeypatch.setattr(numpy_ops, "SCAN_GROUP_CHUNKS", group_chunks)
    h, p, n = 4 * g, 3, 5
    host = scan_inputs(l + g, 2, l, h, p, g, n, with_state=initial)
    args = {k: None if host[k] is None else host[k].astype(dtype) for k in ("x", "B", "C", "A", "initial_states")}
    args["dt"] = np.exp(host["dt"] - 1.0).astype(dtype)  # Δ > 0
    args["D"] = {None: None, "h": host["D"], "hp": np.outer(host["D"], np.arange(1.0, p + 1))}[D]
    args["D"] = None if args["D"] is None else args["D"].astype(dtype)
    before = {k: None if v is None else v.copy() for k, v in args.items()}
    y, final = native(args["x"], args["dt"], args["A"], args["B"], args["C"], Q, args["initial_states"], D=args["D"])
    y_ref, final_ref = ssd_chunked_ref(**args, chunk_size=Q, xp=nxp)
    assert y.dtype == y_ref.dtype == np.dtype(dtype) and y.shape == (2, l, h, p) and final.shape == (2, h, p, n)
    assert rel_err(y, y_ref) < (1e-5 if dtype == "float32" else 1e-12)
    assert rel_err(final, final_ref) < (1e-5 if dtype == "float32" else 1e-12)
    assert final.flags.c_contiguous
    for k, v in before.items():  # the inputs (the initial state included) are left alone
        np.testing.assert_array_equal(args[k], v)


@pytest.mark.parametrize("b,l,h,p,g,n,Q", SHAPES)
@pytest.mark.parametrize("D_shape", ["h", "hp", None])
def test_last_output_and_final_state_alone_equal_the_chunked_scan(xp, dtype, b, l, h, p, g, n, Q, D_shape):
    """``ssd_last`` (what a prompt pass's last layer runs) gives the chunked scan's last output and
    final state, with and without an initial state."""
    from portable_ssm.ssd import ssd_chunked_ref, ssd_last

    host = scan_inputs(l * 5 + h, b, l, h, p, g, n)
    host["dt"] = np.exp(host["dt"] - 1.0)  # Δ > 0
    host["D"] = {"h": host["D"], "hp": np.outer(host["D"], np.arange(1.0, p + 1)), None: None}[D_shape]
    args = on(xp, {k: host[k] for k in ("x", "dt", "A", "B", "C", "D", "initial_states")}, dtype)
    for initial in (args["initial_states"], None):
        kw = dict(args, initial_states=initial)
        y, final = xp.call(ssd_chunked_ref, **kw, chunk_size=Q, xp=xp.namespace)
        y_last, final_last = xp.call(ssd_last, **kw, xp=xp.namespace)
        assert y_last.shape == (b, h, p) and final_last.shape == (b, h, p, n) and y_last.dtype == y.dtype
        assert_close(xp, y_last, xp.numpy(y)[:, -1], rtol=tol(dtype), dtype=dtype)
        assert_close(xp, final_last, xp.numpy(final), rtol=tol(dtype), dtype=dtype)


def test_last_output_of_a_100k_step_float32_scan_keeps_the_chunked_scans_accuracy():
    """The suffix sums over the whole sequence lose no more digits than the chunks' products: on
    100k steps of slow decay (every step weighs) both stay within 1e-4 of the float64 scan."""
    import array_api_compat.numpy as nxp

    from portable_ssm.ssd import ssd_chunked_ref, ssd_last

    host = scan_inputs(3, 1, 100_000, 4, 8, 2, 16)
    args = {k: host[k] for k in ("x", "A", "B", "C", "D", "initial_states")}
    args |= {"dt": np.abs(host["dt"]) * 5e-4, "A": host["A"] * 1e-2}
    y64, final64 = ssd_chunked_ref(**args, chunk_size=None, xp=nxp)
    f32 = {k: v.astype(np.float32) for k, v in args.items()}
    y_last, final_last = ssd_last(**f32, xp=nxp)
    y32, final32 = ssd_chunked_ref(**f32, chunk_size=None, xp=nxp)
    assert rel_err(y_last, y64[:, -1]) < 1e-4 and rel_err(final_last, final64) < 1e-4
    assert rel_err(final_last, final64) <= 2 * rel_err(final32, final64) + 1e-6


def test_numpy_native_scan_hands_packed_rows_to_the_reference(monkeypatch):
    import array_api_compat.numpy as nxp
    from portable_ssm.backends.numpy import ops as numpy_ops

    import portable_ssm.ssd as ssd

    host = scan_inputs(3, 2, 20, 2, 3, 1, 4)
    args = {k: host[k] for k in ("x", "A", "B", "C", "initial_states")} | {"dt": np.exp(host["dt"] - 1.0)}
    seq_idx = np.repeat(np.array([[0, 1], [0, 0]]), 10, axis=1)  # [2, 20]: the first row holds two sequences
    calls = []
    reference = ssd.ssd_chunked_ref
    monkeypatch.setattr(ssd, "ssd_chunked_ref", lambda *a, **kw: calls.append(kw["seq_idx"]) or reference(*a, **kw))
    y, final = numpy_ops.ssd_chunked(args["x"], args["dt"], args["A"], args["B"], args["C"], None,
                                         args["initial_states"], seq_idx=seq_idx)
    y_ref, final_ref = reference(**args, chunk_size=None, xp=nxp, seq_idx=seq_idx)
    assert len(calls) == 1 and calls[0] is seq_idx
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(final, final_ref)


@pytest.mark.parametrize(("l", "Q", "g", "initial"), [(45, 7, 3, True), (130, None, 1, False)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_cpu_inference_scan_is_the_scan_kernel_in_float32_and_numpys_native_scan_in_float64(l, Q, g, initial,
                                                                                                   dtype, monkeypatch):
    """CPU tensors outside autograd take the C++ scan kernel in float32 where the kernels are built
    (tests/test_torch_kernels.py tests it), else NumPy's chunk loop on zero-copy views, and come
    back as torch tensors equal to the reference; where autograd records, the
    ``portable_ssm::ssd_scan`` op, whose forward is the same scan, with gradients
    (tests/test_gradients.py compares them)."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as txp
    from portable_ssm.backends import fast_op, torch_kernels
    from portable_ssm.backends.numpy import ops as numpy_ops

    from portable_ssm.ssd import ssd_chunked_ref

    native = fast_op(txp, "ssd_chunked")
    assert native is not None
    calls = []
    numpy_scan = numpy_ops.ssd_chunked
    monkeypatch.setattr(numpy_ops, "ssd_chunked", lambda *a, **kw: calls.append(a[0]) or numpy_scan(*a, **kw))
    h, p, n = 4 * g, 3, 5
    host = scan_inputs(l, 2, l, h, p, g, n, with_state=initial)
    args = {k: None if host[k] is None else torch.from_numpy(host[k]).to(getattr(torch, dtype))
            for k in ("x", "B", "C", "A", "D", "initial_states")}
    args["dt"] = torch.from_numpy(np.exp(host["dt"] - 1.0)).to(getattr(torch, dtype))  # Δ > 0
    order = ("x", "dt", "A", "B", "C")
    y, final = native(*(args[k] for k in order), Q, args["initial_states"], D=args["D"])
    y_ref, final_ref = ssd_chunked_ref(**args, chunk_size=Q, xp=txp)
    per_scan = 0 if dtype == "float32" and torch_kernels.ensure() else 1  # NumPy's loop runs once a scan
    assert len(calls) == per_scan and all(np.shares_memory(v, args["x"].numpy()) for v in calls)
    assert isinstance(y, torch.Tensor) and y.dtype == y_ref.dtype == getattr(torch, dtype)
    assert y.shape == (2, l, h, p) and final.shape == (2, h, p, n)
    assert rel_err(y.numpy(), y_ref.numpy()) < (1e-5 if dtype == "float32" else 1e-12)
    assert rel_err(final.numpy(), final_ref.numpy()) < (1e-5 if dtype == "float32" else 1e-12)

    args["x"].requires_grad_()
    y_grad, _ = native(*(args[k] for k in order), Q, args["initial_states"], D=args["D"])
    assert len(calls) == 2 * per_scan and y_grad.requires_grad  # the op, recorded by autograd
    np.testing.assert_array_equal(y_grad.detach().numpy(), y.numpy())
    (grad,) = torch.autograd.grad(y_grad.sum(), args["x"])
    assert torch.isfinite(grad).all()
    with torch.no_grad():  # grad mode off: the native scan again, though x requires grad
        native(*(args[k] for k in order), Q, args["initial_states"], D=args["D"])
    assert len(calls) == 3 * per_scan
