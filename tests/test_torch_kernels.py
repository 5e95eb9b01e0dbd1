"""The torch backend's CPU kernels (backends/torch_kernels.py): one decode row times a float32,
int8 or bfloat16 weight equals the reference product, the fused decode step equals
``decode_step_ref``, the whole-model batch-1 step equals the array-API stack, the training conv
equals autograd of the array-API conv, the norm autograd of the float64 reference, the conv and
norm ops differentiated twice give torch's second derivatives, the chunked scan's kernel the float64
reference (a non-finite input kept from the steps before it, bit for bit) and its backward kernel the
torch ops' backward in float64, eager and compiled decode call them (compiled graphs without a
break), autograd and other shapes and dtypes keep torch's kernels and the array-API step, and a
failed build or ``PORTABLE_SSM_CPU_KERNELS=0`` leaves everything on them with one warning."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import rel_err

import portable_ssm as ps

torch = pytest.importorskip("torch")
from portable_ssm.backends import torch as backend  # noqa: E402
from portable_ssm.backends import torch_kernels  # noqa: E402

from portable_ssm.mixer import decode_step_ref  # noqa: E402
from portable_ssm.quantized import quantized_matmul_ref  # noqa: E402

requires_kernel = pytest.mark.skipif(not torch_kernels.enabled(), reason="not an x86-64 CPU with AVX2")


@pytest.fixture
def kernel():
    """The built kernel (the first test to ask builds it, about a minute, once per machine)."""
    import shutil

    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available() or shutil.which("c++") is None:
        pytest.skip("no ninja or C++ compiler here: the kernel cannot be built (torch's kernels run)")
    if not torch_kernels.ensure():
        pytest.fail("the CPU row kernel did not build on an AVX2 machine (see the warning)")
    return torch_kernels


def _matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32))


@requires_kernel
@pytest.mark.parametrize("cols", [8, 13, 64, 77, 768])  # the 32-wide loop, the 8-wide one, the scalar tail
@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("rows", [3, 13, 300])  # float32: fewer than a pass of four rows; eight, four and a rest
def test_row_kernel_equals_the_reference_product_for_every_weight_kind_and_width(kernel, kind, cols, rows):
    w, row = _matrix(rows, cols, seed=1), _matrix(1, cols, seed=2)
    if kind == "float32":
        got, want = kernel.row_product(row, w), row @ w.T
    else:
        q = ps.quantize({"lm_head.weight": w}, kind)["lm_head.weight"]
        got = kernel.row_product(row, q.data, q.scale)
        want = quantized_matmul_ref(row, q, xp=backend.xp)  # the weight dequantized, a float32 matmul
    assert got.dtype == torch.float32 and tuple(got.shape) == (1, rows)
    assert rel_err(got.numpy(), want.numpy()) < 2e-6  # the same products, summed in another order


@requires_kernel
def test_row_kernel_refuses_shapes_and_dtypes_it_does_not_multiply(kernel):
    w = _matrix(10, 16, seed=0)
    for row, weight, scale, message in [(_matrix(2, 16, 1), w, None, "row must be"),
                                        (_matrix(1, 8, 1), w, None, "weight must be a contiguous"),
                                        (_matrix(1, 16, 1), w.T.contiguous().T, None, "weight must be a contiguous"),
                                        (_matrix(1, 16, 1), w.double(), None, "float32, int8 or bfloat16"),
                                        (_matrix(1, 16, 1), w.to(torch.int8), torch.ones(3), "scale must be")]:
        with pytest.raises(RuntimeError, match=message):
            kernel.row_product(row, weight, scale)


def _calls(monkeypatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = torch_kernels.row_product
    monkeypatch.setattr(torch_kernels, "row_product",
                        lambda row, w, s=None: calls.append(tuple(w.shape)) or real(row, w, s))
    return calls


@requires_kernel
@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
def test_eager_one_row_decode_runs_the_row_kernel_for_every_projection_and_the_head(kernel, monkeypatch, kind):
    config = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16, vocab_size=50, pad_vocab_size_multiple=1)
    params = ps.quantize(ps.init_params(config, seed=0, backend="torch"), kind)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 50, (1, 9)))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    monkeypatch.delitem(backend.FAST_OPS, "decode_model")  # the per-layer step, for the variants it declines
    calls = _calls(monkeypatch)
    with torch.inference_mode():
        got, _ = ps.lm.logits_step(ids[:, -1], state, params, config=config)
    leaves = ("in_proj.weight", "out_proj.weight", "embedding.weight")
    weights = {tuple(v.shape) for k, v in params.items() if k.endswith(leaves)}
    assert set(calls) == weights and len(calls) == 2 * config.n_layer + 1  # the head is the tied embedding
    monkeypatch.delitem(backend.FAST_OPS, "quantized_matmul")
    monkeypatch.delitem(backend.FAST_OPS, "decode_linear")
    want, _ = ps.lm.logits_step(ids[:, -1], state, params, config=config)  # the core's reference products
    assert rel_err(got.numpy(), want.numpy()) < 1e-5


@requires_kernel
def test_row_kernel_leaves_autograd_batches_and_float64_to_torch(kernel, monkeypatch):
    calls = _calls(monkeypatch)
    w = _matrix(40, 24, seed=3).requires_grad_()
    row = _matrix(1, 24, seed=4)
    out = backend.decode_linear(row, w)
    out.sum().backward()  # autograd records it: torch's matmul, with its gradient
    torch.testing.assert_close(w.grad, row.expand(40, 24))
    with torch.no_grad():
        backend.decode_linear(_matrix(2, 24, seed=5), w)  # two rows
        backend.decode_linear(row.double(), w.double())  # float64
        assert calls == []
        backend.decode_linear(row, w)
    assert calls == [(40, 24)]


@requires_kernel
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_one_row_decode_calls_the_row_kernel_in_one_graph(kernel):
    """The traced step holds the kernel's op (dynamo's graph, before inductor lowers it) and no break."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    w, row = _matrix(300, 64, seed=1), _matrix(1, 64, seed=2)
    torch._dynamo.reset()
    step = torch.compile(lambda x, w: backend.decode_linear(torch.tanh(x), w) * 2, backend=capture, dynamic=False)
    with torch.inference_mode():
        got = step(row, w)
    assert len(graphs) == 1
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert "portable_ssm_cpu.row_gemv" in targets, targets
    assert rel_err(got.numpy(), (2 * torch.tanh(row) @ w.T).numpy()) < 2e-6
    torch._dynamo.reset()
    with torch.inference_mode():  # and through inductor's own code generation
        compiled = torch.compile(lambda x, w: backend.decode_linear(torch.tanh(x), w) * 2, dynamic=False)(row, w)
    assert rel_err(compiled.numpy(), got.numpy()) < 1e-6


def _decode_args(seed: int, *, b: int, h: int, g: int, p: int, n: int, k: int = 4, bias: bool,
                 per_channel_D: bool, dt_limit: tuple[float, float]) -> dict:
    """Random decode-step inputs, float32 CPU tensors (A < 0; Δ's raw dt around zero)."""
    rng = np.random.default_rng(seed)
    conv_dim = h * p + 2 * g * n

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.from_numpy((scale * rng.standard_normal(shape)).astype(np.float32))

    return dict(xBC=t(b, conv_dim), dt=t(b, h), z=t(b, h * p), conv_state=t(b, conv_dim, k),
                ssm_state=t(b, h, p, n), conv_weight=t(conv_dim, k, scale=0.5), conv_bias=t(conv_dim) if bias else None,
                dt_bias=t(h, scale=0.5), A=-torch.exp(t(h)), D=t(h, p) if per_channel_D else t(h), dt_limit=dt_limit,
                ngroups=g, headdim=p)


