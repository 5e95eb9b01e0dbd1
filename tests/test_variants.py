"""Every Mamba-2 option that changes the math (rmsnorm, norm_before_gate, d_ssm, D_has_hdim, bias,
conv_bias, dt_limit, A_init_range) equals mamba_ssm's ``Mamba2``, forward and step, on every backend;
state-spaces checkpoints carrying them load; float32 B, C beside half x are computed in float32.

The reference is one ``mamba_ssm.modules.mamba2.Mamba2`` layer written out in float64 NumPy from
its source (mamba_ssm needs CUDA, so it cannot run here): ``zxbcdt = in_proj(u)`` split as
``[z0, x0, z, xBC, dt]`` with ``d_mlp = d_inner - d_ssm``; depthwise causal conv then SiLU on
``xBC``; Δ = clamp(softplus(dt + dt_bias), dt_limit); the recurrence with ``A = -exp(A_log)`` and
D (``(h p) -> h p`` with D_has_hdim); ``rmsnorm=False``: ``y · silu(z)``; ``norm_before_gate``:
``rmsnorm(y) · silu(z)``, else ``rmsnorm(y · silu(z))`` (groups of d_ssm/ngroups); with d_mlp
``cat(silu(z0) · x0, y)``; ``out_proj``. Blocks around it as mamba_ssm's MixerModel: pre-norm,
float32-or-better residual, ``norm_f``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_close, rel_err

import portable_ssm as ps
from portable_ssm.io import load_pretrained

BASE = dict(d_model=16, n_layer=1, d_state=8, d_conv=4, headdim=8, expand=2)
VARIANTS = {
    "default": {},
    "rmsnorm-off": dict(rmsnorm=False),
    "norm-before-gate": dict(norm_before_gate=True, ngroups=2),
    "d_ssm-gated-mlp": dict(d_ssm=16),
    "D_has_hdim": dict(D_has_hdim=True),
    "bias-no-conv-bias": dict(bias=True, conv_bias=False),
    "dt_limit": dict(dt_limit=(0.02, 0.08)),
    "A_init_range": dict(A_init_range=(4.0, 8.0)),
    "d_ssm-rmsnorm-off-D_has_hdim": dict(d_ssm=24, rmsnorm=False, D_has_hdim=True, bias=True),
    "d_ssm-norm-before-gate-groups": dict(d_ssm=16, norm_before_gate=True, ngroups=2, D_has_hdim=True),
}
L = 70  # two chunks of 35 in the chunked scan


# ---------------------------------------------------------------- the mamba_ssm reference, float64 NumPy

def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def rms(v: np.ndarray, weight: np.ndarray, group: int, eps: float = 1e-5) -> np.ndarray:
    """mamba_ssm's ``rms_norm_ref`` without gate: per group of ``group`` channels."""
    *lead, d = v.shape
    g = v.reshape(*lead, d // group, group)
    g = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + eps)
    return g.reshape(*lead, d) * weight


