"""Pretrained checkpoint layouts (transformers, state-spaces/mamba_ssm) in portable_ssm's terms.

:func:`config_fields` maps either ``config.json`` to :class:`~portable_ssm.config.Mamba2Config`
fields and :func:`sanitize` fixes every checkpoint quirk (the ``backbone.`` prefix, the two
embedding names, tied heads, padded vocabularies, D's shape), naming the tensor as the checkpoint
spells it in every error. Files are read in :mod:`portable_ssm.io.pretrained`.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import Mamba2Config
from ..params import param_shapes
from .errors import CheckpointError

Tensors = dict[str, tuple[Any, str]]  # checkpoint name -> (host numpy array, stored dtype name)


def _floats(values: Any) -> tuple[float, ...]:
    """JSON numbers as floats, also transformers 5's ``{"__float__": "Infinity"}`` and ``"inf"`` strings."""
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in values)


def _transformers_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``Mamba2Config`` keys (with its defaults) -> ``portable_ssm.Mamba2Config`` fields."""
    d, expand = raw["hidden_size"], raw.get("expand", 2)
    heads, head_dim = raw.get("num_heads", 128), raw.get("head_dim", 64)
    if heads * head_dim != expand * d:
        raise CheckpointError(f"num_heads * head_dim = {heads * head_dim} must equal expand * hidden_size "
                              f"= {expand * d}")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act: only 'silu' is supported, got {raw['hidden_act']!r}")
    limit = raw.get("time_step_limit", (0.0, math.inf))
    return dict(d_model=d, n_layer=raw["num_hidden_layers"], d_state=raw.get("state_size", 128),
                d_conv=raw.get("conv_kernel", 4), expand=int(expand), headdim=head_dim,
                ngroups=raw.get("n_groups", 8), chunk_size=raw.get("chunk_size", 256),
                dt_min=raw.get("time_step_min", 0.001), dt_max=raw.get("time_step_max", 0.1),
                dt_init_floor=raw.get("time_step_floor", 1e-4), dt_limit=_floats(limit),
                bias=raw.get("use_bias", False), conv_bias=raw.get("use_conv_bias", True),
                norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                residual_in_fp32=raw.get("residual_in_fp32", True),
                tie_embeddings=raw.get("tie_word_embeddings", False),
                vocab_size=raw["vocab_size"], pad_vocab_size_multiple=1)


def _state_spaces_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """mamba_ssm's ``MambaConfig`` keys (with its defaults) -> ``portable_ssm.Mamba2Config`` fields."""
    ssm = dict(raw.get("ssm_cfg") or {})
    checks = [("ssm_cfg.layer", ssm.get("layer", "Mamba1"), "Mamba2"),  # mamba_ssm defaults to Mamba1
              ("d_intermediate", raw.get("d_intermediate", 0), 0),  # MLP blocks
              ("attn_layer_idx", raw.get("attn_layer_idx") or [], []),  # attention layers
              ("rms_norm", raw.get("rms_norm", True), True)]  # LayerNorm blocks
    for key, value, supported in checks:
        if value != supported:
            raise CheckpointError(f"{key}: portable_ssm supports only {supported!r}, got {value!r}")
    keys = ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min", "dt_max",
            "dt_init_floor", "dt_limit", "A_init_range", "bias", "conv_bias", "d_ssm", "rmsnorm",
            "norm_before_gate", "D_has_hdim")
    fields = {k: ssm[k] for k in keys if k in ssm}  # absent keys: Mamba2Config's defaults are mamba_ssm's
    for key in ("dt_limit", "A_init_range"):
        if key in fields:
            fields[key] = _floats(fields[key])
    return dict(fields, d_model=raw["d_model"], n_layer=raw["n_layer"], vocab_size=raw["vocab_size"],
                residual_in_fp32=raw.get("residual_in_fp32", True), norm_eps=raw.get("norm_epsilon", 1e-5),
                tie_embeddings=raw.get("tie_embeddings", True),
                pad_vocab_size_multiple=raw.get("pad_vocab_size_multiple", 8))


def _core_name(name: str) -> str:
    """A checkpoint's tensor name in core names: no ``backbone.`` prefix, one embedding name."""
    name = name[len("backbone."):] if name.startswith("backbone.") else name
    return "embedding.weight" if name == "embeddings.weight" else name


