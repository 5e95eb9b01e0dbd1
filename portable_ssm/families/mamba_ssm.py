"""state-spaces mamba_ssm hybrids (``MambaLMHeadModel`` with ``attn_layer_idx`` or
``d_intermediate``): layer i is mamba_ssm's ``MHA`` (``attn_cfg``) when i is in
``attn_layer_idx``, else ``Mamba2`` (``ssm_cfg``, read as the pure Mamba-2 loader reads it); with
``d_intermediate > 0`` every layer also has ``norm2`` and a ``GatedMLP`` whose hidden size is
``d_intermediate`` rounded up to a multiple of 128.

Weights: MHA's ``in_proj [(h + 2·kv)·hd, d]`` packs q, k, v (split here) and ``out_proj`` is
o_proj; RoPE (flash_attn's, not interleaved) on the first ``rotary_emb_dim`` channels; fc1
``[2f, d]`` packs ``[y; gate]`` for ``fc2(y · silu(gate))`` (swapped here into the stack's
``[gate; up]``). With ``attn_cfg.d_conv = k > 0`` MHA's ``conv1d [(h + 2·kv)·hd, 1, k]`` (and
its bias) is a depthwise causal conv, no activation, over the packed projections before the q/k/v
split and RoPE (``AttentionSpec.conv``). With ``attn_cfg.mlp_dim`` (rounded up to a multiple of
256) that many more rows of ``in_proj`` are ``[up; gate]`` of an MLP beside the heads (no conv on
them), whose ``up · silu(gate)`` ``out_proj`` reads after the heads (``AttentionSpec.mlp``, split
here as ``mlp_in``). The conv follows MHA's ``forward`` (the model's definition): mamba_ssm's
own cached decoding stores the prompt's conv *outputs* as the conv state where its one-token step
reads *inputs*, so its first d_conv - 1 decoded steps (and through the KV cache every later one)
differ from its forward; here a prefill plus one-token steps give the forward's logits (the
loader's note says so). The Mamba-2 gated norm's eps is 1e-5 whatever
``norm_epsilon`` (mamba_ssm fixes it). The vocabulary is padded to ``pad_vocab_size_multiple``
rows; generation never picks a padding row. The config has no ``model_type``:
:func:`portable_ssm.io.layouts.is_state_spaces_hybrid` routes it here; the pure Mamba-2 layout
(no attention, no MLP) stays with the whole-model stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._array import namespace
from ..blocks import AttentionSpec, MLPSpec
from ..config import Mamba2Config
from ..io.errors import CheckpointError
from ..io.layouts import D_per_channel, state_spaces_fields
from ..stack import HybridConfig
from ._common import apply_rules, layer_indices, require

MODEL_TYPES: tuple[str, ...] = ()  # routed by the config's keys, not by a model_type
MULTIPLE_OF = 128  # GatedMLP's multiple_of: the hidden size d_intermediate is rounded up to
GATED_NORM_EPS = 1e-5  # Mamba2's RMSNormGated(eps=1e-5)
MLP_DIM_MULTIPLE = 256  # MHA rounds mlp_dim (in_proj's [up; gate] rows) up to a multiple of it

#: MHA's keyword arguments (mamba_ssm.modules.mha.MHA); any other key in attn_cfg is refused.
_ATTN_KEYS = ("num_heads", "num_heads_kv", "head_dim", "mlp_dim", "qkv_proj_bias", "out_proj_bias", "softmax_scale",
              "causal", "d_conv", "rotary_emb_dim", "rotary_emb_base", "rotary_emb_interleaved")

_RULES = (
    (r"backbone\.embeddings?\.weight", "embedding.weight"),
    (r"backbone\.norm_f\.weight", "norm_f.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"backbone\.layers\.(\d+)\.norm\.weight", r"layers.\1.mixer_norm.weight"),
    (r"backbone\.layers\.(\d+)\.norm2\.weight", r"layers.\1.ffn_norm.weight"),
    (r"backbone\.layers\.(\d+)\.mlp\.fc1\.weight", r"layers.\1.FC1"),
    (r"backbone\.layers\.(\d+)\.mlp\.fc2\.weight", r"layers.\1.ffn.down.weight"),
    (r"backbone\.layers\.(\d+)\.mixer\.(.+)", r"layers.\1.mixer.\2"),
)


def _whole(raw: Any) -> Mamba2Config:
    """The Mamba-2 fields as the pure loader reads them (``ssm_cfg``, ``norm_epsilon``,
    ``vocab_size``, ...) as one Mamba2Config of the whole model; its ValueError as a CheckpointError."""
    try:
        return Mamba2Config(**state_spaces_fields(raw, hybrid=True))
    except (ValueError, TypeError) as err:
        raise CheckpointError(str(err)) from None


def _attention(raw: Any, d: int) -> AttentionSpec:
    """``attn_cfg`` -> AttentionSpec with MHA's defaults (biases on, scale hd^-0.5; causal
    defaults to False in MHA, so a config must say ``"causal": true``)."""
    a = raw.object("attn_cfg")
    unknown = sorted(k for k in a.raw if k not in _ATTN_KEYS)
    if unknown:
        raise CheckpointError(f"attn_cfg.{unknown[0]:.80}: not an argument of mamba_ssm's MHA")
    for key, supported, default in (("rotary_emb_interleaved", False, False), ("causal", True, False)):
        require(a.get(key, default), (supported,), f"attn_cfg.{key}")
    conv = a.int("d_conv", 0)
    if conv < 0 or conv == 1:  # MHA's own conv path cuts d_conv - 1 = 0 steps: an empty output
        raise CheckpointError(f"attn_cfg.d_conv: expected 0 (no conv) or an int >= 2, got {conv}")
    mlp_dim = a.int("mlp_dim", 0)
    if mlp_dim < 0:
        raise CheckpointError(f"attn_cfg.mlp_dim: expected an int >= 0, got {mlp_dim}")
    heads = a.int("num_heads")
    if heads <= 0:
        raise CheckpointError(f"attn_cfg.num_heads: expected a positive int, got {heads}")
    kv = a.int("num_heads_kv") if a.get("num_heads_kv") is not None else heads
    if kv <= 0 or heads % kv:
        raise CheckpointError(f"attn_cfg.num_heads_kv: expected a positive divisor of num_heads = {heads}, got {kv}")
    if a.get("head_dim") is None and d % heads:
        raise CheckpointError(f"attn_cfg.num_heads: d_model = {d} must be a multiple of it without head_dim, got "
                              f"{heads}")
    hd = a.int("head_dim") if a.get("head_dim") is not None else d // heads
    if hd <= 0:
        raise CheckpointError(f"attn_cfg.head_dim: expected a positive int, got {hd}")
    rotary = a.int("rotary_emb_dim", 0)
    if not (0 <= rotary <= hd and rotary % 2 == 0):
        raise CheckpointError(f"attn_cfg.rotary_emb_dim: expected an even int in [0, head_dim = {hd}], got {rotary}")
    scale = a.float("softmax_scale") if a.get("softmax_scale") is not None else hd ** -0.5
    base = a.float("rotary_emb_base", 10000.0)
    for key, value in (("softmax_scale", scale), ("rotary_emb_base", base)):
        if not value > 0:
            raise CheckpointError(f"attn_cfg.{key}: expected a positive number, got {value}")
    return AttentionSpec(heads, kv, hd, scale, rotary_dim=rotary, rope_theta=base,
                         bias=a.bool("qkv_proj_bias", True), out_bias=a.bool("out_proj_bias", True), conv=conv,
                         mlp=-(-mlp_dim // MLP_DIM_MULTIPLE) * MLP_DIM_MULTIPLE // 2)


def _d_ff(raw: Any) -> int:
    """GatedMLP's hidden size: ``d_intermediate`` rounded up to a multiple of 128 (0: no MLP)."""
    f = raw.int("d_intermediate", 0)
    if f < 0:
        raise CheckpointError(f"d_intermediate: expected an int >= 0, got {f}")
    return -(-f // MULTIPLE_OF) * MULTIPLE_OF


def config(raw: Any) -> tuple[HybridConfig, tuple[str, ...]]:
    """config.json -> ``(HybridConfig, notes)``."""
    require(raw.get("bidirectional", False), (False,), "bidirectional")  # MambaLMHeadModel's two-way variant
    whole = _whole(raw)
    if whole.d_mlp:
        raise CheckpointError(f"ssm_cfg.d_ssm: only None or d_inner = {whole.d_inner} is supported in a hybrid (no "
                              f"gated MLP beside the SSM), got {whole.ssm_dim}")
    d, f = whole.d_model, _d_ff(raw)
    attn = layer_indices(raw, "attn_layer_idx", whole.n_layer)
    mamba = dataclasses.replace(whole, d_model=whole.d_inner, expand=1, n_layer=1, vocab_size=None,
                                norm_eps=GATED_NORM_EPS)
    cfg = HybridConfig(
        d_model=d, vocab_size=whole.padded_vocab_size,
        layers=tuple(("attention" if i in attn else "mamba", "mlp" if f else None) for i in range(whole.n_layer)),
        mamba=mamba, attention=_attention(raw, d) if attn else None, mlp=MLPSpec("silu", True) if f else None,
        d_ff=f, norm_eps=whole.norm_eps, tie_embeddings=whole.tie_embeddings, family="mamba_ssm")
    gate = ("y * silu(z), no norm (ssm_cfg.rmsnorm false)" if not mamba.rmsnorm else
            "rmsnorm(y) * silu(z) per group" if mamba.norm_before_gate else "rmsnorm(y * silu(z)) per group")
    notes = (f"Mamba mixer: {gate}, eps 1e-5 (mamba_ssm's RMSNormGated)",)
    if cfg.attention is not None and cfg.attention.conv:
        notes += (f"attention conv: d_conv {cfg.attention.conv} over packed q/k/v, as MHA's forward; cached steps "
                  f"equal it (mamba_ssm's own cached decoding keeps conv outputs as its state and does not)",)
    return cfg, notes


def vocab_size(raw: Any) -> int:
    """The real vocabulary (``config.vocab_size``); the head has it padded to the multiple."""
    return raw.int("vocab_size")


def _split(value: tuple[Any, str], rows: list[int], name: str, why: str) -> list[tuple[Any, str]]:
    """A packed tensor cut along its first axis into ``rows``; CheckpointError naming it otherwise."""
    array, stored = value
    if array.ndim == 0 or array.shape[0] != sum(rows):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {sum(rows)} rows "
                              f"({why}) for this config")
    starts = [sum(rows[:j]) for j in range(len(rows))]
    return [(array[s:s + r], stored) for s, r in zip(starts, rows)]


