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


def test_small_model_passes_float64_gradcheck_in_input_and_every_parameter():
    config = ps.Mamba2Config(d_model=4, n_layer=2, d_state=2, headdim=2, ngroups=2)
    module = Mamba2Module(config, dtype=torch.float64, seed=3)
    names = [n for n, _ in module.named_parameters()]
    x = _tensor(np.random.default_rng(0).standard_normal((1, 5, 4)))

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