@requires_kernel
@pytest.mark.parametrize(("b", "h", "g", "p", "n", "bias", "per_channel_D", "dt_limit"), [
    (1, 24, 1, 64, 128, True, False, (0.0, float("inf"))),  # mamba2-130m's layer
    (3, 6, 3, 5, 13, False, True, (0.01, 0.5)),  # groups, the 8-wide loop and its tail, a clamped Δ
    (2, 4, 2, 3, 5, True, False, (0.0, float("inf"))),  # n below one vector: the scalar loop only
])
def test_fused_decode_step_equals_the_array_api_step(kernel, b, h, g, p, n, bias, per_channel_D, dt_limit):
    args = _decode_args(7, b=b, h=h, g=g, p=p, n=n, bias=bias, per_channel_D=per_channel_D, dt_limit=dt_limit)
    before = {name: v.clone() for name, v in args.items() if isinstance(v, torch.Tensor)}
    got = kernel.decode_step(**args)
    want = decode_step_ref(**args)
    for name, g_, w in zip(("y", "conv_state", "ssm_state"), got, want):
        assert g_.dtype == torch.float32 and g_.shape == w.shape, name
        assert rel_err(g_.numpy(), w.numpy()) < 2e-6, name
    assert torch.equal(got[1], want[1])  # the conv window is moved, not computed
    assert all(torch.equal(args[name], v) for name, v in before.items())  # the inputs are left untouched


@requires_kernel
def test_fused_decode_step_refuses_inconsistent_shapes(kernel):
    args = _decode_args(0, b=1, h=4, g=2, p=3, n=5, bias=False, per_channel_D=False, dt_limit=(0.0, 1.0))
    with pytest.raises(RuntimeError, match="decode_step: shapes do not match"):
        kernel.decode_step(**{**args, "z": args["z"][:, 1:]})
    with pytest.raises(RuntimeError, match="decode_step: inconsistent sizes"):
        kernel.decode_step(**{**args, "ngroups": 3})
    with pytest.raises(RuntimeError, match="ssm_state must be a contiguous float32"):
        kernel.decode_step(**{**args, "ssm_state": args["ssm_state"][0]})


def _refuse_kernel(monkeypatch, name: str, change: str) -> None:
    """``torch_kernels.<name>`` fails the test if called; ``change`` "kernels off" also turns the
    kernels off through the environment variable."""
    monkeypatch.setattr(torch_kernels, name, lambda *a: pytest.fail(f"the kernel took the call ({name})"))
    if change == "kernels off":
        monkeypatch.setenv(torch_kernels.ENV, "0")


