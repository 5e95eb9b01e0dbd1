"""Zyphra Zamba2 (transformers' ``Zamba2``): Mamba-2 layers; a "hybrid" layer first runs a shared
transformer block on ``concat(hidden, token embeddings)`` and adds its output, through a
per-layer linear, to the Mamba layer's input (not to the residual).

``num_mem_blocks`` blocks are shared round-robin (``block_id`` = the hybrid layer's count mod
``num_mem_blocks``); the checkpoint stores each block once, under the first layer using it, with
per-call LoRA adapters (the k-th hybrid layer's under list index k). Each hybrid layer gets its
block's weights with its adapters folded in (``W + B·A``, once at load: more memory than sharing,
the same result up to rounding). Attention scale ``(head_dim/2)^-0.5``; the Mamba gated norm's
eps is 1e-5 whatever ``rms_norm_eps``; Δ is clamped at ``time_step_min`` in the prefill scan but
not in the one-token step, as transformers does (``HybridConfig.mamba_step``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._array import namespace
from ..blocks import AttentionSpec, MLPSpec
from ..io.errors import CheckpointError
from ..stack import HybridConfig
from ._common import apply_rules, hub_rope, mamba_config_fields, require

MODEL_TYPES = ("zamba2",)

_RULES = (
    (r"model\.embed_tokens\.weight", "embedding.weight"),
    (r"model\.final_layernorm\.weight", "norm_f.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"model\.layers\.(\d+)\.(?:mamba_decoder\.)?input_layernorm\.weight", r"layers.\1.mixer_norm.weight"),
    (r"model\.layers\.(\d+)\.(?:mamba_decoder\.)?mamba\.(.+)", r"layers.\1.mixer.\2"),
    (r"model\.layers\.(\d+)\.linear\.weight", r"layers.\1.shared.linear.weight"),
    (r"model\.layers\.(\d+)\.shared_transformer\.(.+)", r"BLOCK.\1.\2"),
)
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "pre_ff_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attention.q_proj.weight", "self_attn.k_proj.weight": "attention.k_proj.weight",
          "self_attn.v_proj.weight": "attention.v_proj.weight", "self_attn.o_proj.weight": "attention.o_proj.weight",
          "feed_forward.gate_up_proj.weight": "ffn.up.weight", "feed_forward.down_proj.weight": "ffn.down.weight"}
_ADAPTED = {"self_attn.q_proj.weight": "self_attn.linear_q_adapter_list", "self_attn.k_proj.weight":
            "self_attn.linear_k_adapter_list", "self_attn.v_proj.weight": "self_attn.linear_v_adapter_list",
            "feed_forward.gate_up_proj.weight": "feed_forward.gate_up_proj_adapter_list"}


def _kinds(raw: Any, n: int) -> list[str]:
    names = {"mamba": "mamba", "linear_attention": "mamba", "m": "mamba", "hybrid": "shared", "g": "shared"}
    listed = raw.get("layers_block_type")
    if not isinstance(listed, list) or len(listed) != n or any(not isinstance(k, str) or k not in names
                                                                 for k in listed):
        raise CheckpointError(f"layers_block_type: expected {n} kinds from {sorted(names)}, got {listed!r:.200}")
    return [names[k] for k in listed]


def config(raw: Any) -> tuple[HybridConfig, tuple[str, ...]]:
    """config.json -> ``(HybridConfig, notes)``."""
    d, n = raw.int("hidden_size"), raw.int("num_hidden_layers")
    for key, supported in (("hidden_act", ("gelu", "silu", "gelu_pytorch_tanh")), ("add_bias_linear", (False,)),
                           ("use_long_context", (False,)), ("use_conv_bias", (True,))):
        require(raw.get(key, supported[0]), supported, key)
    kinds = _kinds(raw, n)
    raw.int("num_mem_blocks", 1)
    width = raw.int("mamba_expand", 2) * d
    heads_ssm = raw.int("n_mamba_heads", 8)
    if width % heads_ssm:
        raise CheckpointError(f"n_mamba_heads: mamba_expand * hidden_size = {width} must be a multiple of it")
    t_min = raw.float("time_step_min", 0.001)
    mamba = mamba_config_fields(width, 1e-5, headdim=width // heads_ssm, d_state=raw.int("mamba_d_state", 64),
                                d_conv=raw.int("mamba_d_conv", 4), ngroups=raw.int("mamba_ngroups", 1),
                                chunk_size=raw.int("chunk_size", 256), dt_limit=(t_min, float("inf")))
    heads = raw.int("num_attention_heads", 32)
    head_dim = 2 * d // heads
    rotary = head_dim if raw.bool("use_mem_rope", False) else 0
    cfg = HybridConfig(
        d_model=d, vocab_size=raw.int("vocab_size"), layers=tuple((k, None) for k in kinds), mamba=mamba,
        mamba_step=dataclasses.replace(mamba, dt_limit=(0.0, float("inf"))),
        attention=AttentionSpec(heads, raw.int("num_key_value_heads", heads), head_dim, (head_dim / 2) ** -0.5,
                                rotary_dim=rotary, rope_theta=hub_rope(raw) if rotary else 10000.0),
        mlp=MLPSpec(raw.get("hidden_act", "gelu"), True), d_ff=raw.int("intermediate_size", 4 * d),
        norm_eps=raw.float("rms_norm_eps", 1e-5), tie_embeddings=raw.bool("tie_word_embeddings", True),
        family="zamba2")
    return cfg, ("Mamba mixer: rmsnorm(y * silu(z)) per group, eps 1e-5 (transformers' Zamba2RMSNormGated)",
                 "shared blocks copied per hybrid layer with their LoRA adapters folded in",
                 "dt clamped at time_step_min in prefill, not in one-token steps (as transformers)")


def rename(tensors: dict[str, Any], cfg: HybridConfig, raw: Any) -> dict[str, Any]:
    """Checkpoint names -> core names; each hybrid layer gets its block's weights, adapters folded."""
    out = apply_rules(tensors, _RULES)
    hybrid = [i for i, (m, _) in enumerate(cfg.layers) if m == "shared"]
    blocks = raw.int("num_mem_blocks", 1)
    for k, layer in enumerate(hybrid):
        owner = hybrid[k % blocks]  # the first layer of this block id stores the block
        for leaf, core in _BLOCK.items():
            name = f"BLOCK.{owner}.{leaf}"
            if name not in out:
                raise CheckpointError(f"tensor 'model.layers.{owner}.shared_transformer.{leaf}' is missing")
            weight, stored = out[name]
            if leaf in _ADAPTED and f"BLOCK.{owner}.{_ADAPTED[leaf]}.{k}.0.weight" in out:
                down = out[f"BLOCK.{owner}.{_ADAPTED[leaf]}.{k}.0.weight"][0]  # [r, in]
                up = out[f"BLOCK.{owner}.{_ADAPTED[leaf]}.{k}.1.weight"][0]  # [out, r]
                weight = weight + namespace(adapter=up).matmul(up, down)
            out[f"layers.{layer}.shared.{core}"] = (weight, stored)
    for name in [n for n in out if n.startswith("BLOCK.")]:  # every block tensor read, adapters included
        owner, leaf = name.split(".", 2)[1:]
        known = leaf in _BLOCK or any(leaf.startswith(a + ".") for a in _ADAPTED.values())
        if not known or int(owner) not in hybrid:
            raise CheckpointError(f"unexpected tensor 'model.layers.{owner}.shared_transformer.{leaf}' for this family")
        del out[name]
    return out
