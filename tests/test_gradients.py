"""Gradients: float64 gradcheck on the scans and on a small model, equality with transformers'
Mamba2 on the same weights, and gradient flow through a carried state (truncated BPTT)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

torch = pytest.importorskip("torch")

from portable_ssm.backends.torch import Mamba2LMModule, Mamba2Module, detach_state  # noqa: E402

import portable_ssm as ps  # noqa: E402


def _tensor(host, dtype=torch.float64):
    return torch.tensor(host, dtype=dtype, requires_grad=True)


def _probe(y, seed=1):
    """``sum(y * w)`` for fixed random w: a loss that reads every output."""
    w = torch.randn(*y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (y * w.to(y.dtype)).sum()


def _scan_inputs(b, l, h, p, g, n, seed=0):
    rng = np.random.default_rng(seed)
    host = dict(x=rng.standard_normal((b, l, h, p)), dt=rng.standard_normal((b, l, h)),
                A=-np.exp(rng.uniform(-1.0, 1.0, h)), B=rng.standard_normal((b, l, g, n)),
                C=rng.standard_normal((b, l, g, n)), D=rng.standard_normal(h),
                z=rng.standard_normal((b, l, h, p)), dt_bias=rng.standard_normal(h),
                initial_states=rng.standard_normal((b, h, p, n)))
    return {k: _tensor(v) for k, v in host.items()}


@pytest.mark.parametrize("scan", [ps.ssd_scan, ps.selective_scan], ids=["ssd_scan", "selective_scan"])
@pytest.mark.parametrize("l,chunk_size", [(5, 2), (4, None)])
def test_scans_pass_float64_gradcheck_in_every_argument(scan, l, chunk_size):
    args = _scan_inputs(2, l, 2, 2, 1, 3, seed=l)
    names = list(args)

    def run(*values):
        return scan(**dict(zip(names, values)), chunk_size=chunk_size, dt_softplus=True,
                    return_final_states=True)

    assert torch.autograd.gradcheck(run, tuple(args.values()), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("scan_op", [False, True], ids=["reference-scan", "scan-op"])
def test_small_model_passes_float64_gradcheck_in_input_and_every_parameter(monkeypatch, scan_op):
    from portable_ssm.backends import torch as torch_backend

    if not scan_op:  # autograd of the reference scan instead of the portable_ssm::ssd_scan op
        monkeypatch.setattr(torch_backend, "_scan_op_takes", lambda *tensors: False)
    chunk = dict(chunk_size=3) if scan_op else {}
    config = ps.Mamba2Config(d_model=4, n_layer=2, d_state=2, headdim=2, ngroups=2, **chunk)
    module = Mamba2Module(config, dtype=torch.float64, seed=3)
    names = [n for n, _ in module.named_parameters()]
    shape = (2, 8, 4) if scan_op else (1, 5, 4)
    x = _tensor(np.random.default_rng(0).standard_normal(shape))

    def run(x, *values):
        return torch.func.functional_call(module, dict(zip(names, values)), (x,))

    inputs = (x, *(p.detach().clone().requires_grad_() for p in module.parameters()))
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def _hf_model(config, params):
    """transformers' pure-torch Mamba2Model with the core params loaded through load_state_dict."""
    transformers = pytest.importorskip("transformers")
    c = config
    hf_config = transformers.Mamba2Config(
        num_heads=c.nheads, head_dim=c.headdim, vocab_size=c.padded_vocab_size or 16, hidden_size=c.d_model,
        state_size=c.d_state, num_hidden_layers=c.n_layer, layer_norm_epsilon=c.norm_eps, expand=c.expand,
        conv_kernel=c.d_conv, n_groups=c.ngroups, use_bias=c.bias, use_conv_bias=c.conv_bias,
        residual_in_fp32=c.residual_in_fp32, chunk_size=8, tie_word_embeddings=c.tie_embeddings,
        time_step_limit=c.dt_limit)
    model = transformers.Mamba2Model(hf_config)
    state = {("embeddings.weight" if k == "embedding.weight" else k): v.detach().clone()
             for k, v in params.items()}
    if "embeddings.weight" not in state:
        state["embeddings.weight"] = model.embeddings.weight.detach().clone()
    model.load_state_dict(state, strict=True)
    return model