def config_fields(raw_config: dict[str, Any], where: str) -> dict[str, Any]:
    """Either ``config.json`` layout (transformers: ``hidden_size``; state-spaces: ``d_model``) as
    :class:`Mamba2Config` fields plus ``pad_vocab_size_multiple``; unsupported variants raise
    :class:`CheckpointError` naming the key."""
    try:
        return (_transformers_fields if "hidden_size" in raw_config else _state_spaces_fields)(raw_config)
    except KeyError as err:
        raise CheckpointError(f"{where}: config.json misses the key {err.args[0]!r}") from None
    except CheckpointError as err:
        raise CheckpointError(f"{where}: config.json: {err}") from None


def _D_per_channel(tensors: Tensors, config: Mamba2Config) -> Tensors:
    """Every layer's D as ``[h, p]``: mamba_ssm stores ``D_has_hdim``'s D flat, ``[h·p]``, and
    rearranges it ``(h p) -> h p`` in forward; a D of another size is left for the shape check."""
    h, p = config.nheads, config.headdim
    out = dict(tensors)
    for i in range(config.n_layer):
        key = f"layers.{i}.mixer.D"
        if key in out and tuple(out[key][0].shape) == (h * p,):
            value, stored = out[key]
            out[key] = (value.reshape(h, p), stored)  # [h·p] -> [h, p]
    return out


def sanitize(fields: dict[str, Any], tensors: Tensors, where: str) -> tuple[Mamba2Config, Tensors, int]:
    """The one place checkpoint quirks are fixed: ``(config, tensors in core names, real vocab size)``
    from :func:`config_fields` and the checkpoint's tensors.

    Strips ``backbone.``; reads both embedding names; drops ``lm_head.weight`` when tied; takes
    ``D_has_hdim`` from ``ssm_cfg`` (else from D's shape) and reads D flat ``[h·p]`` (mamba_ssm)
    or ``[h, p]`` alike; keeps the embedding's row count (vocab padded or not) as the
    logits' width. Errors name ``where`` and the tensor as the checkpoint spells it.
    """
    fields = dict(fields)
    renamed: Tensors = {}
    origin: dict[str, str] = {}
    for name, value in tensors.items():
        core = _core_name(name)
        if core in renamed:
            raise CheckpointError(f"{where}: tensors {origin[core]!r} and {name!r} are the same parameter")
        renamed[core], origin[core] = value, name
    if "embedding.weight" not in renamed:
        raise CheckpointError(f"{where}: tensor 'backbone.embeddings.weight' (or "
                              f"'backbone.embedding.weight') is missing")
    vocab, rows = fields["vocab_size"], renamed["embedding.weight"][0].shape[0]
    multiple = fields.pop("pad_vocab_size_multiple")
    if vocab > rows:
        raise CheckpointError(f"{where}: config vocab_size {vocab} exceeds the {rows} rows of "
                              f"{origin['embedding.weight']!r}")
    if -(-vocab // multiple) * multiple != rows:  # the rows are the padded vocabulary
        fields["vocab_size"], multiple = rows, 1
    if "D_has_hdim" not in fields:  # transformers' layout: D's shape says it
        D = renamed.get("layers.0.mixer.D")
        fields["D_has_hdim"] = D is not None and D[0].ndim == 2
    if fields["tie_embeddings"]:
        renamed.pop("lm_head.weight", None)
    try:
        config = Mamba2Config(**fields, pad_vocab_size_multiple=multiple)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: config.json: {err}") from None
    expected = param_shapes(config)
    if config.D_has_hdim:
        renamed = _D_per_channel(renamed, config)
    for key, shape in expected.items():
        if key not in renamed:
            spelled = key if key == "lm_head.weight" else f"backbone.{key}"
            raise CheckpointError(f"{where}: tensor {spelled!r} is missing")
        got = tuple(renamed[key][0].shape)
        if got != shape:
            raise CheckpointError(f"{where}: tensor {origin[key]!r} has shape {got}, expected {list(shape)} "
                                  f"for this config")
    extra = sorted(origin[k] for k in set(renamed) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} for this config")
    return config, {k: renamed[k] for k in expected}, vocab
