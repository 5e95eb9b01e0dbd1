"""One small module per hybrid family: read its ``config.json`` into a
:class:`~portable_ssm.stack.HybridConfig` and map its weight names onto the stack's; nothing else.

Each module has ``MODEL_TYPES`` (config.json's ``model_type`` values it reads), ``config(raw)``
(a :class:`~portable_ssm.io.layouts._Keys` of config.json -> ``(HybridConfig, notes)``; an
unsupported option raises CheckpointError naming the field) and ``rename(tensors, config, raw)``
(checkpoint names -> core names, packing, stacking or folding where a family stores a block
otherwise); optionally ``vocab_size(raw)``, the real vocabulary when the head's rows are padded
(generation never picks a padding row). Families: ``granitemoehybrid``, ``bamba``,
``nemotron_h``, ``falcon_h1``, ``zamba2``, and :mod:`.mamba_ssm` (state-spaces configs with
attention layers or MLPs: no ``model_type``, routed by their keys); pure Mamba-2 (``mamba2`` and
state-spaces folders) stays with :mod:`portable_ssm.io.layouts`.
"""

from __future__ import annotations

from types import ModuleType

from . import bamba, falcon_h1, granite_hybrid, mamba_ssm, nemotron_h, zamba2

#: config.json's ``model_type`` -> the family module that reads it.
FAMILIES: dict[str, ModuleType] = {t: m for m in (granite_hybrid, bamba, nemotron_h, falcon_h1, zamba2)
                                   for t in m.MODEL_TYPES}

__all__ = ["FAMILIES", "mamba_ssm"]