def _scan_args(seed: int, *, b: int, l: int, h: int, p: int, g: int, n: int, D: str, initial: bool,
               sliced: bool = False) -> tuple[torch.Tensor | None, ...]:
    """Float32 scan inputs ``(x, Δ, A, B, C, D, initial_states)`` (Δ positive, A negative); ``sliced``:
    x, B and C are slices of one ``[b, l, h·p + 2·g·n + 3]`` array, as the mixer hands them over."""
    rng = np.random.default_rng(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    if sliced:
        rows = t(b, l, h * p + 2 * g * n + 3)
        x = rows[..., :h * p].view(b, l, h, p)
        B, C = (rows[..., h * p + i * g * n:h * p + (i + 1) * g * n].view(b, l, g, n) for i in (0, 1))
    else:
        x, B, C = t(b, l, h, p), t(b, l, g, n), t(b, l, g, n)
    dt = torch.from_numpy(rng.uniform(0.01, 1.5, (b, l, h)).astype(np.float32))
    A = torch.from_numpy(-np.exp(rng.uniform(-1.0, 1.5, h)).astype(np.float32))
    skip = {"none": None, "per head": t(h), "per channel": t(h, p)}[D]
    return x, dt, A, B, C, skip, t(b, h, p, n) if initial else None


def _reference_scan_float64(x, dt, A, B, C, D, initial, chunk_size):
    return ps.ssd.ssd_chunked_ref(*(v.double() for v in (x, dt, A, B, C)), chunk_size=chunk_size,
                                  initial_states=None if initial is None else initial.double(), xp=backend.xp,
                                  D=None if D is None else D.double())


@requires_kernel
@pytest.mark.parametrize(("b", "l", "h", "p", "g", "n", "Q", "D", "initial", "sliced"), [
    (1, 2048, 24, 64, 1, 128, 64, "per head", False, True),  # a 130m layer at l=2048, x, B, C read in place
    (2, 300, 6, 16, 2, 8, 64, "per channel", True, False),  # batch, groups, a shorter last chunk
    (1, 50, 4, 13, 1, 5, 64, "none", False, True),  # one chunk shorter than Q; p below and past one vector
    (3, 257, 8, 24, 4, 16, 32, "per head", True, True),  # Q=32, 9 chunks, the last of one step
    (1, 1, 2, 8, 1, 4, 64, "per channel", True, False),  # one step
])
def test_scan_kernel_equals_the_float64_reference(kernel, b, l, h, p, g, n, Q, D, initial, sliced):
    args = _scan_args(7, b=b, l=l, h=h, p=p, g=g, n=n, D=D, initial=initial, sliced=sliced)
    y, final = kernel.scan_forward(*args, Q)
    want_y, want_final = _reference_scan_float64(*args, Q)
    assert y.dtype == final.dtype == torch.float32 and y.shape == (b, l, h, p) and final.shape == (b, h, p, n)
    assert rel_err(y.numpy(), want_y.numpy()) < 2e-6 and rel_err(final.numpy(), want_final.numpy()) < 2e-6


@requires_kernel
@pytest.mark.parametrize(("b", "l"), [(0, 10), (2, 0)])
def test_scan_kernel_takes_an_empty_batch_or_sequence(kernel, b, l):
    args = _scan_args(1, b=b, l=l, h=4, p=8, g=2, n=6, D="per head", initial=True)
    y, final = kernel.scan_forward(*args, 64)
    assert y.shape == (b, l, 4, 8) and final.shape == (b, 4, 8, 6)
    assert torch.equal(final, args[6])  # no step: the state as it came in


@requires_kernel
def test_scan_kernel_gives_the_same_scan_for_every_block_of_heads(kernel, monkeypatch):
    """The heads go in blocks (one per work item, the items over the threads): any block size, one
    head up to a whole group, gives the scan (to rounding: the products take other widths)."""
    args = _scan_args(2, b=2, l=200, h=12, p=16, g=2, n=8, D="per head", initial=True)
    want_y, want_final = _reference_scan_float64(*args, 64)
    for block in (1, 2, 5, 6):
        monkeypatch.setattr(torch_kernels, "SCAN_HEAD_BLOCK", block)
        y, final = kernel.scan_forward(*args, 64)
        assert rel_err(y.numpy(), want_y.numpy()) < 2e-6 and rel_err(final.numpy(), want_final.numpy()) < 2e-6


def _count_scan_kernel(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch_kernels.scan_forward

    def counted(*args):
        calls.append(args[0].shape[1])
        return real(*args)

    monkeypatch.setattr(torch_kernels, "scan_forward", counted)
    return calls


@requires_kernel
def test_inference_and_training_scans_run_the_scan_kernel(kernel, monkeypatch):
    """A float32 scan without autograd (a forward, a prompt) and the forward of the training
    scan's op both run the kernel, and give the reference's outputs."""
    calls = _count_scan_kernel(monkeypatch)
    x, dt, A, B, C, D, initial = _scan_args(4, b=2, l=100, h=4, p=8, g=1, n=6, D="per head", initial=True)
    want_y, want_final = _reference_scan_float64(x, dt, A, B, C, D, initial, 64)
    with torch.no_grad():
        y, final = backend.ssd_chunked(x, dt, A, B, C, None, initial, D=D)
    assert calls == [100]
    assert rel_err(y.numpy(), want_y.numpy()) < 2e-6 and rel_err(final.numpy(), want_final.numpy()) < 2e-6
    y, final = backend.ssd_chunked(x.requires_grad_(), dt, A, B, C, None, initial, D=D)
    assert calls == [100, 100] and y.grad_fn is not None
    assert rel_err(y.detach().numpy(), want_y.numpy()) < 2e-6


@requires_kernel
@pytest.mark.parametrize("name", ["x", "dt", "B"])
def test_scan_kernel_keeps_a_non_finite_input_from_the_steps_before_it(kernel, monkeypatch, name):
    """A nan at step t (inside a chunk, so 0·nan above the diagonal would reach the steps before it)
    makes the kernel run again with masked products: the outputs before t equal the clean input's
    bit for bit, the ones from t on are not all finite."""
    calls = _count_scan_kernel(monkeypatch)
    safe: list[bool] = []
    op = torch.ops.portable_ssm_cpu.scan_forward
    monkeypatch.setattr(torch.ops.portable_ssm_cpu, "scan_forward", lambda *a: safe.append(a[-1]) or op(*a),
                        raising=False)
    args = _scan_args(5, b=2, l=150, h=4, p=8, g=2, n=6, D="per channel", initial=True)
    with torch.no_grad():
        clean, clean_final = backend.ssd_chunked(*args[:5], None, args[6], D=args[5])
        bad = [a.clone() if a is not None else None for a in args]
        t = 100
        bad[{"x": 0, "dt": 1, "B": 3}[name]][1, t] = torch.nan
        y, final = backend.ssd_chunked(*bad[:5], None, bad[6], D=bad[5])
    assert len(calls) == 2 and safe == [False, False, True]
    assert torch.equal(y[:, :t], clean[:, :t]) and torch.equal(y[0], clean[0]) and torch.equal(final[0], clean_final[0])
    assert not bool(torch.isfinite(y[1, t]).all())


@requires_kernel
@pytest.mark.parametrize("change", ["float64", "kernels off", "packed rows"])
def test_scan_kernel_leaves_float64_packed_rows_and_a_disabled_build_to_numpy(kernel, monkeypatch, change):
    _refuse_kernel(monkeypatch, "scan_forward", change)
    x, dt, A, B, C, D, initial = _scan_args(6, b=1, l=90, h=4, p=8, g=1, n=6, D="per head", initial=True)
    if change == "float64":
        x, dt, A, B, C, D, initial = (v.double() for v in (x, dt, A, B, C, D, initial))
    seq_idx = torch.zeros(1, 90, dtype=torch.int32) if change == "packed rows" else None
    with torch.no_grad():
        y, final = backend.ssd_chunked(x, dt, A, B, C, None, initial, seq_idx=seq_idx, D=D)
    want_y, want_final = _reference_scan_float64(x, dt, A, B, C, D, initial, 64)
    assert rel_err(y.numpy(), want_y.numpy()) < 2e-6 and rel_err(final.numpy(), want_final.numpy()) < 2e-6


@requires_kernel
def test_scan_kernel_leaves_a_lazily_negated_tensor_to_the_reference(kernel, monkeypatch):
    """A tensor with torch's lazy negative bit holds the negated values in memory: native code reading
    its pointer would see them, so neither the kernel nor NumPy's views take it (``torch_views.plain_cpu``)."""
    _refuse_kernel(monkeypatch, "scan_forward", "")
    x, dt, A, B, C, D, initial = _scan_args(8, b=1, l=40, h=4, p=8, g=1, n=6, D="per head", initial=True)
    negated = torch._neg_view(-x)  # x's values, -x in memory
    assert negated.is_neg() and torch.equal(negated, x)
    with torch.no_grad():
        y, final = backend.ssd_chunked(negated, dt, A, B, C, None, initial, D=D)
    want_y, want_final = _reference_scan_float64(x, dt, A, B, C, D, initial, 64)
    assert rel_err(y.numpy(), want_y.numpy()) < 2e-6 and rel_err(final.numpy(), want_final.numpy()) < 2e-6


@requires_kernel
def test_scan_kernel_refuses_shapes_it_does_not_take(kernel):
    x, dt, A, B, C, D, initial = _scan_args(0, b=1, l=10, h=4, p=8, g=2, n=6, D="per head", initial=True)
    op = torch.ops.portable_ssm_cpu.scan_forward
    with pytest.raises(RuntimeError, match="scan_forward: x must be a float32"):
        op(x.double(), dt, A, B, C, D, initial, 64, -40.0, 2, False)
    with pytest.raises(RuntimeError, match="x must be a float32 .* with contiguous"):
        op(x.transpose(2, 3).contiguous().transpose(2, 3), dt, A, B, C, D, initial, 64, -40.0, 2, False)
    with pytest.raises(RuntimeError, match="B and C must be .b, l, g, n. with g dividing h"):
        op(x, dt, A, B[:, :, :1].expand(1, 10, 3, 6), C, D, initial, 64, -40.0, 2, False)
    with pytest.raises(RuntimeError, match="D must be a contiguous float32 .h. or .h, p."):
        op(x, dt, A, B, C, D[:3], initial, 64, -40.0, 2, False)
    with pytest.raises(RuntimeError, match="initial_states must be a contiguous float32 .b, h, p, n."):
        op(x, dt, A, B, C, D, initial[..., :5], 64, -40.0, 2, False)
    with pytest.raises(RuntimeError, match="chunk and block must be positive"):
        op(x, dt, A, B, C, D, initial, 0, -40.0, 2, False)


def _scan_backward_args(seed: int, **shape) -> tuple[tuple[torch.Tensor | None, ...], torch.Tensor, torch.Tensor]:
    """:func:`_scan_args`' inputs with the incoming gradients ``dy [b, l, h, p]`` and ``dfinal [b, h, p, n]``."""
    args = _scan_args(seed, **shape)
    rng = np.random.default_rng(seed + 100)
    b, l, h, p = args[0].shape
    dy = torch.from_numpy(rng.standard_normal((b, l, h, p)).astype(np.float32))
    dfinal = torch.from_numpy(rng.standard_normal((b, h, p, args[3].shape[-1])).astype(np.float32))
    return args, dy, dfinal


def _torch_ops_scan_grads(monkeypatch, args, dy, dfinal, chunk_size):
    """``torch_scan.ssd_chunked_grad`` in torch ops (the kernel refused) in the inputs' dtype."""
    from portable_ssm.backends import torch_scan

    x, dt, A, B, C, D, initial = args
    with monkeypatch.context() as patch:
        patch.setattr(torch_scan, "_kernel_takes", lambda x: False)
        return torch_scan.ssd_chunked_grad(x, dt, A, B, C, chunk_size, initial, D, dy, dfinal)


@contextlib.contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_GRAD_NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "d_initial")


def _assert_scan_grads_close(got, monkeypatch, args, dy, dfinal, chunk_size):
    """``got`` (the kernel's gradients) within float32 rounding of the torch ops' in float64: dA, a
    sum over every step, to 2e-5, the others to 2e-6 (the torch ops in float32 come as close)."""
    exact = _torch_ops_scan_grads(monkeypatch, tuple(None if a is None else a.double() for a in args), dy.double(),
                                  dfinal.double(), chunk_size)
    for name, g, e in zip(_GRAD_NAMES, got, exact):
        assert (g is None) == (e is None), name
        if g is not None:
            assert g.dtype == torch.float32 and g.shape == e.shape, name
            assert rel_err(g.numpy(), e.numpy()) < (2e-5 if name == "dA" else 2e-6), name


@requires_kernel
@pytest.mark.parametrize(("b", "l", "h", "p", "g", "n", "Q", "D", "initial", "sliced"), [
    (1, 2048, 24, 64, 1, 128, 64, "per head", False, True),  # a 130m layer at l=2048, x, B, C read in place
    (2, 300, 6, 16, 2, 8, 64, "per channel", True, False),  # batch (its rows at once), groups, a short last chunk
    (1, 50, 4, 13, 1, 5, 64, "none", False, True),  # one chunk shorter than Q; p below and past one vector
    (3, 257, 8, 24, 4, 16, 32, "per head", True, True),  # Q=32, 9 chunks, the last of one step
    (1, 1, 2, 8, 1, 4, 64, "per channel", True, False),  # one step
])
def test_scan_backward_kernel_gives_the_float64_gradients(kernel, monkeypatch, b, l, h, p, g, n, Q, D, initial,
                                                           sliced):
    args, dy, dfinal = _scan_backward_args(7, b=b, l=l, h=h, p=p, g=g, n=n, D=D, initial=initial, sliced=sliced)
    with _threads(2):  # items of one head block on two threads at once
        got = kernel.scan_backward(*args, dy, dfinal, Q)
    _assert_scan_grads_close(got, monkeypatch, args, dy, dfinal, Q)


@requires_kernel
def test_scan_backward_kernel_gives_the_gradients_for_every_block_of_heads(kernel, monkeypatch):
    args, dy, dfinal = _scan_backward_args(2, b=2, l=200, h=12, p=16, g=2, n=8, D="per head", initial=True)
    for block in (1, 2, 5, 6):  # several blocks a group: their dB and dC summed
        monkeypatch.setattr(torch_kernels, "SCAN_HEAD_BLOCK", block)
        with _threads(3):
            got = kernel.scan_backward(*args, dy, dfinal, 64)
        _assert_scan_grads_close(got, monkeypatch, args, dy, dfinal, 64)


@requires_kernel
@pytest.mark.parametrize(("b", "l"), [(0, 10), (2, 0)])
def test_scan_backward_kernel_takes_an_empty_batch_or_sequence(kernel, b, l):
    args, dy, dfinal = _scan_backward_args(1, b=b, l=l, h=4, p=8, g=2, n=6, D="per head", initial=True)
    dx, ddt, dA, dB, dC, dD, d_initial = kernel.scan_backward(*args, dy, dfinal, 64)
    assert dx.shape == (b, l, 4, 8) and ddt.shape == (b, l, 4) and dB.shape == dC.shape == (b, l, 2, 6)
    assert torch.equal(d_initial, dfinal)  # no step: the leaving state is the initial one
    assert not bool(dA.any()) and not bool(dD.any())


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_scan_backward_runs_the_kernel_in_float32_and_the_torch_ops_in_float64(kernel, monkeypatch,
                                                                                        dtype):
    """The scan op's backward takes the kernel for float32 tensors, the torch ops for float64 (the
    gradients of both against autograd of the reference: tests/test_gradients.py)."""
    calls = []
    real = torch_kernels.scan_backward
    monkeypatch.setattr(torch_kernels, "scan_backward", lambda *a: calls.append(1) or real(*a))
    x, dt, A, B, C, D, initial = (None if a is None else a.to(dtype).requires_grad_()
                                  for a in _scan_args(3, b=1, l=70, h=4, p=8, g=1, n=6, D="per head", initial=True))
    y, final = backend.ssd_chunked(x, dt, A, B, C, None, initial, D=D)
    (y.square().sum() + final.sum()).backward()
    assert calls == ([1] if dtype == torch.float32 else [])
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (x, dt, A, B, C, D, initial))