def _assert_same_grads(module, hf, rtol=2e-4):
    hf_params = dict(hf.named_parameters())
    for name, p in module.named_parameters():
        hf_grad = hf_params["embeddings.weight" if name == "embedding.weight" else name].grad
        assert hf_grad is not None and p.grad is not None, name
        err = rel_err(p.grad.numpy(), hf_grad.numpy())
        assert err < rtol, f"{name}: gradient differs from transformers by {err:.2e}"


def test_backbone_gradients_equal_transformers_mamba2model():
    config = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, ngroups=2)
    module = Mamba2Module(config, seed=4)
    hf = _hf_model(config, module.params())
    x = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(0))
    ours_x, hf_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = module(ours_x)
    theirs = hf(inputs_embeds=hf_x, use_cache=False).last_hidden_state
    assert rel_err(ours.detach().numpy(), theirs.detach().numpy()) < 1e-5
    _probe(ours).backward()
    _probe(theirs).backward()
    assert rel_err(ours_x.grad.numpy(), hf_x.grad.numpy()) < 2e-4
    _assert_same_grads(module, hf)


def test_language_model_gradients_equal_transformers_with_the_tied_head():
    config = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, vocab_size=30)
    module = Mamba2LMModule(config, seed=5)
    hf = _hf_model(config, module.params())
    ids = torch.randint(0, 30, (2, 11), generator=torch.Generator().manual_seed(1))
    ours = module(ids)
    theirs = hf(input_ids=ids, use_cache=False).last_hidden_state @ hf.embeddings.weight.T  # tied head
    assert rel_err(ours.detach().numpy(), theirs.detach().numpy()) < 1e-5
    _probe(ours).backward()
    _probe(theirs).backward()
    _assert_same_grads(module, hf)


