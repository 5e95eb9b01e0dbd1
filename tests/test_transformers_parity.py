"""transformers' pure-torch Mamba2 is the outside oracle: scans, step and the whole stack agree.

Small random models are built at test time (no network). transformers computes its scan in float32
even for float64 models, so parity is checked in float32 (≤1e-5 relative error).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err

import portable_ssm as ps

torch = pytest.importorskip("torch")
mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
transformers = pytest.importorskip("transformers")


def hf_config(cfg: ps.Mamba2Config, **extra) -> transformers.Mamba2Config:
    """The transformers config of the same architecture."""
    return transformers.Mamba2Config(
        hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer, state_size=cfg.d_state, head_dim=cfg.headdim,
        num_heads=cfg.nheads, n_groups=cfg.ngroups, expand=cfg.expand, conv_kernel=cfg.d_conv,
        chunk_size=cfg.chunk_size, layer_norm_epsilon=cfg.norm_eps, use_conv_bias=cfg.conv_bias,
        use_bias=cfg.bias, residual_in_fp32=cfg.residual_in_fp32, time_step_limit=cfg.dt_limit,
        vocab_size=cfg.padded_vocab_size or 16, **extra)


def perturbed_params(cfg: ps.Mamba2Config, seed: int) -> dict:
    """Fresh params with norms, D and biases moved away from their 1/0 init so they matter."""
    rng = np.random.default_rng(seed)
    params = ps.init_params(cfg, seed=seed)
    return {k: (v + 0.2 * rng.standard_normal(v.shape).astype(v.dtype))
            if any(s in k for s in ("norm", ".D", "bias")) else v for k, v in params.items()}


def hf_model(cfg: ps.Mamba2Config, params: dict):
    model = transformers.Mamba2Model(hf_config(cfg)).eval()
    state = {k: torch.from_numpy(np.asarray(v)) for k, v in params.items()}
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["embeddings.weight"]
    return model


CONFIGS = [
    dict(d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=1, chunk_size=16),
    dict(d_model=48, n_layer=3, d_state=8, headdim=16, ngroups=2, chunk_size=8),
    dict(d_model=32, n_layer=1, d_state=4, headdim=4, ngroups=4, chunk_size=32, bias=True, d_conv=3),
    dict(d_model=16, n_layer=2, d_state=8, headdim=8, ngroups=1, residual_in_fp32=False, dt_limit=(0.01, 0.5)),
]


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("length", [1, 13, 64, 100])
def test_forward_matches_transformers_mamba2model(kw, length):
    cfg = ps.Mamba2Config(**kw)
    params = perturbed_params(cfg, seed=length)
    x = np.random.default_rng(length).standard_normal((2, length, cfg.d_model)).astype(np.float32)
    with torch.no_grad():
        expected = hf_model(cfg, params)(inputs_embeds=torch.from_numpy(x)).last_hidden_state.numpy()
    assert rel_err(ps.forward(x, params, config=cfg), expected) <= 1e-5
    y_torch = ps.forward(torch.from_numpy(x), params, config=cfg, backend="torch")
    assert isinstance(y_torch, torch.Tensor) and y_torch.dtype == torch.float32
    assert rel_err(y_torch.numpy(), expected) <= 1e-5


@pytest.mark.parametrize("g,Q,l", [(1, 16, 37), (2, 8, 64), (4, 32, 5)])
def test_ssd_scan_matches_transformers_mamba2_chunk_scan(g, Q, l):
    rng = np.random.default_rng(l)
    b, h, p, n = 2, 8, 4, 6
    x, dt = rng.standard_normal((b, l, h, p)), rng.standard_normal((b, l, h))
    A, D, dt_bias = -np.exp(rng.standard_normal(h)), rng.standard_normal(h), rng.standard_normal(h)
    B, C = rng.standard_normal((b, l, g, n)), rng.standard_normal((b, l, g, n))
    s0 = rng.standard_normal((b, h, p, n))
    f32 = [np.float32(v) if np.isscalar(v) else v.astype(np.float32) for v in (x, dt, A, B, C, D, dt_bias, s0)]
    x, dt, A, B, C, D, dt_bias, s0 = f32
    t = [torch.from_numpy(v) for v in f32]
    y_hf, s_hf = mamba2.mamba2_chunk_scan(t[0], t[1], t[2], t[3], t[4], chunk_size=Q, D=t[5], dt_bias=t[6],
                                          initial_states=t[7], dt_softplus=True, return_final_states=True)
    y, s = ps.ssd_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, initial_states=s0, dt_softplus=True,
                       return_final_states=True)
    assert rel_err(y, y_hf.numpy()) <= 1e-5
    assert rel_err(s, s_hf.numpy()) <= 1e-5


@pytest.mark.parametrize("g", [1, 2])
def test_ssd_step_matches_transformers_selective_state_update(g):
    rng = np.random.default_rng(g)
    b, h, p, n = 3, 4, 5, 6
    arrays = dict(x=rng.standard_normal((b, h, p)), dt=rng.standard_normal((b, h)),
                  B=rng.standard_normal((b, g, n)), C=rng.standard_normal((b, g, n)),
                  z=rng.standard_normal((b, h, p)), state=rng.standard_normal((b, h, p, n)))
    A, D, dt_bias = -np.exp(rng.standard_normal(h)), rng.standard_normal(h), rng.standard_normal(h)
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    A, D, dt_bias = (v.astype(np.float32) for v in (A, D, dt_bias))
    state_hf = torch.from_numpy(arrays["state"].copy())
    # transformers wants per-(head, channel) dt, A, D, dt_bias, and updates state in place
    y_hf = mamba2.mamba2_selective_state_update(
        state_hf, torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["dt"])[..., None].expand(b, h, p),
        torch.from_numpy(A)[:, None, None].expand(h, p, n), torch.from_numpy(arrays["B"]),
        torch.from_numpy(arrays["C"]), torch.from_numpy(D)[:, None].expand(h, p), z=torch.from_numpy(arrays["z"]),
        dt_bias=torch.from_numpy(dt_bias)[:, None].expand(h, p), dt_softplus=True)
    y, new_state = ps.ssd_step(arrays["state"], arrays["x"], arrays["dt"], A, arrays["B"], arrays["C"], D=D,
                               z=arrays["z"], dt_bias=dt_bias, dt_softplus=True)
    assert rel_err(y, y_hf.numpy()) <= 1e-5
    assert rel_err(new_state, state_hf.numpy()) <= 1e-5


def test_gated_norm_matches_transformers_grouped_rmsnorm():
    from portable_ssm.norm import gated_rms_norm

    # The gated norm its mixer builds (d_inner 24 in 3 groups of 8), whatever transformers names its class.
    cfg = ps.Mamba2Config(d_model=12, n_layer=1, d_state=4, headdim=8, ngroups=3, norm_eps=1e-5)
    norm = mamba2.Mamba2Mixer(hf_config(cfg), layer_idx=0).norm
    rng = np.random.default_rng(0)
    y, z = (rng.standard_normal((2, 5, cfg.d_inner)).astype(np.float32) for _ in range(2))
    weight = rng.standard_normal(cfg.d_inner).astype(np.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(weight))
        expected = norm(torch.from_numpy(y), torch.from_numpy(z)).numpy()
    import array_api_compat.numpy as xp

    assert rel_err(gated_rms_norm(y, z, weight, cfg.ngroups, cfg.norm_eps, xp=xp), expected) <= 1e-6


def test_init_params_follow_the_transformers_parameter_layout():
    cfg = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=2, vocab_size=50,
                          tie_embeddings=False)
    model = transformers.Mamba2ForCausalLM(hf_config(cfg, tie_word_embeddings=False))
    hf_shapes = {k.removeprefix("backbone.").replace("embeddings.", "embedding."): tuple(v.shape)
                 for k, v in model.state_dict().items()}
    assert hf_shapes == ps.param_shapes(cfg)