@requires_kernel
def test_scan_backward_kernel_refuses_shapes_it_does_not_take(kernel):
    args, dy, dfinal = _scan_backward_args(0, b=1, l=10, h=4, p=8, g=2, n=6, D="per head", initial=True)
    op = torch.ops.portable_ssm_cpu.scan_backward
    with pytest.raises(RuntimeError, match="scan_backward: x must be a float32"):
        op(args[0].double(), *args[1:], dy, dfinal, 64, -40.0, 2)
    with pytest.raises(RuntimeError, match="scan_backward: dy must be a contiguous float32"):
        op(*args, dy[:, :5], dfinal, 64, -40.0, 2)
    with pytest.raises(RuntimeError, match="scan_backward: dfinal must be a contiguous float32 .b, h, p, n."):
        op(*args, dy, dfinal[..., :5], 64, -40.0, 2)
    with pytest.raises(RuntimeError, match="scan_backward: chunk and block must be positive"):
        op(*args, dy, dfinal, 64, -40.0, 0)


def _conv_leaves(seed: int, *, b: int, l: int, d: int, k: int, bias: bool, state: bool,
                 dtype: torch.dtype = torch.float32, sliced: bool = False) -> list[torch.Tensor | None]:
    """x [b, l, d], weight [d, k], bias [d] or None, state [b, d, k] or None, requiring grad; with
    ``sliced`` x is channels 3 to 3+d of a leaf with d+7 (a view, as xBC is of in_proj's output)."""
    rng = np.random.default_rng(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()

    x = t(b, l, d + 7)[..., 3:3 + d] if sliced else t(b, l, d)
    return [x, t(d, k), t(d) if bias else None, t(b, d, k) if state else None]


def _conv_and_grads(conv, leaves: list[torch.Tensor | None], seed: int = 9) -> list[torch.Tensor]:
    """``(y, new_state)`` of ``conv(*leaves)`` and the gradients of a random probe of both."""
    y, new_state = conv(*leaves)
    rng = np.random.default_rng(seed)
    probes = [torch.from_numpy(rng.standard_normal(tuple(v.shape))).to(v.dtype) for v in (y, new_state)]
    present = [v for v in leaves if v is not None]
    return [y.detach(), new_state.detach(), *torch.autograd.grad((y, new_state), present, probes)]


def _reference_conv_silu(x, weight, bias, state):
    from portable_ssm.conv import causal_conv1d_ref

    y, new_state = causal_conv1d_ref(x, weight, bias, state, xp=backend.xp)
    return torch.nn.functional.silu(y), new_state


@requires_kernel
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous x", "x a slice of wider rows"])
@pytest.mark.parametrize(("b", "l", "d", "k", "bias", "state"), [
    (1, 300, 1792, 4, True, False),  # a 130m layer's conv: vectors only
    (2, 37, 21, 4, True, True),  # vectors and single channels, a state to continue
    (3, 2, 13, 4, False, True),  # fewer steps than the window: the new state takes part of the old
    (1, 5, 8, 1, True, False),  # a one-tap conv
    (2, 9, 70, 3, False, False),  # a block of 64 channels and a rest, an odd window
])
def test_training_conv_kernel_gives_the_references_output_state_and_gradients(kernel, monkeypatch, b, l, d, k, bias,
                                                                              state, sliced):
    calls = []
    real = torch_kernels.conv_silu
    monkeypatch.setattr(torch_kernels, "conv_silu", lambda *a: calls.append(1) or real(*a))
    leaves = _conv_leaves(4, b=b, l=l, d=d, k=k, bias=bias, state=state, sliced=sliced)
    got = _conv_and_grads(backend.causal_conv1d_silu, leaves)
    assert calls == [1], "the training conv did not run the kernel"
    want = _conv_and_grads(_reference_conv_silu, leaves)
    names = ["y", "new_state", *(n for n, v in zip(("dx", "dweight", "dbias", "dstate"), leaves) if v is not None)]
    for name, g_, w in zip(names, got, want, strict=True):
        assert g_.dtype == torch.float32 and g_.shape == w.shape, name
        assert rel_err(g_.numpy(), w.numpy()) < 5e-6, name


@requires_kernel
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous x", "x a slice of wider rows"])
def test_conv_kernel_runs_inference_too_with_the_references_output_and_state(kernel, monkeypatch, sliced):
    calls = []
    real = torch_kernels.conv_silu
    monkeypatch.setattr(torch_kernels, "conv_silu", lambda *a: calls.append(1) or real(*a))
    leaves = _conv_leaves(5, b=2, l=40, d=21, k=4, bias=True, state=True, sliced=sliced)
    with torch.inference_mode():
        y, new_state = backend.causal_conv1d_silu(*leaves)
    assert calls == [1], "the inference conv did not run the kernel"
    want_y, want_state = _reference_conv_silu(*leaves)
    assert rel_err(y.numpy(), want_y.detach().numpy()) < 5e-6 and torch.equal(new_state, want_state.detach())


@requires_kernel
def test_conv_kernel_reads_a_slice_of_wider_rows_in_place_and_copies_overlapping_steps(kernel):
    wide = torch.randn(2, 9, 30)
    x = wide[..., 4:25]  # channels contiguous, steps 30 floats apart
    assert torch_kernels._steps_apart(x) is x
    repeated = torch.randn(2, 1, 21).expand(2, 9, 21)  # every step the same memory: read from a copy
    assert torch_kernels._steps_apart(repeated).is_contiguous()
    weight, bias, history = torch.randn(21, 4), torch.randn(21), torch.randn(2, 3, 21)
    for v in (x, repeated):
        assert torch.equal(kernel.conv_silu(v, weight, bias, history), kernel.conv_silu(v.contiguous(), weight, bias,
                                                                                         history))


@requires_kernel
@pytest.mark.parametrize("change", ["float64", "kernels off"])
def test_training_conv_kernel_leaves_float64_and_a_disabled_build_to_the_other_paths(kernel, monkeypatch, change):
    _refuse_kernel(monkeypatch, "conv_silu", change)
    leaves = _conv_leaves(5, b=1, l=12, d=10, k=4, bias=True, state=True,
                          dtype=torch.float64 if change == "float64" else torch.float32)
    with torch.no_grad():
        y, new_state = backend.causal_conv1d_silu(*leaves)
    want_y, want_state = _reference_conv_silu(*leaves)
    assert rel_err(y.numpy(), want_y.detach().numpy()) < 1e-6 and torch.equal(new_state, want_state.detach())
    got = _conv_and_grads(backend.causal_conv1d_silu, leaves)
    want = _conv_and_grads(_reference_conv_silu, leaves)
    for g_, w in zip(got, want, strict=True):
        assert rel_err(g_.numpy(), w.numpy()) < 1e-12


@requires_kernel
def test_training_conv_kernel_refuses_shapes_it_does_not_take(kernel):
    x, weight, bias = torch.zeros(1, 6, 10), torch.zeros(10, 4), torch.zeros(10)
    with pytest.raises(RuntimeError, match="conv_silu: shapes do not match"):
        kernel.conv_silu(x, weight, bias, torch.zeros(1, 2, 10))
    with pytest.raises(RuntimeError, match="conv_silu: bias must be"):
        kernel.conv_silu(x, weight, torch.zeros(9), torch.zeros(1, 3, 10))
    with pytest.raises(RuntimeError, match="x must be a float32 tensor of rank 3"):
        kernel.conv_silu(x.double(), weight, bias, torch.zeros(1, 3, 10))
    with pytest.raises(RuntimeError, match="x must be a float32 tensor of rank 3 with contiguous channels"):
        torch.ops.portable_ssm_cpu.conv_silu(x.expand(2, 6, 10), weight.t().contiguous(), bias,
                                             torch.zeros(2, 3, 10))  # rows overlapping: the op itself refuses
    with pytest.raises(RuntimeError, match="conv_silu_backward: dy must be shaped as x"):
        kernel.conv_silu_backward(torch.zeros(1, 5, 10), x, weight, bias, torch.zeros(1, 3, 10))


def _norm_leaves(seed: int, *, lead: tuple[int, ...], d: int, gate: bool, sliced: bool,
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor | None]:
    """y [*lead, d], z [*lead, d] or None, weight [d], requiring grad; with ``sliced`` z is channels
    4 to 4+d of a leaf with d+9 (a view, as z is of in_proj's output)."""
    rng = np.random.default_rng(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype).requires_grad_()

    y = t(*lead, d)
    z = (t(*lead, d + 9)[..., 4:4 + d] if sliced else t(*lead, d)) if gate else None
    return [y, z, t(d)]


def _norm_and_grads(norm, leaves: list[torch.Tensor | None], groups: int) -> list[torch.Tensor]:
    """The output of ``norm(y, z, weight, groups, 1e-5)`` and the gradients of a random probe of it."""
    out = norm(*leaves, groups, 1e-5)
    probe = torch.from_numpy(np.random.default_rng(8).standard_normal(tuple(out.shape))).to(out.dtype)
    present = [v for v in leaves if v is not None]
    return [out.detach(), *torch.autograd.grad(out, present, probe)]


def _reference_norm_float64(y, z, weight, groups, eps):
    from portable_ssm.norm import gated_rms_norm_ref

    wide = [None if v is None else v.double() for v in (y, z, weight)]
    return gated_rms_norm_ref(*wide, groups, eps, xp=backend.xp)


@requires_kernel
@pytest.mark.parametrize(("lead", "d", "groups", "gate", "sliced"), [
    ((1, 300), 1536, 1, True, True),  # a 130m layer's gated norm: z read in place from in_proj's output
    ((2, 7), 768, 1, False, False),  # the block's norm: no gate
    ((3,), 21, 3, True, False),  # three groups of seven channels: single lanes only
    ((2, 3, 2), 40, 2, True, True),  # two leading axes merge into the rows; groups of 20: vectors and a rest
    ((1, 1), 13, 1, True, True),  # one row
])
def test_norm_kernel_gives_the_float64_references_output_and_gradients(kernel, monkeypatch, lead, d, groups, gate,
                                                                        sliced):
    calls = []
    real = torch_kernels.gated_rms_norm
    monkeypatch.setattr(torch_kernels, "gated_rms_norm", lambda *a: calls.append(1) or real(*a))
    leaves = _norm_leaves(3, lead=lead, d=d, gate=gate, sliced=sliced)
    got = _norm_and_grads(backend.gated_rms_norm, leaves, groups)
    assert calls == [1], "the norm did not run the kernel"
    want = _norm_and_grads(_reference_norm_float64, leaves, groups)
    names = ["out", *(n for n, v in zip(("dy", "dz", "dweight"), leaves) if v is not None)]
    for name, g_, w in zip(names, got, want, strict=True):
        assert g_.dtype == torch.float32 and g_.shape == w.shape, name
        assert rel_err(g_.numpy(), w.numpy()) < 2e-6, name
    with torch.inference_mode():
        inferred = backend.gated_rms_norm(*leaves, groups, 1e-5)
    assert calls == [1, 1] and torch.equal(inferred, got[0]), "inference did not run the same kernel"


@requires_kernel
def test_norm_kernel_reads_a_slice_of_wider_rows_in_place_and_copies_overlapping_rows(kernel):
    wide = torch.randn(2, 9, 30)
    z = wide[..., 4:25]  # channels contiguous, rows 30 floats apart: merges into [18, 21] in place
    assert torch_kernels._rows_apart(z).data_ptr() == z.data_ptr() and torch_kernels._rows_apart(z).stride(0) == 30
    repeated = torch.randn(2, 1, 21).expand(2, 9, 21)  # every row the same memory: read from a copy
    assert torch_kernels._rows_apart(repeated).is_contiguous()
    y, weight = torch.randn(2, 9, 21), torch.randn(21)
    for v in (z, repeated):
        assert torch.equal(kernel.gated_rms_norm(y, v, weight, 3, 1e-5),
                           kernel.gated_rms_norm(y, v.contiguous(), weight, 3, 1e-5))


@requires_kernel
@pytest.mark.parametrize("change", ["float64", "kernels off"])
def test_norm_kernel_leaves_float64_and_a_disabled_build_to_torchs_ops(kernel, monkeypatch, change):
    _refuse_kernel(monkeypatch, "gated_rms_norm", change)
    leaves = _norm_leaves(5, lead=(2, 6), d=16, gate=True, sliced=True,
                          dtype=torch.float64 if change == "float64" else torch.float32)
    got = _norm_and_grads(backend.gated_rms_norm, leaves, 2)
    want = _norm_and_grads(_reference_norm_float64, leaves, 2)
    for g_, w in zip(got, want, strict=True):
        assert rel_err(g_.numpy(), w.numpy()) < (1e-12 if change == "float64" else 2e-6)


@requires_kernel
def test_norm_kernel_refuses_shapes_it_does_not_take(kernel):
    y, z, weight = torch.zeros(6, 10), torch.zeros(6, 10), torch.zeros(10)
    with pytest.raises(RuntimeError, match="gated_rms_norm: weight must be \\[10\\] and groups \\(3\\) must divide"):
        kernel.gated_rms_norm(y, z, weight, 3, 1e-5)
    with pytest.raises(RuntimeError, match="gated_rms_norm: weight must be"):
        kernel.gated_rms_norm(y, z, torch.zeros(9), 1, 1e-5)
    with pytest.raises(RuntimeError, match="gated_rms_norm: z must be a float32 \\[6, 10\\]"):
        kernel.gated_rms_norm(y, torch.zeros(5, 10), weight, 1, 1e-5)
    with pytest.raises(RuntimeError, match="gated_rms_norm: y must be a float32"):
        kernel.gated_rms_norm(y.double(), None, weight, 1, 1e-5)
    with pytest.raises(RuntimeError, match="gated_rms_norm: z must be a float32 .* contiguous channels and rows apart"):
        torch.ops.portable_ssm_cpu.gated_rms_norm(y, torch.zeros(1, 10).expand(6, 10), weight, 1,
                                                  1e-5)  # rows overlapping: the op itself refuses
    with pytest.raises(RuntimeError, match="gated_rms_norm: dout must be a float32 \\[6, 10\\]"):
        kernel.gated_rms_norm_backward(torch.zeros(6, 9), y, z, weight, 1, 1e-5)


def _second_derivatives(fn, leaves: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients of a penalty on the first gradients of a probe of ``fn(*leaves)`` (create_graph)."""
    out = fn(*leaves)
    probe = torch.from_numpy(np.random.default_rng(6).standard_normal(tuple(out.shape))).to(out.dtype)
    present = [v for v in leaves if v is not None]
    firsts = torch.autograd.grad(out, present, probe, create_graph=True)
    return list(torch.autograd.grad(sum((g * g).sum() for g in firsts), present))


@requires_kernel
@pytest.mark.parametrize("op", ["conv", "norm"])
def test_kernel_ops_backward_is_differentiable_with_torchs_second_derivatives(kernel, monkeypatch, op):
    """A backward differentiated in turn (create_graph) runs torch's ops inside the op's backward:
    the kernels' gradients would be constants to autograd, and the second derivatives silently wrong."""
    if op == "conv":
        leaves = _conv_leaves(2, b=2, l=9, d=12, k=4, bias=True, state=True, sliced=True)

        def fn(*v):
            return backend.causal_conv1d_silu(*v)[0]
    else:
        leaves = _norm_leaves(2, lead=(2, 5), d=16, gate=True, sliced=True)

        def fn(*v):
            return backend.gated_rms_norm(*v, 2, 1e-5)
    calls = []
    real = getattr(torch_kernels, {"conv": "conv_silu", "norm": "gated_rms_norm"}[op])
    monkeypatch.setattr(torch_kernels, real.__name__, lambda *a: calls.append(1) or real(*a))
    got = _second_derivatives(fn, leaves)
    assert calls == [1], "the forward did not run the kernel"
    monkeypatch.setenv(torch_kernels.ENV, "0")
    want = _second_derivatives(fn, leaves)
    for g_, w in zip(got, want, strict=True):
        assert rel_err(g_.numpy(), w.numpy()) < 1e-6


@requires_kernel
def test_decode_step_hook_declines_autograd_float64_and_leaves_them_to_the_core(kernel):
    args = _decode_args(1, b=1, h=4, g=1, p=3, n=8, bias=True, per_channel_D=False, dt_limit=(0.0, 1.0))
    assert backend.decode_step(**{**args, "z": args["z"].requires_grad_()}) is None  # autograd records it
    assert backend.decode_step(**{k: v.double() if isinstance(v, torch.Tensor) else v for k, v in args.items()}) is None
    with torch.no_grad():
        assert backend.decode_step(**args) is not None


def _count_fused_steps(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch_kernels.decode_step
    monkeypatch.setattr(torch_kernels, "decode_step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


_SMALL_LM = dict(d_model=32, n_layer=2, d_state=16, headdim=16, ngroups=2, vocab_size=50, pad_vocab_size_multiple=1)


@requires_kernel
def test_eager_lm_step_runs_the_fused_step_in_every_layer_and_equals_the_array_api_step(kernel, monkeypatch):
    config = ps.Mamba2Config(**_SMALL_LM)
    params = ps.init_params(config, seed=0, backend="torch")
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 50, (2, 9)))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    calls = _count_fused_steps(monkeypatch)
    with torch.inference_mode():
        got, got_state = ps.lm.logits_step(ids[:, -1], state, params, config=config)
    assert len(calls) == config.n_layer
    monkeypatch.delitem(backend.FAST_OPS, "decode_step")
    want, want_state = ps.lm.logits_step(ids[:, -1], state, params, config=config)
    assert rel_err(got.numpy(), want.numpy()) < 1e-5
    for g_, w in zip(got_state.ssm + got_state.conv, want_state.ssm + want_state.conv):
        assert rel_err(g_.numpy(), w.numpy()) < 2e-6


@requires_kernel
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_generation_traces_the_fused_step_and_gives_the_array_api_tokens(kernel, monkeypatch):
    config = ps.Mamba2Config(**_SMALL_LM)
    params = ps.init_params(config, seed=0, backend="torch")
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 50, (1, 5)))
    monkeypatch.delitem(backend.FAST_OPS, "decode_model")  # the per-layer step, for the variants it declines
    calls = _count_fused_steps(monkeypatch)
    with torch.inference_mode():
        got, got_state = ps.generation.generate(ids, params, config=config, max_new_tokens=6, compile=True,
                                                return_state=True)
    assert len(calls) >= config.n_layer  # traced into the step's graph
    monkeypatch.delitem(backend.FAST_OPS, "decode_step")
    with torch.inference_mode():
        want, want_state = ps.generation.generate(ids, params, config=config, max_new_tokens=6, return_state=True)
    assert torch.equal(got, want)
    for g_, w in zip(got_state.ssm, want_state.ssm):
        assert rel_err(g_.numpy(), w.numpy()) < 1e-5