def test_gradients_flow_through_a_carried_state_and_detach_state_cuts_them():
    config = ps.Mamba2Config(d_model=8, n_layer=2, d_state=4, headdim=4)
    module = Mamba2Module(config, dtype=torch.float64, seed=6)
    x = torch.randn(1, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cut = 7

    def grads(first, second, carry):
        module.zero_grad()
        _, state = module(first, return_state=True)
        _probe(module(second, initial_state=carry(state))).backward()
        return {n: p.grad.clone() for n, p in module.named_parameters()}

    whole = x.clone().requires_grad_()
    _probe(module(whole)[:, cut:, :]).backward()
    full = {n: p.grad.clone() for n, p in module.named_parameters()}

    first, second = x[:, :cut, :].clone().requires_grad_(), x[:, cut:, :].clone().requires_grad_()
    carried = grads(first, second, lambda s: s)
    for name, grad in full.items():
        assert rel_err(carried[name].numpy(), grad.numpy()) < 1e-10, name
    assert torch.allclose(first.grad, whole.grad[:, :cut, :], rtol=1e-10, atol=1e-12)
    assert first.grad.abs().max() > 0

    first_cut = x[:, :cut, :].clone().requires_grad_()
    detached = grads(first_cut, second, detach_state)
    assert first_cut.grad is None
    with torch.no_grad():
        _, state = module(x[:, :cut, :], return_state=True)
    constant = grads(x[:, :cut, :], x[:, cut:, :], lambda s: state)
    for name, grad in detached.items():
        assert torch.allclose(grad, constant[name], rtol=1e-12, atol=0.0), name
    changed = [n for n in full if not torch.allclose(detached[n], full[n], rtol=1e-6, atol=0.0)]
    assert "layers.0.mixer.in_proj.weight" in changed


@pytest.fixture
def scan_op_on_short_rows(monkeypatch):
    """The torch backend's ``portable_ssm::ssd_scan`` op with its backward in the forward's chunks
    (the tests' rows are shorter than one BACKWARD_CHUNK)."""
    from portable_ssm.backends import torch as torch_backend

    monkeypatch.setattr(torch_backend, "BACKWARD_CHUNK", 1)


def _scan_case(dtype, *, b=2, l=37, h=4, p=3, g=2, n=5, d_shape="h", initial=True, seed=0):
    """Scan arguments as leaf tensors of ``dtype``: Δ > 0, A < 0, D of shape [h], [h, p] or None."""
    rng = np.random.default_rng(seed)
    host = dict(x=rng.standard_normal((b, l, h, p)), dt=rng.uniform(0.05, 0.8, (b, l, h)),
                A=-np.exp(rng.uniform(-1.0, 1.0, h)), B=rng.standard_normal((b, l, g, n)),
                C=rng.standard_normal((b, l, g, n)),
                D={"h": rng.standard_normal(h), "hp": rng.standard_normal((h, p)), None: None}[d_shape],
                initial_states=rng.standard_normal((b, h, p, n)) if initial else None)
    return {k: None if v is None else _tensor(v, dtype) for k, v in host.items()}


def _scan_grads(args, chunk_size, *, native, state_loss):
    """Gradients of a probe of y (and of the final state with ``state_loss``) through the torch
    backend's scan: its ``portable_ssm::ssd_scan`` op (``native``) or autograd of the reference."""
    from portable_ssm.backends import torch as torch_backend

    from portable_ssm import ssd

    leaves = {k: None if v is None else v.detach().clone().requires_grad_() for k, v in args.items()}
    if native:
        y, final = torch_backend.ssd_chunked(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"],
                                             chunk_size, leaves["initial_states"], D=leaves["D"])
    else:
        y, final = ssd.ssd_chunked_ref(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"],
                                       chunk_size=chunk_size, initial_states=leaves["initial_states"],
                                       xp=torch_backend.xp, D=leaves["D"])
    (_probe(y) + (_probe(final, seed=2) if state_loss else 0)).backward()
    return {k: v.grad for k, v in leaves.items() if v is not None}


@pytest.mark.parametrize("kernels", ["1", "0"], ids=["cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["float64", "float32"])
@pytest.mark.parametrize("case", [
    dict(chunk_size=8),  # 4 whole chunks and a short one; ngroups 2; D [h]; an initial state
    dict(chunk_size=None, d_shape="hp", initial=False, g=1),  # one chunk; D [h, p]
    dict(chunk_size=5, d_shape=None, b=1, l=12, state_loss=False),  # no D; y alone reaches the loss
    dict(chunk_size=3, b=3, l=10, h=3, g=3),  # a group per head
], ids=["chunks", "one-chunk-Dhp", "no-D-y-only", "head-per-group"])
def test_cpu_training_scan_op_gives_the_references_autograd_gradients(monkeypatch, scan_op_on_short_rows, kernels,
                                                                     dtype, rtol, case):
    from portable_ssm.backends import torch_scan

    monkeypatch.setenv("PORTABLE_SSM_CPU_KERNELS", kernels)  # float32 diagonal blocks: the kernel where built
    case = dict(case)
    chunk_size, state_loss = case.pop("chunk_size"), case.pop("state_loss", True)
    calls = []
    monkeypatch.setattr(torch_scan, "ssd_chunked_grad",
                        lambda *a, _real=torch_scan.ssd_chunked_grad: calls.append(1) or _real(*a))
    args = _scan_case(dtype, **case)
    native = _scan_grads(args, chunk_size, native=True, state_loss=state_loss)
    assert calls == [1], "the backward did not run through portable_ssm::ssd_scan_backward"
    reference = _scan_grads(args, chunk_size, native=False, state_loss=state_loss)
    assert native.keys() == reference.keys()
    for name, grad in reference.items():
        assert native[name].shape == grad.shape and native[name].dtype == grad.dtype, name
        err = rel_err(native[name].numpy(), grad.numpy())
        assert err < rtol, f"{name}: the op's gradient differs from the reference's autograd by {err:.2e}"


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["float64", "float32"])
def test_scan_op_backward_in_longer_chunks_than_the_forward_gives_the_same_gradients(monkeypatch,
                                                                                    scan_op_on_short_rows, dtype,
                                                                                    rtol):
    from portable_ssm.backends import torch as torch_backend

    monkeypatch.setattr(torch_backend, "BACKWARD_CHUNK", 16)  # the forward's 5-step chunks, the backward's 16
    args = _scan_case(dtype)
    native = _scan_grads(args, 5, native=True, state_loss=True)
    reference = _scan_grads(args, 5, native=False, state_loss=True)
    for name, grad in reference.items():
        assert rel_err(native[name].numpy(), grad.numpy()) < rtol, name


def test_scan_op_backward_is_differentiable_with_the_references_second_derivatives(scan_op_on_short_rows):
    """A backward differentiated in turn (create_graph: a gradient penalty, a Hessian-vector
    product) gets autograd of the reference inside the op's backward, not constants."""
    from portable_ssm.backends import torch as torch_backend

    from portable_ssm import ssd

    args = _scan_case(torch.float64, b=1, l=12, h=2, g=1)

    def second(native):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items()}
        x, dt, A, B, C, D, initial = leaves.values()
        if native:
            y, final = torch_backend.ssd_chunked(x, dt, A, B, C, 5, initial, D=D)
        else:
            y, final = ssd.ssd_chunked_ref(x, dt, A, B, C, chunk_size=5, initial_states=initial,
                                           xp=torch_backend.xp, D=D)
        firsts = torch.autograd.grad(_probe(y) + _probe(final, seed=2), list(leaves.values()), create_graph=True)
        penalty = sum((g * g).sum() for g in firsts)
        return torch.autograd.grad(penalty, list(leaves.values()))

    for name, got, want in zip(args, second(native=True), second(native=False), strict=True):
        assert rel_err(got.numpy(), want.numpy()) < 1e-12, name


def test_scan_op_gives_the_references_gradients_for_a_non_finite_input(scan_op_on_short_rows):
    args = _scan_case(torch.float64, b=1, l=20, g=1)
    x = args["x"].detach().clone()
    x[0, 13, 1, 0] = float("inf")
    args["x"] = x.requires_grad_()
    native = _scan_grads(args, 8, native=True, state_loss=False)
    reference = _scan_grads(args, 8, native=False, state_loss=False)
    # y is linear in x, so x's gradient stays finite; Δ's is non-finite only where the inf reaches
    assert bool(torch.isfinite(reference["x"]).all()) and bool(torch.isfinite(reference["dt"][0, :13]).all())
    assert not bool(torch.isfinite(reference["dt"]).all())
    for name, grad in reference.items():
        np.testing.assert_allclose(native[name].numpy(), grad.numpy(), rtol=1e-12, atol=0, equal_nan=True,
                                   err_msg=name)


@pytest.mark.parametrize("change", ["seq_idx", "bfloat16", "mixed dtypes"])
def test_scan_op_leaves_packed_rows_and_other_dtypes_to_the_reference(monkeypatch, change):
    from portable_ssm.backends import torch as torch_backend
    from portable_ssm.backends import torch_scan

    monkeypatch.setattr(torch_scan, "ssd_chunked_grad", lambda *a: pytest.fail("the op took the scan"))
    args = _scan_case(torch.float32, initial=False)
    b, l = args["x"].shape[:2]
    seq_idx = torch.zeros((b, l), dtype=torch.int32) if change == "seq_idx" else None
    if change == "bfloat16":
        args = {k: None if v is None else v.detach().to(torch.bfloat16).requires_grad_() for k, v in args.items()}
    if change == "mixed dtypes":
        args["A"] = args["A"].detach().double().requires_grad_()
    y, final = torch_backend.ssd_chunked(args["x"], args["dt"], args["A"], args["B"], args["C"], 8, None,
                                         seq_idx=seq_idx, D=args["D"])
    (y.float().sum() + final.float().sum()).backward()
    assert all(v.grad is not None for v in args.values() if v is not None)


@pytest.mark.parametrize("l", [1, 5, 3000])
def test_scan_op_takes_cpu_rows_of_any_length(l):
    from portable_ssm.backends import torch as torch_backend

    x = torch.zeros((2, l, 4, 3), requires_grad=True)
    rest = (torch.zeros(x.shape[:3]), torch.zeros(4), torch.zeros((2, l, 1, 5)), torch.zeros((2, l, 1, 5)), None,
            None, torch.zeros(4))
    assert torch_backend._scan_op_takes(x, *rest)
    assert not torch_backend._scan_op_takes(x, *rest[:5], torch.zeros((2, l), dtype=torch.int32), rest[6])

