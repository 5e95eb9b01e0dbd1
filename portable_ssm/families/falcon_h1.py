"""TII Falcon-H1 (transformers' ``FalconH1``): every layer runs attention and Mamba-2 in parallel
on one normed input and adds them, then a SwiGLU MLP.

Its muP multipliers are folded into the weights once, at load (every one sits next to a linear
map, so the result is the same up to rounding): ``mup_vector`` (from ``ssm_multipliers``, over
in_proj's ``[z, x, B, C, dt]`` rows) and ``ssm_in_multiplier`` into in_proj,
``ssm_out_multiplier`` into out_proj, ``attention_in_multiplier`` into q/k/v, ``key_multiplier``
into k (RoPE is linear), ``attention_out_multiplier`` into o_proj, ``mlp_multipliers`` into the
gate and down projections; ``embedding_multiplier`` and ``lm_head_multiplier`` stay scalars of
the stack. The Mamba norm is optional (``mamba_rms_norm``), norm-before-gate by default.
"""

from __future__ import annotations

from typing import Any

from .._array import namespace
from ..blocks import AttentionSpec, MLPSpec
from ..io.errors import CheckpointError
from ..stack import HybridConfig
from ._common import apply_rules, decoder_rules, hub_rope, mamba_config_fields, require

MODEL_TYPES = ("falcon_h1",)

_RULES = (
    *decoder_rules("final_layernorm", "pre_ff_layernorm"),
    (r"model\.layers\.(\d+)\.mamba\.(.+)", r"layers.\1.mixer.mamba.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.(.+)", r"layers.\1.mixer.attention.\2"),
    (r"model\.layers\.(\d+)\.feed_forward\.(gate|up|down)_proj\.weight", r"layers.\1.ffn.\2"),
)


def _numbers(raw: Any, key: str, count: int) -> list[float]:
    value = raw.get(key) or [1.0] * count
    if (not isinstance(value, list) or len(value) != count
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)):
        raise CheckpointError(f"{key}: expected a list of {count} numbers, got {value!r:.80}")
    return [float(v) for v in value]