def test_failed_build_says_what_it_builds_warns_once_and_leaves_torchs_kernels(monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch_kernels, "enabled", lambda: True)
    monkeypatch.setattr(torch_kernels, "_BUILT", [])
    monkeypatch.setattr(torch_kernels, "_ACTIVE", [False])
    monkeypatch.setattr(torch_kernels, "build_folder", lambda name: tmp_path / name)  # nothing built there yet

    def no_compiler(name, sources, **kwargs):
        assert [Path(s).name for s in sources] == ["torch_ops.cpp"] and Path(sources[0]).is_file()
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(RuntimeWarning, match="could not be built \\(Ninja is required to load C\\+\\+ extensions\\)"):
        assert torch_kernels.ensure() is False
    name = "portable_ssm_cpu_" + torch_kernels.source_key(*torch_kernels.CFLAGS)
    assert capsys.readouterr().err == (f"portable_ssm: building torch's CPU kernels (once, about a minute) into "
                                       f"{tmp_path / name}\n")
    assert torch_kernels.ensure() is False and not torch_kernels.ready()  # tried once: no second warning
    w, row = _matrix(30, 16, seed=0), _matrix(1, 16, seed=1)
    torch.testing.assert_close(backend.decode_linear(row, w), row @ w.T)
    args = _decode_args(0, b=1, h=2, g=1, p=3, n=8, bias=False, per_channel_D=False, dt_limit=(0.0, 1.0))
    with torch.no_grad():
        assert backend.decode_step(**args) is None  # the core's array-API step runs


