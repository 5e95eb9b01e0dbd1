"""IBM Bamba (transformers' ``Bamba``): Mamba-2 layers with attention at ``attn_layer_indices``,
each followed by a SwiGLU MLP (``gate_proj``/``up_proj`` packed here as ``[gate; up]``).
Attention scale ``head_dim^-0.5``, RoPE on the first ``head_dim · partial_rotary_factor``
channels (0.5: the config class fixes it, whatever the Hub's ``attn_rotary_emb`` says).
"""

from __future__ import annotations

from typing import Any

from .._array import namespace
from ..blocks import AttentionSpec, MLPSpec
from ..io.errors import CheckpointError
from ..stack import HybridConfig
from ._common import apply_rules, decoder_rules, hub_rope, layer_indices, layer_kinds, mamba_config, require

MODEL_TYPES = ("bamba",)

_RULES = (
    *decoder_rules("final_layernorm", "pre_ff_layernorm"),
    (r"model\.layers\.(\d+)\.(?:mamba|self_attn)\.(.+)", r"layers.\1.mixer.\2"),
    (r"model\.layers\.(\d+)\.feed_forward\.(gate|up)_proj\.weight", r"layers.\1.ffn.\2.weight"),
    (r"model\.layers\.(\d+)\.feed_forward\.down_proj\.weight", r"layers.\1.ffn.down.weight"),
)


def config(raw: Any) -> tuple[HybridConfig, tuple[str, ...]]:
    """config.json -> ``(HybridConfig, notes)``."""
    d, n = raw.int("hidden_size"), raw.int("num_hidden_layers")
    require(raw.get("hidden_act", "silu"), ("silu",), "hidden_act")
    require(raw.get("mlp_bias", False), (False,), "mlp_bias")
    attn = layer_indices(raw, "attn_layer_indices", n)
    kinds = layer_kinds(["attention" if i in attn else "mamba" for i in range(n)], "attn_layer_indices", n)
    heads = raw.int("num_attention_heads")
    head_dim = d // heads
    rope = raw.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", 0.5) if isinstance(rope, dict) else 0.5
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"rope_parameters.partial_rotary_factor: expected a number in (0, 1], got {factor!r:.80}")
    cfg = HybridConfig(
        d_model=d, vocab_size=raw.int("vocab_size"), layers=tuple((k, "mlp") for k in kinds),
        mamba=mamba_config(raw, d, raw.float("rms_norm_eps", 1e-5)),
        attention=AttentionSpec(heads, raw.int("num_key_value_heads", heads), head_dim, head_dim ** -0.5,
                                rotary_dim=int(head_dim * factor), rope_theta=hub_rope(raw),
                                bias=raw.bool("attention_bias", False)),
        mlp=MLPSpec("silu", True), d_ff=raw.int("intermediate_size"), norm_eps=raw.float("rms_norm_eps", 1e-5),
        tie_embeddings=raw.bool("tie_word_embeddings", False), family="bamba")
    return cfg, ("Mamba mixer: rmsnorm(y * silu(z)) per group (transformers' BambaRMSNormGated)",)


def rename(tensors: dict[str, Any], cfg: HybridConfig, raw: Any = None) -> dict[str, Any]:
    """Checkpoint names -> core names, ``gate_proj`` and ``up_proj`` packed as ``ffn.up.weight [2f, d]``."""
    out = apply_rules(tensors, _RULES)
    for i in range(cfg.n_layer):
        gate, up = out.pop(f"layers.{i}.ffn.gate.weight", None), out.pop(f"layers.{i}.ffn.up.weight", None)
        if gate is not None and up is not None and gate[0].shape == up[0].shape:
            xp = namespace(gate_proj=gate[0], up_proj=up[0])  # host arrays, as read
            out[f"layers.{i}.ffn.up.weight"] = (xp.concat([gate[0], up[0]], axis=0), gate[1])  # [2f, d]
        elif gate is not None or up is not None:
            raise CheckpointError(f"model.layers.{i}.feed_forward: gate_proj and up_proj must both be present with "
                                  f"one shape")
    return out
