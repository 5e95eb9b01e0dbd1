"""RMSNorm and Mamba-2's grouped gated RMSNorm (MAMBA2_SPEC.md step 8), computed in float32 at least."""

from __future__ import annotations

from ._array import Array, Namespace, compute_dtype, silu


def _mean_square(x: Array, *, xp: Namespace) -> Array:
    """``mean(x², -1)`` kept as ``[..., 1]``: a dot product per row, one pass and no ``x²`` temporary."""
    return xp.vecdot(x, x, axis=-1)[..., None] / x.shape[-1]  # [...] -> [..., 1]


def rms_norm(x: Array, weight: Array, eps: float, *, xp: Namespace) -> Array:
    """``x / sqrt(mean(x², -1) + eps) * weight`` over the last axis; returns weight's dtype."""
    dtype = x.dtype
    x = xp.astype(x, compute_dtype(xp, dtype), copy=False)
    x = x / xp.sqrt(_mean_square(x, xp=xp) + eps)
    return weight * xp.astype(x, weight.dtype, copy=False)


def gated_rms_norm(y: Array, z: Array | None, weight: Array, groups: int, eps: float, *, xp: Namespace) -> Array:
    """``rmsnorm(y · silu(z))`` over each of ``groups`` equal slices of the last axis
    (norm_before_gate=False, as mamba_ssm's Mamba2). ``y, z [..., d]``, weight ``[d]``; ``z=None``
    when y arrives already gated (a fused decode kernel)."""
    cdtype = compute_dtype(xp, weight.dtype)
    v = xp.astype(y, cdtype, copy=False)  # [..., d]
    if z is not None:
        v = v * silu(xp.astype(z, cdtype, copy=False), xp=xp)
    *lead, d = v.shape
    v = xp.reshape(v, (*lead, groups, d // groups))  # [..., g, d/g]
    v = v / xp.sqrt(_mean_square(v, xp=xp) + eps)
    v = xp.reshape(v, (*lead, d))  # [..., d]
    return weight * xp.astype(v, weight.dtype, copy=False)
