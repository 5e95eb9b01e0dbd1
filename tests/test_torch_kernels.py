"""The torch backend's CPU row kernel (backends/torch_kernels.py): one decode row times a float32,
int8 or bfloat16 weight equals the reference product, eager and compiled decode call it (compiled
graphs without a break), autograd and other shapes keep torch's kernels, and a failed build or
``PORTABLE_SSM_CPU_KERNELS=0`` leaves everything on torch's kernels with one warning."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import rel_err

import portable_ssm as ps

torch = pytest.importorskip("torch")
from portable_ssm.backends import torch as backend  # noqa: E402
from portable_ssm.backends import torch_kernels  # noqa: E402

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
def test_row_kernel_equals_the_reference_product_for_every_weight_kind_and_width(kernel, kind, cols):
    w, row = _matrix(300, cols, seed=1), _matrix(1, cols, seed=2)
    if kind == "float32":
        got, want = kernel.row_product(row, w), row @ w.T
    else:
        q = ps.quantize({"lm_head.weight": w}, kind)["lm_head.weight"]
        got = kernel.row_product(row, q.data, q.scale)
        want = quantized_matmul_ref(row, q, xp=backend.xp)  # the weight dequantized, a float32 matmul
    assert got.dtype == torch.float32 and tuple(got.shape) == (1, 300)
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


def test_failed_build_warns_once_and_leaves_torchs_kernels(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch_kernels, "enabled", lambda: True)
    monkeypatch.setattr(torch_kernels, "_BUILT", [])
    monkeypatch.setattr(torch_kernels, "_ACTIVE", [False])

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    with pytest.warns(RuntimeWarning, match="could not be built \\(Ninja is required to load C\\+\\+ extensions\\)"):
        assert torch_kernels.ensure() is False
    assert torch_kernels.ensure() is False and not torch_kernels.ready()  # tried once: no second warning
    w, row = _matrix(30, 16, seed=0), _matrix(1, 16, seed=1)
    torch.testing.assert_close(backend.decode_linear(row, w), row @ w.T)


def test_kernels_off_by_environment_variable_never_build(monkeypatch):
    monkeypatch.setenv(torch_kernels.ENV, "0")
    monkeypatch.setattr(torch_kernels, "_BUILT", [])
    monkeypatch.setattr(torch_kernels, "_ACTIVE", [True])
    monkeypatch.setattr(torch_kernels, "_build", lambda: pytest.fail("built although turned off"))
    assert not torch_kernels.enabled() and torch_kernels.ensure() is False and not torch_kernels.ready()
    q = ps.quantize({"lm_head.weight": _matrix(30, 16, seed=0)}, "int8")["lm_head.weight"]
    q = dataclasses.replace(q, packed=None)
    row = _matrix(1, 16, seed=1)
    out = backend.quantized_matmul(row, q)  # torch's weight-only int8 kernel
    assert rel_err(out.numpy(), quantized_matmul_ref(row, q, xp=backend.xp).numpy()) < 2e-5
