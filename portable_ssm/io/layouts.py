"""Pretrained checkpoint layouts (transformers, state-spaces/mamba_ssm) in portable_ssm's terms.

:func:`config_fields` maps either ``config.json`` to :class:`~portable_ssm.config.Mamba2Config`
fields and :func:`sanitize` fixes every checkpoint quirk (the ``backbone.`` prefix, the two
embedding names, tied heads, padded vocabularies, D's shape), naming the tensor as the checkpoint
spells it in every error. Files are read in :mod:`portable_ssm.io.pretrained`.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import replace
from typing import Any

from ..config import Mamba2Config
from ..params import param_shapes
from .errors import CheckpointError

Tensors = dict[str, tuple[Any, str]]  # checkpoint name -> (host numpy array, stored dtype name)


_REQUIRED = object()
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def shown(value: Any) -> str:
    """``repr(value)`` cut short: a hostile file's values are quoted in errors, never at length."""
    return _REPR.repr(value)


class _Keys:
    """One JSON object of ``config.json`` read key by key, each value type-checked: ints are ints
    (not bools, floats or strings), floats are numbers, finite where it matters. Errors are
    :class:`CheckpointError` naming the key (``prefix`` spells nested objects: ``ssm_cfg.``)."""

    def __init__(self, raw: Any, prefix: str = "") -> None:
        if not isinstance(raw, dict):
            where = f"{prefix[:-1]}: expected" if prefix else "expected"
            raise CheckpointError(f"{where} a JSON object, got {type(raw).__name__}")
        self.raw, self.prefix = raw, prefix

    def _value(self, key: str, default: Any) -> Any:
        if key not in self.raw:
            if default is _REQUIRED:
                raise CheckpointError(f"misses the key {self.prefix + key!r}")
            return default
        return self.raw[key]

    def _wrong(self, key: str, expected: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{self.prefix + key}: expected {expected}, got {shown(value)}")

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value (for keys compared against the one supported value)."""
        return self._value(key, default)

    def int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an int", value)
        return value

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._wrong(key, "a finite number", value)
        return float(value)

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false", value)
        return value

    def pair(self, key: str, default: Any = _REQUIRED) -> tuple[float, float]:
        """Two numbers; also transformers 5's ``{"__float__": "Infinity"}`` and ``"inf"`` strings."""
        value = self._value(key, default)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise self._wrong(key, "a list of two numbers", value)
        out = []
        for v in value:
            v = v.get("__float__") if isinstance(v, dict) and len(v) == 1 else v
            if isinstance(v, str) and v.strip().lower().lstrip("+") in ("inf", "infinity"):
                v = math.inf
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise self._wrong(key, "a list of two numbers", value)
            out.append(float(v))
        return out[0], out[1]

    def object(self, key: str) -> _Keys:
        """A nested object (absent or null: empty)."""
        value = self._value(key, None)
        return _Keys({} if value is None else value, f"{self.prefix}{key}.")


def _transformers_fields(raw: _Keys) -> dict[str, Any]:
    """transformers' ``Mamba2Config`` keys (with its defaults) -> ``portable_ssm.Mamba2Config`` fields."""
    d, expand = raw.int("hidden_size"), raw.int("expand", 2)
    heads, head_dim = raw.int("num_heads", 128), raw.int("head_dim", 64)
    if heads * head_dim != expand * d:
        raise CheckpointError(f"num_heads * head_dim = {heads * head_dim} must equal expand * hidden_size "
                              f"= {expand * d}")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act: only 'silu' is supported, got {shown(raw.get('hidden_act'))}")
    return dict(d_model=d, n_layer=raw.int("num_hidden_layers"), d_state=raw.int("state_size", 128),
                d_conv=raw.int("conv_kernel", 4), expand=expand, headdim=head_dim,
                ngroups=raw.int("n_groups", 8), chunk_size=raw.int("chunk_size", 256),
                dt_min=raw.float("time_step_min", 0.001), dt_max=raw.float("time_step_max", 0.1),
                dt_init_floor=raw.float("time_step_floor", 1e-4),
                dt_limit=raw.pair("time_step_limit", (0.0, math.inf)),
                bias=raw.bool("use_bias", False), conv_bias=raw.bool("use_conv_bias", True),
                norm_eps=raw.float("layer_norm_epsilon", 1e-5),
                residual_in_fp32=raw.bool("residual_in_fp32", True),
                tie_embeddings=raw.bool("tie_word_embeddings", False),
                initializer_range=raw.float("initializer_range", 0.1),
                rescale_prenorm_residual=raw.bool("rescale_prenorm_residual", False),
                vocab_size=raw.int("vocab_size"), pad_vocab_size_multiple=1)


def is_state_spaces_hybrid(raw: Any) -> bool:
    """A state-spaces ``config.json`` (``d_model``, no ``hidden_size``) with attention layers or MLP
    blocks (``attn_layer_idx`` or ``d_intermediate`` set): the ``mamba_ssm`` hybrid family reads it."""
    return (isinstance(raw, dict) and "d_model" in raw and "hidden_size" not in raw
            and (raw.get("attn_layer_idx") not in (None, []) or raw.get("d_intermediate") not in (None, 0)))


def state_spaces_fields(raw: _Keys, *, hybrid: bool = False) -> dict[str, Any]:
    """mamba_ssm's ``MambaConfig`` keys (with its defaults) -> ``portable_ssm.Mamba2Config`` fields
    (the whole model's, every Mamba layer alike). ``hybrid``: ``d_intermediate`` and
    ``attn_layer_idx`` are the caller's to read (:mod:`portable_ssm.families.mamba_ssm`)."""
    ssm, init = raw.object("ssm_cfg"), raw.object("initializer_cfg")
    checks = [("ssm_cfg.layer", ssm.get("layer", "Mamba1"), "Mamba2"),  # mamba_ssm defaults to Mamba1
              *(() if hybrid else (("d_intermediate", raw.get("d_intermediate", 0), 0),  # MLP blocks
                                   ("attn_layer_idx", raw.get("attn_layer_idx") or [], []))),  # attention layers
              ("rms_norm", raw.get("rms_norm", True), True)]  # LayerNorm blocks
    for key, value, supported in checks:
        if type(value) is not type(supported) or value != supported:
            raise CheckpointError(f"{key}: portable_ssm supports only {supported!r}, got {shown(value)}")
    typed = {"int": ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "d_ssm"),
             "float": ("dt_min", "dt_max", "dt_init_floor"), "pair": ("dt_limit", "A_init_range"),
             "bool": ("bias", "conv_bias", "rmsnorm", "norm_before_gate", "D_has_hdim")}
    fields = {k: getattr(ssm, kind)(k) for kind, keys in typed.items() for k in keys
              if ssm.raw.get(k) is not None}  # absent (or null) keys: Mamba2Config's defaults are mamba_ssm's
    return dict(fields, d_model=raw.int("d_model"), n_layer=raw.int("n_layer"), vocab_size=raw.int("vocab_size"),
                residual_in_fp32=raw.bool("residual_in_fp32", True), norm_eps=raw.float("norm_epsilon", 1e-5),
                tie_embeddings=raw.bool("tie_embeddings", True),
                initializer_range=init.float("initializer_range", 0.02),
                rescale_prenorm_residual=init.bool("rescale_prenorm_residual", True),
                pad_vocab_size_multiple=raw.int("pad_vocab_size_multiple", 8))