def test_kernels_off_by_environment_variable_never_build(monkeypatch):
    monkeypatch.setenv(torch_kernels.ENV, "0")
    monkeypatch.setattr(torch_kernels, "_BUILT", [])
    monkeypatch.setattr(torch_kernels, "_ACTIVE", [True])
    monkeypatch.setattr(torch_kernels, "_build", lambda: pytest.fail("built although turned off"))
    assert not torch_kernels.enabled() and torch_kernels.ensure() is False and not torch_kernels.ready()
    args = _decode_args(0, b=1, h=2, g=1, p=3, n=8, bias=False, per_channel_D=False, dt_limit=(0.0, 1.0))
    with torch.no_grad():
        assert backend.decode_step(**args) is None
    q = ps.quantize({"lm_head.weight": _matrix(30, 16, seed=0)}, "int8")["lm_head.weight"]
    q = dataclasses.replace(q, packed=None)
    row = _matrix(1, 16, seed=1)
    out = backend.quantized_matmul(row, q)  # torch's weight-only int8 kernel
    assert rel_err(out.numpy(), quantized_matmul_ref(row, q, xp=backend.xp).numpy()) < 2e-5


#: The array-API reference of a decode step: the core with none of the torch backend's decode hooks.
_DECODE_HOOKS = ("decode_model", "decode_step", "decode_linear", "quantized_matmul")