def rename(tensors: dict[str, Any], cfg: HybridConfig, raw: Any = None) -> dict[str, Any]:
    """Checkpoint names -> core names: MHA's in_proj split into q/k/v, out_proj as o_proj, fc1's
    ``[y; gate]`` as ``ffn.up.weight [gate; y]``, D flat ``[h·p]`` as ``[h, p]`` (D_has_hdim)."""
    out = apply_rules(tensors, _RULES)
    a = cfg.attention
    for i, (mix, _) in enumerate(cfg.layers):
        pre = f"layers.{i}.mixer."
        if mix == "attention":
            q, kv, m = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, 2 * a.mlp
            rows, names = [q, kv, kv] + ([m] if m else []), ["q_proj", "k_proj", "v_proj", "mlp_in"]
            why = f"q {q} + k {kv} + v {kv}" + (f" + mlp {m}: mlp_dim rounded up to a multiple of "
                                                f"{MLP_DIM_MULTIPLE}" if m else "")
            for leaf in ("weight", "bias"):
                if pre + f"in_proj.{leaf}" in out:
                    parts = _split(out.pop(pre + f"in_proj.{leaf}"), rows, f"backbone.layers.{i}.mixer.in_proj.{leaf}",
                                   why)
                    out.update({f"{pre}{name}.{leaf}": v for name, v in zip(names, parts)})
                if pre + f"out_proj.{leaf}" in out:
                    out[pre + f"o_proj.{leaf}"] = out.pop(pre + f"out_proj.{leaf}")
        if f"layers.{i}.FC1" in out:
            f = cfg.d_ff
            if not f:
                raise CheckpointError(f"unexpected tensor 'backbone.layers.{i}.mlp.fc1.weight': d_intermediate is 0")
            y, gate = _split(out.pop(f"layers.{i}.FC1"), [f, f], f"backbone.layers.{i}.mlp.fc1.weight",
                             f"2 x {f}: d_intermediate rounded up to a multiple of {MULTIPLE_OF}")
            xp = namespace(fc1=y[0])  # host arrays, as read
            out[f"layers.{i}.ffn.up.weight"] = (xp.concat([gate[0], y[0]], axis=0), y[1])  # [2f, d]: [gate; y]
    if cfg.mamba.D_has_hdim:
        out = D_per_channel(out, dataclasses.replace(cfg.mamba, n_layer=cfg.n_layer))
    return out