def config(raw: Any) -> tuple[HybridConfig, tuple[str, ...]]:
    """config.json -> ``(HybridConfig, notes)``."""
    d, n = raw.int("hidden_size"), raw.int("num_hidden_layers")
    require(raw.get("hidden_act", "silu"), ("silu",), "hidden_act")
    require(raw.get("mlp_bias", False), (False,), "mlp_bias")
    if raw.bool("projectors_bias", False) != raw.bool("mamba_proj_bias", False):
        raise CheckpointError("projectors_bias: only equal to mamba_proj_bias is supported (one bias flag for the "
                              "Mamba in_proj and out_proj)")
    heads_ssm = raw.int("mamba_n_heads", 128)
    width = raw.int("mamba_d_ssm") if raw.get("mamba_d_ssm") is not None else raw.int("mamba_expand", 2) * d
    head_dim_ssm = raw.get("mamba_d_head", "auto")
    head_dim_ssm = width // heads_ssm if head_dim_ssm == "auto" else raw.int("mamba_d_head")
    if heads_ssm * head_dim_ssm != width:
        raise CheckpointError(f"mamba_n_heads: mamba_n_heads * mamba_d_head = {heads_ssm * head_dim_ssm} must equal "
                              f"the SSM width {width} (mamba_d_ssm, else mamba_expand * hidden_size)")
    rms = raw.bool("mamba_rms_norm", False)
    mamba = mamba_config_fields(width, raw.float("rms_norm_eps", 1e-5), headdim=head_dim_ssm,
                                d_state=raw.int("mamba_d_state", 256), d_conv=raw.int("mamba_d_conv", 4),
                                ngroups=raw.int("mamba_n_groups", 1), chunk_size=raw.int("mamba_chunk_size", 256),
                                dt_limit=raw.pair("time_step_limit", (0.0, float("inf"))),
                                conv_bias=raw.bool("mamba_conv_bias", True), bias=raw.bool("mamba_proj_bias", False),
                                rmsnorm=rms, norm_before_gate=raw.bool("mamba_norm_before_gate", True) and rms)
    heads = raw.int("num_attention_heads")
    head_dim = raw.int("head_dim", d // heads)
    for key, count in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        _numbers(raw, key, count)
    cfg = HybridConfig(
        d_model=d, vocab_size=raw.int("vocab_size"), layers=(("parallel", "mlp"),) * n, mamba=mamba,
        attention=AttentionSpec(heads, raw.int("num_key_value_heads", heads), head_dim, head_dim ** -0.5,
                                rotary_dim=head_dim, rope_theta=hub_rope(raw), bias=raw.bool("attention_bias", False)),
        mlp=MLPSpec("silu", True), d_ff=raw.int("intermediate_size"), norm_eps=raw.float("rms_norm_eps", 1e-5),
        embedding_multiplier=raw.float("embedding_multiplier", 1.0),
        logits_scaling=1.0 / raw.float("lm_head_multiplier", 1.0),
        tie_embeddings=raw.bool("tie_word_embeddings", False), family="falcon_h1")
    norm = ("rmsnorm(y) * silu(z)" if mamba.norm_before_gate else "rmsnorm(y * silu(z))") if rms else "y * silu(z)"
    return cfg, (f"Mamba mixer: {norm} per group (transformers' FalconH1RMSNormGated / mamba_rms_norm)",
                 "muP multipliers folded into the projection weights at load")


def _scaled(value: tuple[Any, str], factor: Any) -> tuple[Any, str]:
    return value[0] * factor, value[1]


def rename(tensors: dict[str, Any], cfg: HybridConfig, raw: Any) -> dict[str, Any]:
    """Checkpoint names -> core names, the gate and up projections packed, every muP multiplier
    folded into its projection (see the module docstring)."""
    out = apply_rules(tensors, _RULES)
    c = cfg.mamba
    z_x, gn = c.ssm_dim, c.ngroups * c.d_state
    mup = _numbers(raw, "ssm_multipliers", 5)
    gate_m, down_m = _numbers(raw, "mlp_multipliers", 2)
    s_in, s_out = raw.float("ssm_in_multiplier", 1.0), raw.float("ssm_out_multiplier", 1.0)
    a_in, a_out, key_m = (raw.float(k, 1.0) for k in ("attention_in_multiplier", "attention_out_multiplier",
                                                      "key_multiplier"))
    for i in range(cfg.n_layer):
        m, a, f = f"layers.{i}.mixer.mamba.", f"layers.{i}.mixer.attention.", f"layers.{i}.ffn."
        for leaf in ("in_proj.weight", "in_proj.bias"):
            if m + leaf in out:
                w, stored = out[m + leaf]
                xp = namespace(in_proj=w)  # host arrays, as read
                bounds = (0, z_x, 2 * z_x, 2 * z_x + gn, 2 * z_x + 2 * gn, w.shape[0])  # [z, x, B, C, dt] rows
                parts = [w[lo:hi, ...] * mult for lo, hi, mult in zip(bounds[:-1], bounds[1:], mup)]
                out[m + leaf] = (xp.concat(parts, axis=0) * (s_in if leaf.endswith("weight") else 1.0), stored)
        for leaf in ("out_proj.weight", "out_proj.bias"):
            if m + leaf in out:
                out[m + leaf] = _scaled(out[m + leaf], s_out)
        for proj, mult in (("q_proj", a_in), ("k_proj", a_in * key_m), ("v_proj", a_in), ("o_proj", a_out)):
            if a + proj + ".weight" in out:
                out[a + proj + ".weight"] = _scaled(out[a + proj + ".weight"], mult)
            bias_mult = key_m if proj == "k_proj" else a_out if proj == "o_proj" else 1.0
            if a + proj + ".bias" in out:
                out[a + proj + ".bias"] = _scaled(out[a + proj + ".bias"], bias_mult)
        gate, up = out.pop(f + "gate", None), out.pop(f + "up", None)
        if gate is None or up is None or gate[0].shape != up[0].shape:
            raise CheckpointError(f"model.layers.{i}.feed_forward: gate_proj and up_proj must both be present "
                                  f"with one shape")
        xp = namespace(gate_proj=gate[0])
        out[f + "up.weight"] = (xp.concat([gate[0] * gate_m, up[0]], axis=0), gate[1])  # [2f, d]: gate then up
        if f + "down" in out:
            out[f + "down.weight"] = _scaled(out.pop(f + "down"), down_m)
    return out
