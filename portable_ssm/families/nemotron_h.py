"""NVIDIA Nemotron-H (transformers' ``NemotronH``): one block per layer — Mamba-2 (``M``),
attention without position encoding (``*``), a relu² MLP (``-``) or a MoE (``E``) — each behind
its own RMSNorm. The SSM width is ``mamba_num_heads · mamba_head_dim``; the gated norm runs per
group. The MoE router chooses by ``sigmoid + e_score_correction_bias`` and weighs by the raw
sigmoid (renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``); a shared
relu² expert is added. Experts are stored one 2-D tensor each and stacked here.
"""

from __future__ import annotations

import re
from typing import Any

from .._array import namespace
from ..blocks import AttentionSpec, MLPSpec, MoESpec
from ..io.errors import CheckpointError
from ..stack import HybridConfig
from ._common import apply_rules, mamba_config_fields, require

MODEL_TYPES = ("nemotron_h",)
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_KINDS = {"linear_attention": ("mamba", None), "mamba": ("mamba", None), "full_attention": ("attention", None),
          "attention": ("attention", None), "mlp": (None, "mlp"), "moe": (None, "moe")}

_RULES = (
    (r"backbone\.embeddings\.weight", "embedding.weight"),
    (r"backbone\.norm_f\.weight", "norm_f.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"backbone\.layers\.(\d+)\.norm\.weight", r"layers.\1.NORM"),
    (r"backbone\.layers\.(\d+)\.mixer\.gate\.weight", r"layers.\1.ffn.router.weight"),
    (r"backbone\.layers\.(\d+)\.mixer\.gate\.e_score_correction_bias", r"layers.\1.ffn.router.bias"),
    (r"backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(up|down)_proj\.weight", r"layers.\1.ffn.experts.\2.\3"),
    (r"backbone\.layers\.(\d+)\.mixer\.shared_experts\.(up|down)_proj\.weight", r"layers.\1.ffn.shared.\2.weight"),
    (r"backbone\.layers\.(\d+)\.mixer\.(.+)", r"layers.\1.mixer.\2"),
)


def _kinds(raw: Any) -> list[tuple[str | None, str | None]]:
    """``layers_block_type`` (transformers 5) or the Hub's ``hybrid_override_pattern`` string."""
    listed, pattern = raw.get("layers_block_type", raw.get("layer_types")), raw.get("hybrid_override_pattern")
    if listed is None and isinstance(pattern, str) and pattern and all(ch in _PATTERN for ch in pattern):
        listed = [_PATTERN[ch] for ch in pattern]
    if not isinstance(listed, list) or not listed or any(not isinstance(k, str) or k not in _KINDS for k in listed):
        raise CheckpointError(f"layers_block_type: expected a list of {sorted(_KINDS)} (or hybrid_override_pattern "
                              f"of {''.join(_PATTERN)}), got {listed if listed is not None else pattern!r:.200}")
    return [_KINDS[k] for k in listed]


def config(raw: Any) -> tuple[HybridConfig, tuple[str, ...]]:
    """config.json -> ``(HybridConfig, notes)``."""
    d = raw.int("hidden_size")
    kinds = _kinds(raw)
    for key, supported in (("mamba_hidden_act", ("silu",)), ("mlp_hidden_act", ("relu2",)), ("mlp_bias", (False,)),
                           ("attention_bias", (False,)), ("moe_latent_size", (None,)), ("sliding_window", (None,)),
                           ("num_nextn_predict_layers", (0,))):
        require(raw.get(key, supported[0]), supported, key)
    n_group, topk_group = raw.int("n_group", 1), raw.int("topk_group", 1)
    if n_group != topk_group:
        raise CheckpointError(f"n_group: grouped expert routing (n_group {n_group}, topk_group {topk_group}) is not "
                              f"supported; only n_group == topk_group (every group eligible)")
    width = raw.int("mamba_num_heads", 128) * raw.int("mamba_head_dim", 64)
    mamba = mamba_config_fields(width, raw.float("layer_norm_epsilon", 1e-5),
                                headdim=raw.int("mamba_head_dim", 64), d_state=raw.int("ssm_state_size", 128),
                                d_conv=raw.int("conv_kernel", 4), ngroups=raw.int("n_groups", 8),
                                chunk_size=raw.int("chunk_size", 128),
                                dt_limit=raw.pair("time_step_limit", (0.0, float("inf"))),
                                conv_bias=raw.bool("use_conv_bias", True), bias=raw.bool("use_bias", False))
    plain = MLPSpec("relu2", False)
    moe = None
    if any(f == "moe" for _, f in kinds):
        moe = MoESpec(raw.int("n_routed_experts", 8), raw.int("num_experts_per_tok", 2), "sigmoid", plain,
                      normalize=raw.bool("norm_topk_prob", True), scale=raw.float("routed_scaling_factor", 1.0))
    heads = raw.int("num_attention_heads", 32)
    cfg = HybridConfig(
        d_model=d, vocab_size=raw.int("vocab_size"), layers=tuple(kinds), mamba=mamba,
        attention=AttentionSpec(heads, raw.int("num_key_value_heads", 8), raw.int("head_dim", 128),
                                raw.int("head_dim", 128) ** -0.5),
        mlp=plain, moe=moe, shared_expert=moe is not None, d_ff=raw.int("intermediate_size", 21504),
        d_expert=raw.int("moe_intermediate_size", 7688), d_shared=raw.int("moe_shared_expert_intermediate_size", 7688),
        norm_eps=raw.float("layer_norm_epsilon", 1e-5), tie_embeddings=raw.bool("tie_word_embeddings", False),
        family="nemotron_h")
    return cfg, ("Mamba mixer: rmsnorm(y * silu(z)) per group of mamba_num_heads*mamba_head_dim/n_groups channels "
                 "(transformers' NemotronHRMSNormGated)",)


def rename(tensors: dict[str, Any], cfg: HybridConfig, raw: Any = None) -> dict[str, Any]:
    """Checkpoint names -> core names: each layer's one norm goes to its block, experts are stacked."""
    out = apply_rules(tensors, _RULES)
    for i, (mix, ffn) in enumerate(cfg.layers):
        norm = out.pop(f"layers.{i}.NORM", None)
        if norm is not None:
            out[f"layers.{i}.{'mixer' if mix else 'ffn'}_norm.weight"] = norm
        for part in ("up", "down") if ffn == "mlp" else ():  # an MLP layer's block is its "mixer"
            if f"layers.{i}.mixer.{part}_proj.weight" in out:
                out[f"layers.{i}.ffn.{part}.weight"] = out.pop(f"layers.{i}.mixer.{part}_proj.weight")
        for part in ("up", "down"):
            found = {int(m.group(1)): k for k in out if (m := re.fullmatch(rf"layers\.{i}\.ffn\.experts\.(\d+)\.{part}",
                                                                          k))}
            if not found:
                continue
            if sorted(found) != list(range(len(found))):
                raise CheckpointError(f"backbone.layers.{i}.mixer.experts: expert {part}_proj tensors are numbered "
                                      f"{sorted(found)[:8]}..., expected 0..{len(found) - 1}")
            arrays = [out.pop(found[e]) for e in range(len(found))]
            if len({tuple(a[0].shape) for a in arrays}) != 1:
                raise CheckpointError(f"backbone.layers.{i}.mixer.experts: {part}_proj tensors differ in shape")
            xp = namespace(expert=arrays[0][0])  # host arrays, as read
            out[f"layers.{i}.ffn.experts.{part}.weight"] = (xp.stack([a[0] for a in arrays]), arrays[0][1])  # [E, ...]
    return out
