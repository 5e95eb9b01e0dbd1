"""Mamba-2 discretization (MAMBA2_SPEC.md, steps 4 to 6).

Δ is per head **and** per time step: ``Δ = clamp(softplus(dt + dt_bias), dt_limit)``, never averaged.
Ā is the zero-order hold of the scalar-per-head A: ``Ā = exp(Δ·A)`` (not ``1 + Δ·A``).
Both are computed in float32 at least (float64 stays float64).
"""

from __future__ import annotations

import math

from ._array import Array, Namespace, compute_dtype, constant, namespace, softplus
from ._checks import Shapes, check_bool, check_dt_limit, check_floating, check_given


def delta(dt: Array, dt_bias: Array | None, dt_softplus: bool, dt_limit: tuple[float, float], *,
          xp: Namespace) -> Array:
    """Δ from raw ``dt [..., h]`` in the compute dtype (no validation: callers check at the door)."""
    dt = xp.astype(dt, compute_dtype(xp, dt.dtype), copy=False)
    if dt_bias is not None:
        dt = dt + xp.astype(dt_bias, dt.dtype, copy=False)  # [..., h] + [h]
    if dt_softplus:
        dt = softplus(dt, xp=xp)
    low, high = dt_limit
    dt = xp.maximum(dt, constant(low, dt, xp=xp))  # Δ >= 0 always (the default limit is (0, inf))
    if math.isfinite(high):
        dt = xp.minimum(dt, constant(high, dt, xp=xp))
    return dt


def validate_dt(shapes: Shapes, dt: Array, A: Array, dt_bias: Array | None, dt_spec: tuple[str, ...], *,
                xp: Namespace) -> None:
    """Checks dt against ``dt_spec`` (ending in ``h``), A ``[h]`` and dt_bias ``[h]``: shapes and dtypes."""
    for name, value in (("dt", dt), ("A", A), ("dt_bias", dt_bias)):
        if value is not None:
            check_floating(name, value, xp=xp)
    shapes.check("dt", dt, dt_spec)
    shapes.check("A", A, ("h",))
    if dt_bias is not None:
        shapes.check("dt_bias", dt_bias, ("h",))


def discretize(dt: Array, A: Array, *, dt_bias: Array | None = None, dt_softplus: bool = False,
               dt_limit: tuple[float, float] = (0.0, math.inf)) -> tuple[Array, Array]:
    """Discretizes Mamba-2's continuous parameters per head and per time step.

    Args:
        dt: raw time steps ``[..., h]`` (e.g. ``[b, l, h]`` or ``[b, h]``).
        A: continuous decay per head ``[h]`` (negative: ``-exp(A_log)``).
        dt_bias: optional ``[h]`` added to dt before the softplus.
        dt_softplus: apply the (overflow-free) softplus to ``dt + dt_bias``.
        dt_limit: clamp Δ into ``[low, high]`` after the softplus.

    Returns:
        ``(Δ, Ā)``, both shaped like ``dt`` and in float32 at least: ``Ā = exp(Δ·A)``.
    """
    check_given(dt=dt, A=A)
    xp = namespace(dt=dt, A=A, dt_bias=dt_bias)
    dt_limit = check_dt_limit(dt_limit)
    check_bool("dt_softplus", dt_softplus)
    if dt.ndim < 1:
        raise ValueError(f"dt: expected rank >= 1 with shape [..., h], got shape {tuple(dt.shape)}")
    spec = tuple(f"d{i}" for i in range(dt.ndim - 1)) + ("h",)
    validate_dt(Shapes(), dt, A, dt_bias, spec, xp=xp)
    step = delta(dt, dt_bias, dt_softplus, dt_limit, xp=xp)  # [..., h]
    return step, xp.exp(step * xp.astype(A, step.dtype, copy=False))
