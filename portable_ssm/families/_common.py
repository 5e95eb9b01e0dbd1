"""Helpers every family module shares: renaming rules, layer kinds, supported-value checks, the
RoPE and Mamba-2 keys the Bamba-derived configs spell alike."""

from __future__ import annotations

import re
from typing import Any

from ..config import Mamba2Config
from ..io.errors import CheckpointError

Tensors = dict[str, tuple[Any, str]]


def decoder_rules(final_norm: str, ffn_norm: str) -> tuple[tuple[str, str], ...]:
    """The names a transformers decoder's checkpoint shares with its kin: the embedding, the final
    norm (``model.<final_norm>``), the head and each layer's two norms (``input_layernorm``, then
    ``<ffn_norm>`` before the feed-forward)."""
    return ((r"model\.embed_tokens\.weight", "embedding.weight"),
            (rf"model\.{final_norm}\.weight", "norm_f.weight"),
            (r"lm_head\.weight", "lm_head.weight"),
            (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.mixer_norm.weight"),
            (rf"model\.layers\.(\d+)\.{ffn_norm}\.weight", r"layers.\1.ffn_norm.weight"))


def apply_rules(tensors: Tensors, rules: tuple[tuple[str, str], ...]) -> Tensors:
    """Renames every tensor by the first matching ``(regex, replacement)``; CheckpointError naming
    an unknown tensor or two names landing on one core name."""
    out: Tensors = {}
    origin: dict[str, str] = {}
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]
    for name, value in tensors.items():
        for pattern, repl in compiled:
            if pattern.fullmatch(name):
                core = pattern.sub(repl, name)
                break
        else:
            raise CheckpointError(f"unexpected tensor {name!r} for this family")
        if core in out:
            raise CheckpointError(f"tensors {origin[core]!r} and {name!r} are the same parameter")
        out[core], origin[core] = value, name
    return out


def layer_kinds(raw: Any, key: str, n_layer: int) -> list[str]:
    """``layer_types`` as ``"mamba" | "attention"`` per layer, reading transformers 5's names
    (``linear_attention``, ``full_attention``) and the Hub's (``mamba``, ``attention``)."""
    names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
    if not isinstance(raw, list) or len(raw) != n_layer or any(not isinstance(k, str) or k not in names for k in raw):
        raise CheckpointError(f"{key}: expected a list of {n_layer} layer kinds from {sorted(names)}, got {raw!r:.200}")
    return [names[k] for k in raw]


def layer_indices(raw: Any, key: str, n_layer: int) -> set[int]:
    """The layer indices listed under ``key`` (absent or null: none); CheckpointError naming it
    unless every entry is an int (not a bool) below ``n_layer``."""
    idx = raw.get(key) or []
    if not isinstance(idx, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layer
                                        for i in idx):
        raise CheckpointError(f"{key}: expected a list of layer indices below {n_layer} (the layer count), "
                              f"got {idx!r:.80}")
    return set(idx)


def require(value: Any, supported: tuple[Any, ...], key: str) -> None:
    """CheckpointError naming ``key`` unless ``value`` is one of ``supported``."""
    if not any(type(value) is type(s) and value == s for s in supported):
        wanted = " or ".join(map(repr, supported))
        raise CheckpointError(f"{key}: portable_ssm supports {wanted} here, got {value!r:.80}")


def hub_rope(raw: Any, key: str = "rope_parameters") -> float:
    """``rope_theta`` from transformers 5's ``rope_parameters`` or the Hub's top-level key; any
    RoPE scaling (``rope_type`` other than default, a ``rope_scaling`` object) is refused by name."""
    params = raw.get(key)
    if params is not None:
        if not isinstance(params, dict):
            raise CheckpointError(f"{key}: expected a JSON object, got {params!r:.80}")
        require(params.get("rope_type", "default"), ("default",), f"{key}.rope_type")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        require(raw.get("rope_scaling"), (None,), "rope_scaling")
        theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(f"{key}.rope_theta: expected a positive number, got {theta!r:.80}")
    return float(theta)


def mamba_config(raw: Any, d_model: int, eps: float) -> Mamba2Config:
    """The ``mamba_*`` keys of Bamba-derived configs (Bamba, Granite-4.0-H) as one layer's
    :class:`Mamba2Config`; ``mamba_n_heads · mamba_d_head`` must be ``mamba_expand · hidden_size``."""
    expand, heads = raw.int("mamba_expand", 2), raw.int("mamba_n_heads", 128)
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = expand * d_model // heads if head_dim == "auto" else raw.int("mamba_d_head")
    if heads * head_dim != expand * d_model:
        raise CheckpointError(f"mamba_n_heads: mamba_n_heads * mamba_d_head = {heads * head_dim} must equal "
                              f"mamba_expand * hidden_size = {expand * d_model}")
    return mamba_config_fields(heads * head_dim, eps, d_state=raw.int("mamba_d_state", 256),
                               d_conv=raw.int("mamba_d_conv", 4), headdim=head_dim,
                               ngroups=raw.int("mamba_n_groups", 1),
                               chunk_size=raw.int("mamba_chunk_size", 256),
                               dt_limit=raw.pair("time_step_limit", (0.0, float("inf"))),
                               conv_bias=raw.bool("mamba_conv_bias", True), bias=raw.bool("mamba_proj_bias", False))


def mamba_config_fields(width: int, eps: float, **fields: Any) -> Mamba2Config:
    """One Mamba layer's :class:`Mamba2Config` as :class:`~portable_ssm.stack.HybridConfig` wants
    it: ``d_model`` = the SSM ``width`` (heads · head_dim), ``expand`` 1, ``n_layer`` 1, no
    vocabulary, the gated norm's ``eps``; its ValueError (the field named) as a CheckpointError."""
    try:
        return Mamba2Config(d_model=width, expand=1, n_layer=1, norm_eps=eps, vocab_size=None, **fields)
    except (ValueError, TypeError) as err:
        raise CheckpointError(str(err)) from None
