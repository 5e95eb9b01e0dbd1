"""Hybrid-family folders (Granite-4.0-H, Bamba, ...): ``config.json`` + safetensors (sharded too)
-> :class:`~portable_ssm.hybrid_lm.HybridLM`, with :mod:`.pretrained`'s hostile-file rules: the
config is type-checked key by key, its parameter count is bounded by the weight files' sizes
before a tensor is read, shard names stay inside the folder, and every error names the file.
The family modules (:mod:`portable_ssm.families`) only map config keys and tensor names.
"""

from __future__ import annotations

import math
import os
from types import ModuleType
from typing import Any

from ..backends import to_backend
from ..families import FAMILIES, mamba_ssm
from ..hybrid_lm import HybridLM
from ..stack import param_shapes
from .errors import CheckpointError
from .generation_config import FILE_NAME as GENERATION_CONFIG
from .generation_config import read_generation_config
from .layouts import _Keys, eos_token_ids, is_state_spaces_hybrid
from .paths import regular
from .weights import default_dtype, read_weights, weight_files


def model_types() -> tuple[str, ...]:
    """Every config.json ``model_type`` a hybrid family reads."""
    return tuple(FAMILIES)


def family_of(raw: Any) -> ModuleType | None:
    """The family module that reads the parsed config.json ``raw``: by its ``model_type``, or
    :mod:`~portable_ssm.families.mamba_ssm` for a state-spaces config with attention layers or
    MLPs; None for pure Mamba-2 (:mod:`.layouts`)."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("model_type")
    if isinstance(kind, str) and kind in FAMILIES:
        return FAMILIES[kind]
    return mamba_ssm if is_state_spaces_hybrid(raw) else None


def load_hybrid(path: str, raw: dict[str, Any], *, backend: str, dtype: str | None, device: Any) -> HybridLM:
    """The :class:`HybridLM` of the checkpoint folder ``path`` whose parsed config.json is ``raw``
    (one :func:`family_of` reads)."""
    config_path = os.path.join(path, "config.json")
    family = family_of(raw)
    if family is None:
        raise CheckpointError(f"{config_path}: not a hybrid family's config (model_type one of "
                              f"{', '.join(model_types())}, or a state-spaces config with attn_layer_idx or "
                              f"d_intermediate)")
    keys = _Keys(raw)
    try:
        config, notes = family.config(keys)
        vocab = family.vocab_size(keys) if hasattr(family, "vocab_size") else None  # below the head's rows
    except (CheckpointError, ValueError, TypeError) as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    shapes = param_shapes(config)
    files, index, weight_map = weight_files(path)
    need = 2 * sum(math.prod(s) for s in shapes.values())  # every parameter at 2 bytes (bf16) at least
    held = sum(os.path.getsize(f) for f in files)
    if need > held:
        raise CheckpointError(f"{config_path}: the config needs at least {need} bytes of weights but the weight "
                              f"files hold {held}")
    tensors = read_weights(files, index, weight_map)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    try:
        core = family.rename(tensors, config, keys)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from None
    for name, shape in shapes.items():
        if name not in core:
            raise CheckpointError(f"{path}: tensor for {name!r} (core name) is missing")
        if tuple(core[name][0].shape) != shape:
            raise CheckpointError(f"{path}: tensor for {name!r} has shape {tuple(core[name][0].shape)}, expected "
                                  f"{list(shape)} for this config")
    extra = sorted(set(core) - set(shapes))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor {extra[0]!r} (core name) for this config")
    dtype = dtype or default_dtype(core["embedding.weight"][1])
    params = {k: to_backend(v, backend, device=device, dtype=dtype) for k, (v, _) in core.items()}
    eos = eos_token_ids(raw.get("eos_token_id"), f"{config_path}")
    try:
        model = HybridLM(params, config, eos_token_id=eos, notes=notes, vocab_size=vocab)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    regular(os.path.join(path, GENERATION_CONFIG))  # a FIFO or directory in its place is an error, not "none"
    model.generation_config = read_generation_config(path, vocab_size=model.vocab_size,
                                                     rows=config.vocab_size)  # a CheckpointError naming it
    return model