def mamba2_layer(u: np.ndarray, P: dict[str, np.ndarray], o: dict) -> np.ndarray:
    """One ``Mamba2.forward`` (its non-fused path) over ``u [b, l, d_model]`` from zero states.
    ``P``: mamba_ssm's tensor names (D flat ``[d_ssm]`` with D_has_hdim); ``o``: the options."""
    b, l, _ = u.shape
    d_inner = o["expand"] * o["d_model"]
    d_ssm = o.get("d_ssm") or d_inner
    p, g, n, k = o["headdim"], o.get("ngroups", 1), o["d_state"], o["d_conv"]
    h = d_ssm // p
    zxbcdt = u @ P["in_proj.weight"].T + P.get("in_proj.bias", 0.0)
    d_mlp = (zxbcdt.shape[-1] - 2 * d_ssm - 2 * g * n - h) // 2
    z0, x0, z, xBC, dt = np.split(zxbcdt, np.cumsum([d_mlp, d_mlp, d_ssm, d_ssm + 2 * g * n]), axis=-1)
    w = P["conv1d.weight"][:, 0, :]  # conv1d with padding k-1, the first l outputs
    padded = np.concatenate([np.zeros((b, k - 1, xBC.shape[-1])), xBC], axis=1)
    xBC = sum(padded[:, j:j + l] * w[:, j] for j in range(k)) + P.get("conv1d.bias", 0.0)
    x, B, C = np.split(silu(xBC), [d_ssm, d_ssm + g * n], axis=-1)
    x, B, C = x.reshape(b, l, h, p), B.reshape(b, l, g, n), C.reshape(b, l, g, n)
    B, C = np.repeat(B, h // g, axis=2), np.repeat(C, h // g, axis=2)  # head i reads group i // (h/g)
    A = -np.exp(P["A_log"])
    delta = np.clip(np.log1p(np.exp(dt + P["dt_bias"])), *o.get("dt_limit", (0.0, np.inf)))
    D = P["D"].reshape(h, p) if o.get("D_has_hdim") else P["D"][:, None]
    state, ys = np.zeros((b, h, p, n)), []
    for t in range(l):  # selective_state_update, one step at a time
        dA = np.exp(delta[:, t] * A)[:, :, None, None]
        state = state * dA + (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(np.sum(state * C[:, t, :, None, :], axis=-1) + D * x[:, t])
    y = np.stack(ys, axis=1).reshape(b, l, d_ssm)
    if not o.get("rmsnorm", True):
        y = y * silu(z)
    elif o.get("norm_before_gate", False):
        y = rms(y, P["norm.weight"], d_ssm // g) * silu(z)
    else:
        y = rms(y * silu(z), P["norm.weight"], d_ssm // g)
    if d_mlp > 0:
        y = np.concatenate([silu(z0) * x0, y], axis=-1)
    return y @ P["out_proj.weight"].T + P.get("out_proj.bias", 0.0)


def mixer_model(x: np.ndarray, tensors: dict[str, np.ndarray], o: dict) -> np.ndarray:
    """mamba_ssm's MixerModel over embeddings: pre-norm blocks with a residual stream, then norm_f."""
    residual, hidden = None, x
    for i in range(o["n_layer"]):
        residual = hidden if residual is None else residual + hidden
        layer = {k.split("mixer.", 1)[1]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.mixer.")}
        hidden = mamba2_layer(rms(residual, tensors[f"layers.{i}.norm.weight"], x.shape[-1]), layer, o)
    return rms(residual + hidden, tensors["norm_f.weight"], x.shape[-1])


# ---------------------------------------------------------------- weights in both namings

def random_params(config: ps.Mamba2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """init_params (float64) with every weight perturbed, so D, norms, biases and dt_bias all matter."""
    rng = np.random.default_rng(seed)
    params = ps.init_params(config, seed=seed, dtype="float64")
    return {k: v + 0.2 * rng.standard_normal(v.shape) for k, v in params.items()}


def mamba_ssm_names(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Core params as mamba_ssm holds them: D flat ``[h·p]`` (``Mamba2.D`` is ``(d_ssm,)``)."""
    return {k: v.reshape(-1) if k.endswith("mixer.D") else v for k, v in params.items()}


def setup(name: str, seed: int = 0):
    options = dict(BASE, **VARIANTS[name])
    config = ps.Mamba2Config(**options)
    params = random_params(config, seed)
    x = np.random.default_rng(seed + 1).standard_normal((2, L, config.d_model))
    return options, config, params, x


@pytest.mark.parametrize("name", VARIANTS)
def test_config_shapes_follow_mamba_ssm(name):
    options, config, params, _ = setup(name)
    d_inner = 2 * config.d_model
    d_ssm = options.get("d_ssm", d_inner)
    h, gn = d_ssm // config.headdim, config.ngroups * config.d_state
    assert (config.ssm_dim, config.d_mlp, config.nheads) == (d_ssm, d_inner - d_ssm, h)
    m = "layers.0.mixer."
    assert params[m + "in_proj.weight"].shape == (2 * d_inner + 2 * gn + h, config.d_model)
    assert params[m + "conv1d.weight"].shape == (d_ssm + 2 * gn, 1, config.d_conv)
    assert params[m + "out_proj.weight"].shape == (config.d_model, d_inner)
    assert params[m + "D"].shape == ((h, config.headdim) if config.D_has_hdim else (h,))
    assert (m + "norm.weight" in params) == config.rmsnorm
    if config.rmsnorm:
        assert params[m + "norm.weight"].shape == (d_ssm,)
    assert (m + "in_proj.bias" in params, m + "conv1d.bias" in params) == (config.bias, config.conv_bias)


def test_A_init_range_sets_A_log():
    config = ps.Mamba2Config(**dict(BASE, d_model=256, headdim=4), A_init_range=(4.0, 8.0))
    A = np.exp(ps.init_params(config, seed=0, dtype="float64")["layers.0.mixer.A_log"])
    assert A.min() >= 4.0 and A.max() <= 8.0 and A.max() - A.min() > 3.0


def test_dt_limit_clamp_changes_the_reference():
    options, _, params, x = setup("dt_limit")
    loose = dict(options, dt_limit=(0.0, np.inf))
    assert rel_err(mixer_model(x, params, loose), mixer_model(x, params, options)) > 1e-3


@pytest.mark.parametrize("name", VARIANTS)
def test_forward_equals_mamba_ssm_on_every_backend(xp, name):
    options, config, params, x = setup(name)
    want = mixer_model(x, mamba_ssm_names(params), options)
    p = {k: xp.asarray_from(v, "float64") for k, v in params.items()}
    got = xp.call(ps.forward, xp.asarray_from(x, "float64"), p, config=config)
    assert_close(xp, got, want, rtol=1e-10, dtype="float64", shape=x.shape)


@pytest.mark.parametrize("name", VARIANTS)
def test_step_by_step_equals_forward_and_mamba_ssm_on_every_backend(xp, name):
    options, config, params, x = setup(name)
    want = mixer_model(x, mamba_ssm_names(params), options)
    p = {k: xp.asarray_from(v, "float64") for k, v in params.items()}
    xs = xp.asarray_from(x, "float64")
    state, outs = None, []
    for t in range(5):
        y_t, state = xp.call(ps.step, xs[:, t, :], state, p, config=config)
        outs.append(xp.numpy(y_t))
    stepped = np.stack(outs, axis=1)
    forward = xp.numpy(xp.call(ps.forward, xs[:, :5, :], p, config=config))
    assert rel_err(stepped, forward) <= 1e-10
    rest = xp.call(ps.forward, xs[:, 5:, :], p, config=config, initial_state=state)
    assert_close(xp, rest, want[:, 5:], rtol=1e-10, dtype="float64")
    assert rel_err(stepped, want[:, :5]) <= 1e-10


@pytest.mark.parametrize("name", VARIANTS)
def test_last_position_alone_equals_the_full_layers_last_row(name):
    """``mixer(last_only=True)``, a prompt pass's last layer, gives the last row and the states of
    the full layer for every variant (the gate's and the gated MLP's rows of in_proj, biases, D per
    channel, groups), from zero and from given states."""
    import array_api_compat.numpy as nxp

    from portable_ssm.mixer import mixer
    from portable_ssm.model import _layer

    _, config, params, x = setup(name)
    layer = _layer(params, 0)
    rng = np.random.default_rng(3)
    states = [(None, None), (rng.standard_normal((2, config.conv_dim, config.d_conv)),
                             rng.standard_normal((2, config.nheads, config.headdim, config.d_state)))]
    for conv, ssm in states:
        full, conv_full, ssm_full = mixer(x, layer, config, conv, ssm, xp=nxp)
        last, conv_last, ssm_last = mixer(x, layer, config, conv, ssm, xp=nxp, last_only=True)
        assert last.shape == (2, 1, config.d_model)
        assert rel_err(last, full[:, -1:]) <= 1e-12
        np.testing.assert_array_equal(conv_last, conv_full)
        assert rel_err(ssm_last, ssm_full) <= 1e-12
    with pytest.raises(ValueError, match="last_only: a prompt pass of whole rows"):
        mixer(x, layer, config, None, None, xp=nxp, last_only=True, seq_idx=np.zeros((2, L), dtype=np.int64))


@pytest.mark.parametrize("name", ["rmsnorm-off", "norm-before-gate", "d_ssm-rmsnorm-off-D_has_hdim",
                                  "d_ssm-norm-before-gate-groups"])
def test_bfloat16_variants_stay_in_bfloat16_near_the_reference(name):
    torch = pytest.importorskip("torch")
    options, config, params, x = setup(name)
    want = mixer_model(x, mamba_ssm_names(params), options)
    p = {k: torch.tensor(v, dtype=torch.bfloat16) for k, v in params.items()}
    xs = torch.tensor(x, dtype=torch.bfloat16)
    y, state = ps.forward(xs, p, config=config, return_state=True)
    y_t, _ = ps.step(xs[:, 0, :], None, p, config=config)
    assert y.dtype == y_t.dtype == torch.bfloat16 and state.ssm[0].dtype == torch.float32
    assert rel_err(y.float().numpy(), want) <= 5e-2
    assert rel_err(y_t.float().numpy(), want[:, 0]) <= 5e-2


@pytest.mark.parametrize("name", VARIANTS)
def test_fused_decode_kernel_sees_every_variant_it_computes_and_not_norm_before_gate(monkeypatch, name):
    """With the fused decode kernel's array-API twin (decode_step_ref) installed as the backend's
    ``decode_step``, steps still equal mamba_ssm; norm_before_gate (the kernel gates before the norm)
    never reaches it, every other variant (d_ssm, rmsnorm=False, D_has_hdim, biases) does."""
    from test_cuda_sources import import_without_cupy

    from portable_ssm import mixer as mixer_module

    decode_step_ref = import_without_cupy("reference").decode_step_ref
    calls = []

    def fast_op(xp, op):
        calls.append(op)
        return decode_step_ref if op == "decode_step" else None

    monkeypatch.setattr(mixer_module, "fast_op", fast_op)
    options, config, params, x = setup(name)
    want = mixer_model(x[:, :3], mamba_ssm_names(params), options)
    state = None
    for t in range(3):
        y_t, state = ps.step(x[:, t, :], state, params, config=config)
        assert rel_err(y_t, want[:, t]) <= 1e-10
    assert ("decode_step" in calls) == (not (config.rmsnorm and config.norm_before_gate))


# ---------------------------------------------------------------- state-spaces checkpoints carrying the options

SS_OPTIONS = {k: VARIANTS[k] for k in ("rmsnorm-off", "norm-before-gate", "d_ssm-gated-mlp", "D_has_hdim",
                                       "bias-no-conv-bias", "dt_limit", "d_ssm-rmsnorm-off-D_has_hdim",
                                       "d_ssm-norm-before-gate-groups")}


def write_state_spaces(folder, options: dict, params: dict[str, np.ndarray], flat_D: bool) -> None:
    """A mamba_ssm checkpoint folder: config.json with ssm_cfg, safetensors in mamba_ssm's names."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    ssm_cfg = dict(layer="Mamba2", **{k: list(v) if isinstance(v, tuple) else v
                                      for k, v in options.items() if k not in ("d_model", "n_layer", "vocab_size")})
    raw = dict(d_model=options["d_model"], n_layer=options["n_layer"], vocab_size=options["vocab_size"],
               pad_vocab_size_multiple=8, tie_embeddings=True, rms_norm=True, residual_in_fp32=True,
               d_intermediate=0, attn_layer_idx=[], ssm_cfg=ssm_cfg)
    (folder / "config.json").write_text(json.dumps(raw))
    tensors = mamba_ssm_names(params) if flat_D else params
    safetensors_numpy.save_file({f"backbone.{k}": v for k, v in tensors.items()}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("flat_D", [True, False], ids=["D-flat", "D-h-p"])
@pytest.mark.parametrize("name", SS_OPTIONS)
def test_state_spaces_checkpoint_with_option_loads_and_matches_mamba_ssm(tmp_path, name, flat_D):
    options = dict(BASE, **VARIANTS[name], n_layer=2, vocab_size=20)
    config = ps.Mamba2Config(**options, pad_vocab_size_multiple=8)
    params = random_params(config, seed=4)
    write_state_spaces(tmp_path, options, params, flat_D)
    lm = load_pretrained(tmp_path, dtype="float64")
    assert lm.config == config
    ids = np.random.default_rng(2).integers(0, 20, (2, 11))
    emb = params["embedding.weight"]
    want = mixer_model(emb[ids], mamba_ssm_names(params), options) @ emb.T
    got = np.asarray(lm.logits(ids))
    assert got.shape == (2, 11, 24)  # the padded rows, as the embedding holds them
    assert rel_err(got, want) <= 1e-10


# ---------------------------------------------------------------- float32 B, C beside half x

def scan_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    b, l, h, p, g, n = 2, 37, 4, 8, 2, 16
    return dict(x=rng.standard_normal((b, l, h, p)), dt=rng.standard_normal((b, l, h)) * 0.5,
                A=-np.exp(rng.standard_normal(h) * 0.5), B=rng.standard_normal((b, l, g, n)),
                C=rng.standard_normal((b, l, g, n)), D=rng.standard_normal(h), z=rng.standard_normal((b, l, h, p)),
                dt_bias=rng.standard_normal(h) * 0.5)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["ssd_scan", "selective_scan", "ssd_step"])
def test_float32_B_C_beside_half_x_are_computed_in_float32(op, half):
    torch = pytest.importorskip("torch")
    a = scan_inputs()
    half_t = getattr(torch, half)
    x, z = (torch.tensor(a[k], dtype=half_t) for k in ("x", "z"))
    B, C, dt, A, D, dt_bias = (torch.tensor(a[k], dtype=torch.float32) for k in ("B", "C", "dt", "A", "D", "dt_bias"))
    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    def run(x, z, B, C):
        if op == "ssd_step":
            state = torch.zeros((2, 4, 8, 16), dtype=torch.float32)
            return ps.ssd_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], **dict(kw, z=z[:, 0]))
        fn = ps.ssd_scan if op == "ssd_scan" else ps.selective_scan
        return fn(x, dt, A, B, C, return_final_states=True, **dict(kw, z=z))

    y, state = run(x, z, B, C)
    y32, state32 = run(x.float(), z.float(), B, C)  # everything float32: the same numbers, unrounded
    assert y.dtype == half_t and state.dtype == torch.float32
    assert torch.equal(y, y32.to(half_t))  # only the output is rounded
    assert torch.equal(state, state32)
    y_rounded, _ = run(x, z, B.to(half_t), C.to(half_t))  # what rounding B, C to half would cost
    assert not torch.equal(y_rounded, y)


def test_B_C_dtype_beside_x_is_checked_at_the_door():
    torch = pytest.importorskip("torch")
    a = scan_inputs()
    x, dt, A = torch.tensor(a["x"], dtype=torch.bfloat16), torch.tensor(a["dt"]), torch.tensor(a["A"])
    with pytest.raises(TypeError, match="B is float64 but x is bfloat16; expected bfloat16 or float32"):
        ps.ssd_scan(x, dt, A, torch.tensor(a["B"]), torch.tensor(a["C"], dtype=torch.float32))
    with pytest.raises(TypeError, match="C is float32 but x is float64; expected float64"):
        ps.ssd_scan(x.double(), dt, A, torch.tensor(a["B"]), torch.tensor(a["C"], dtype=torch.float32))


@pytest.mark.parametrize("field, value, error, message", [
    ("d_ssm", 12, ValueError, "headdim: d_ssm = 12 must be a multiple of headdim = 8"),
    ("d_ssm", 40, ValueError, r"d_ssm: expected None or an int in \[1, d_inner = 32\], got 40"),
    ("rmsnorm", "no", TypeError, "rmsnorm: expected True or False, got 'no'"),
    ("norm_before_gate", 1, TypeError, "norm_before_gate: expected True or False, got 1"),
])
def test_invalid_variant_options_are_named(field, value, error, message):
    with pytest.raises(error, match=message):
        ps.Mamba2Config(**dict(BASE, **{field: value}))


def test_d_ssm_equal_to_d_inner_is_the_default_model():
    config = ps.Mamba2Config(**BASE, d_ssm=32)
    assert config == ps.Mamba2Config(**BASE) and config.d_ssm is None and config.d_mlp == 0
    variant = ps.Mamba2Config(**BASE, d_ssm=16, rmsnorm=False, norm_before_gate=True)
    assert ps.Mamba2Config.from_dict(json.loads(json.dumps(variant.to_dict()))) == variant
