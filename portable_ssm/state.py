"""The Mamba-2 stack's inference state: each layer's conv window and SSM state."""

from __future__ import annotations

from typing import NamedTuple

from ._array import Array


class Mamba2State(NamedTuple):
    """Per-layer inference state: ``conv[i] [b, conv_dim, d_conv]`` (x's dtype) and
    ``ssm[i] [b, nheads, headdim, d_state]`` (compute dtype: float32, float64 for float64)."""

    conv: tuple[Array, ...]
    ssm: tuple[Array, ...]
