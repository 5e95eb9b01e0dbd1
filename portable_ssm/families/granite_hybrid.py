"""IBM Granite-4.0-H (transformers' ``GraniteMoeHybrid``): Mamba-2 (Bamba's mixer) and attention
layers, each followed by a shared SwiGLU MLP, plus top-k softmax-routed experts when
``num_local_experts > 0``. Attention scale ``attention_multiplier``; RoPE only with
``position_embedding_type == "rope"`` ("nope" otherwise); residual branches times
``residual_multiplier``, embeddings times ``embedding_multiplier``, logits over ``logits_scaling``.
"""

from __future__ import annotations

from typing import Any

from ..blocks import AttentionSpec, MLPSpec, MoESpec
from ..stack import HybridConfig
from ._common import apply_rules, decoder_rules, hub_rope, layer_kinds, mamba_config, require

MODEL_TYPES = ("granitemoehybrid",)

_RULES = (
    *decoder_rules("norm", "post_attention_layernorm"),
    (r"model\.layers\.(\d+)\.(?:mamba|self_attn)\.(.+)", r"layers.\1.mixer.\2"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.input_linear\.weight", r"layers.\1.ffn.experts.up.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.output_linear\.weight", r"layers.\1.ffn.experts.down.weight"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.router\.layer\.weight", r"layers.\1.ffn.router.weight"),
)


def config(raw: Any) -> tuple[HybridConfig, tuple[str, ...]]:
    """config.json -> ``(HybridConfig, notes)``."""
    d, n = raw.int("hidden_size"), raw.int("num_hidden_layers")
    require(raw.get("hidden_act", "silu"), ("silu",), "hidden_act")
    require(raw.get("position_embedding_type"), (None, "rope", "nope"), "position_embedding_type")
    kinds = layer_kinds(raw.get("layer_types", raw.get("layers_block_type")), "layer_types", n)
    heads = raw.int("num_attention_heads")
    head_dim = d // heads
    rotary = head_dim if raw.get("position_embedding_type") == "rope" else 0
    theta = hub_rope(raw) if rotary else 10000.0
    experts = raw.int("num_local_experts", 8)
    gated = MLPSpec("silu", True)
    moe = MoESpec(experts, raw.int("num_experts_per_tok", 2), "softmax", gated) if experts else None
    cfg = HybridConfig(
        d_model=d, vocab_size=raw.int("vocab_size"), layers=tuple((k, "moe" if experts else "mlp") for k in kinds),
        mamba=mamba_config(raw, d, raw.float("rms_norm_eps", 1e-6)),
        attention=AttentionSpec(heads, raw.int("num_key_value_heads", heads), head_dim,
                                raw.float("attention_multiplier", 1.0), rotary_dim=rotary, rope_theta=theta,
                                bias=raw.bool("attention_bias", False)),
        mlp=gated, moe=moe, shared_expert=bool(experts), d_ff=raw.int("shared_intermediate_size", 1024),
        d_expert=raw.int("intermediate_size", 11008), norm_eps=raw.float("rms_norm_eps", 1e-6),
        embedding_multiplier=raw.float("embedding_multiplier", 1.0),
        residual_multiplier=raw.float("residual_multiplier", 1.0), logits_scaling=raw.float("logits_scaling", 1.0),
        tie_embeddings=raw.bool("tie_word_embeddings", False), family="granitemoehybrid")
    return cfg, ("Mamba mixer: rmsnorm(y * silu(z)) per group (transformers' GraniteMoeHybridRMSNormGated)",)


def rename(tensors: dict[str, Any], cfg: HybridConfig, raw: Any = None) -> dict[str, Any]:
    """Checkpoint names -> core names; the shared MLP is ``ffn.up/down`` (dense) or ``ffn.shared.*`` (MoE)."""
    shared = "shared." if cfg.moe is not None else ""
    rules = _RULES + ((r"model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight", rf"layers.\1.ffn.{shared}up.weight"),
                      (r"model\.layers\.(\d+)\.shared_mlp\.output_linear\.weight",
                       rf"layers.\1.ffn.{shared}down.weight"))
    return apply_rules(tensors, rules)