@contextlib.contextmanager
def _without_decode_hooks(monkeypatch):
    with monkeypatch.context() as m:
        for name in _DECODE_HOOKS:
            m.delitem(backend.FAST_OPS, name)
        yield


def _reference_step(monkeypatch, token, state, params, config):
    with _without_decode_hooks(monkeypatch):
        return ps.lm.logits_step(token, state, params, config=config)


def _count_model_steps(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch_kernels.decode_model
    monkeypatch.setattr(torch_kernels, "decode_model", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@requires_kernel
@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("variant", [
    dict(),  # mamba2-130m's layout, small
    dict(ngroups=2, D_has_hdim=True, conv_bias=False, dt_limit=(0.01, 0.3), tie_embeddings=False),
    dict(d_state=13, headdim=5, d_model=20, n_layer=3),  # the 8-wide loops' scalar tails
])
def test_whole_model_step_equals_the_array_api_stack_for_every_weight_kind(kernel, monkeypatch, kind, variant):
    config = ps.Mamba2Config(**{**_SMALL_LM, "ngroups": 1, **variant})
    params = ps.quantize(ps.init_params(config, seed=3, backend="torch"), kind)
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, 50, (1, 11)))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    calls = _count_model_steps(monkeypatch)
    with torch.inference_mode():
        got, got_state = ps.lm.logits_step(ids[:, -1], state, params, config=config)
    assert calls == [1]
    want, want_state = _reference_step(monkeypatch, ids[:, -1], state, params, config)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got.numpy(), want.numpy()) < 2e-6
    for g_, w in zip(got_state.ssm + got_state.conv, want_state.ssm + want_state.conv):
        assert g_.shape == w.shape and rel_err(g_.numpy(), w.numpy()) < 2e-6


@requires_kernel
def test_the_remembered_model_weights_go_with_the_model(kernel, monkeypatch):
    """The step remembers a model's tensors for the next token without holding them: the entry goes
    when one of them is freed, and a new model (or a tensor replaced) is gathered again."""
    import gc

    config = ps.Mamba2Config(**{**_SMALL_LM, "ngroups": 1})
    params = ps.init_params(config, seed=3, backend="torch")
    ids = torch.from_numpy(np.random.default_rng(4).integers(0, 50, (1, 5)))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    gathered: list[int] = []
    real = backend._model_weights
    monkeypatch.setattr(backend, "_model_weights", lambda *a: gathered.append(1) or real(*a))
    with torch.inference_mode():
        first, _ = ps.lm.logits_step(ids[:, -1], state, params, config=config)
        again, _ = ps.lm.logits_step(ids[:, -1], state, params, config=config)
        assert gathered == [1] and len(backend._PREPARED) == 1
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        params = {**params, "norm_f.weight": params["norm_f.weight"].clone()}  # the old tensor freed
        gc.collect()
        assert not backend._PREPARED
        ps.lm.logits_step(ids[:, -1], state, params, config=config)
        assert gathered == [1, 1]


@requires_kernel
@pytest.mark.parametrize("change", ["two rows", "float64", "autograd", "gated MLP", "norm before gate",
                                    "no norm", "projection bias", "strided weight"])