def _core_name(name: str) -> str:
    """A checkpoint's tensor name in core names: no ``backbone.`` prefix, one embedding name."""
    name = name[len("backbone."):] if name.startswith("backbone.") else name
    return "embedding.weight" if name == "embeddings.weight" else name


def config_fields(raw_config: Any, where: str) -> dict[str, Any]:
    """Either ``config.json`` layout (transformers: ``hidden_size``; state-spaces: ``d_model``) as
    :class:`Mamba2Config` fields plus ``pad_vocab_size_multiple``; a value of the wrong type or an
    unsupported variant raises :class:`CheckpointError` naming ``where``, config.json and the key."""
    try:
        raw = _Keys(raw_config)
        return (_transformers_fields if "hidden_size" in raw.raw else state_spaces_fields)(raw)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: config.json: {err}") from None


def D_per_channel(tensors: Tensors, config: Mamba2Config) -> Tensors:
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


def eos_token_ids(value: Any, where: str) -> int | tuple[int, ...] | None:
    """An ``eos_token_id`` as JSON holds it (null, an int or a list of ints): None, an int or a tuple."""
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise CheckpointError(f"{where}: eos_token_id: expected null, an int or a list of ints, got {shown(value)}")


def _config(fields: dict[str, Any], where: str) -> Mamba2Config:
    """``Mamba2Config(**fields)``; its ValueError (the field named) as a CheckpointError naming ``where``."""
    try:
        return Mamba2Config(**fields)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: config.json: {err}") from None


def minimum_bytes(fields: dict[str, Any], where: str) -> int:
    """The fewest bytes weight files can hold for the config :func:`config_fields` read (every
    parameter of the unpadded vocabulary at 2 bytes, as bf16), O(1) in ``n_layer``; every field is
    checked (CheckpointError naming it) before a shape is built."""
    config = _config(fields, where)
    one_layer = replace(config, n_layer=1, vocab_size=None)  # its shapes: one layer and norm_f
    per_layer = sum(math.prod(shape) for shape in param_shapes(one_layer).values()) - config.d_model
    vocab = config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
    return 2 * (config.n_layer * per_layer + config.d_model + vocab)


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
    config = _config(dict(fields, pad_vocab_size_multiple=multiple), where)
    expected = param_shapes(config)
    if config.D_has_hdim:
        renamed = D_per_channel(renamed, config)
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