def test_whole_model_hook_declines_what_it_does_not_compute_and_the_core_runs(kernel, monkeypatch, change):
    fields = {"gated MLP": dict(d_ssm=32, expand=4), "norm before gate": dict(norm_before_gate=True),
              "no norm": dict(rmsnorm=False), "projection bias": dict(bias=True)}.get(change, {})
    config = ps.Mamba2Config(**{**_SMALL_LM, **fields})
    params = ps.init_params(config, seed=0, backend="torch", dtype="float64" if change == "float64" else "float32")
    if change == "autograd":
        params = {k: v.requires_grad_() for k, v in params.items()}
    if change == "strided weight":
        w = params["layers.1.mixer.out_proj.weight"]
        params["layers.1.mixer.out_proj.weight"] = w.T.contiguous().T  # equal values, column-major
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, 50, (2 if change == "two rows" else 1, 6)))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    calls = _count_model_steps(monkeypatch)
    got, _ = ps.lm.logits_step(ids[:, -1], state, params, config=config)
    assert calls == []
    want, _ = _reference_step(monkeypatch, ids[:, -1], state, params, config)
    assert rel_err(got.detach().numpy(), want.detach().numpy()) < 1e-5
    if change == "autograd":
        got.sum().backward()  # the core's step, recorded
        assert params["layers.0.mixer.in_proj.weight"].grad is not None


@requires_kernel
def test_whole_model_hook_sees_a_replaced_weight_and_frees_dropped_params(kernel):
    import gc
    import weakref

    config = ps.Mamba2Config(**_SMALL_LM)
    params = ps.init_params(config, seed=0, backend="torch")
    token = torch.tensor([3])
    state = ps.empty_state(config, 1, params["embedding.weight"])
    with torch.inference_mode():
        first, _ = ps.lm.logits_step(token, state, params, config=config)
        scaled = {**params, "norm_f.weight": 2 * params["norm_f.weight"]}  # a new dict, one new tensor
        second, _ = ps.lm.logits_step(token, state, scaled, config=config)
        params["norm_f.weight"] = scaled["norm_f.weight"]  # the same dict, its entry replaced
        third, _ = ps.lm.logits_step(token, state, params, config=config)
    torch.testing.assert_close(second, 2 * first)
    torch.testing.assert_close(third, second)
    probe = weakref.ref(params["layers.0.mixer.in_proj.weight"])
    del params, scaled
    gc.collect()
    assert probe() is None  # the hook's memory of the last params holds no tensor


@requires_kernel
def test_whole_model_kernel_refuses_lists_of_the_wrong_length(kernel):
    config = ps.Mamba2Config(**_SMALL_LM)
    params = ps.init_params(config, seed=0, backend="torch")
    weights = backend._model_weights(params, config)
    state = ps.empty_state(config, 1, params["embedding.weight"])
    x = torch.zeros(1, config.d_model)
    short = weights._replace(gate_norms=weights.gate_norms[:1])
    with pytest.raises(RuntimeError, match="gate_norms must hold one tensor per layer"):
        kernel.decode_model(x, list(state.conv), list(state.ssm), short, 1e-5, (0.0, 1.0), 2, 16)
    with pytest.raises(RuntimeError, match="x must be one row"):
        kernel.decode_model(torch.zeros(2, config.d_model), list(state.conv), list(state.ssm), weights, 1e-5,
                            (0.0, 1.0), 2, 16)


@requires_kernel
def test_whole_model_kernel_names_the_layer_tensor_it_refuses(kernel):
    config = ps.Mamba2Config(**_SMALL_LM)
    weights = backend._model_weights(ps.init_params(config, seed=0, backend="torch"), config)
    state = ps.empty_state(config, 1, weights.norm_f)
    conv, ssm = list(state.conv), list(state.ssm)

    def swap(field: str, i: int, value: torch.Tensor) -> torch_kernels.ModelWeights:
        return weights._replace(**{field: [value if j == i else t for j, t in enumerate(getattr(weights, field))]})

    cases = [
        (swap("in_weights", 1, weights.in_weights[1].double()), conv, ssm, r"in_weights\[1\] must be float32, int8"),
        (swap("in_weights", 1, weights.in_weights[1][:-1].contiguous()), conv, ssm, "layer 1's in_proj gives"),
        (swap("out_weights", 0, weights.out_weights[0][:-1].contiguous()), conv, ssm, "layer 0's out_proj gives"),
        (swap("norms", 0, weights.norms[0].double()), conv, ssm, r"norms\[0\] must be a contiguous float32"),
        (swap("Ds", 1, weights.Ds[1][:-1]), conv, ssm, r"Ds\[1\] must be"),
        (swap("conv_weights", 0, weights.conv_weights[0][:, :, :-1].contiguous()), conv, ssm,
         r"conv_weights\[0\] must be"),
        (weights._replace(head=weights.head[:, :-1].contiguous()), conv, ssm, "head must be a contiguous"),
        (weights, conv, [ssm[0], ssm[1][:, :, :-1].contiguous()], "layer 1's states"),
    ]
    for w, c, h, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernel.decode_model(torch.zeros(1, config.d_model), c, h, w, 1e-5, (0.0, float("inf")), config.ngroups,
                                config.headdim)


@requires_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 5])  # 5: more threads than the 4 heads and the 32 rows' shares of 8
def test_whole_model_step_gives_the_array_api_step_on_any_number_of_threads(kernel, monkeypatch, threads):
    config = ps.Mamba2Config(**_SMALL_LM)
    params = ps.init_params(config, seed=6, backend="torch")
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, 50, (1, 9)))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    before = [t.clone() for t in state.conv + state.ssm]
    calls, saved = _count_model_steps(monkeypatch), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got, got_state = ps.lm.logits_step(ids[:, -1], state, params, config=config)
    finally:
        torch.set_num_threads(saved)
    assert calls == [1]
    want, want_state = _reference_step(monkeypatch, ids[:, -1], state, params, config)
    assert rel_err(got.numpy(), want.numpy()) < 2e-6
    for g_, w in zip(got_state.ssm + got_state.conv, want_state.ssm + want_state.conv):
        assert rel_err(g_.numpy(), w.numpy()) < 2e-6
    assert all(torch.equal(t, b) for t, b in zip(state.conv + state.ssm, before))  # the inputs untouched


@requires_kernel
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_eager_generation_runs_the_whole_model_step_once_a_token_and_both_give_the_array_api_tokens(
        kernel, monkeypatch, compile):
    config = ps.Mamba2Config(**_SMALL_LM)
    params = ps.quantize(ps.init_params(config, seed=0, backend="torch"), "int8")
    # a prompt above CPU_KERNEL_MAX_ROWS: both prefills dequantize (fbgemm would round 8-bit rows)
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 50, (1, backend.CPU_KERNEL_MAX_ROWS + 3)))
    calls = _count_model_steps(monkeypatch)
    if compile:
        torch._dynamo.reset()
    with torch.inference_mode():
        got, got_state = ps.generation.generate(ids, params, config=config, max_new_tokens=6, compile=compile,
                                                return_state=True)
    assert len(calls) == (0 if compile else 6)  # compiled: the per-layer step's graph (inductor's C++
    # wrapper calls no op returning lists), which must give the same tokens
    with _without_decode_hooks(monkeypatch):
        want, want_state = ps.generation.generate(ids, params, config=config, max_new_tokens=6, return_state=True)
    assert torch.equal(got, want)
    for g_, w in zip(got_state.ssm, want_state.ssm):
        assert rel_err(g_.numpy(), w.numpy()) < 1e-5
