"""RMSNorm and Mamba-2's grouped gated RMSNorm (MAMBA2_SPEC.md step 8), computed in float32 at least."""

from __future__ import annotations

from ._array import Array, Namespace, compute_dtype, silu
from .backends import fast_op


def _mean_square(x: Array, *, xp: Namespace) -> Array:
    """``mean(x², -1)`` kept as ``[..., 1]``: a dot product per row, one pass and no ``x²`` temporary."""
    return xp.vecdot(x, x, axis=-1)[..., None] / x.shape[-1]  # [...] -> [..., 1]


def rms_norm(x: Array, weight: Array, eps: float, *, xp: Namespace) -> Array:
    """``x / sqrt(mean(x², -1) + eps) * weight`` over the last axis; returns weight's dtype (the
    gated norm with one group and no gate, so both share one native path)."""
    return gated_rms_norm(x, None, weight, 1, eps, xp=xp)


def gated_rms_norm(y: Array, z: Array | None, weight: Array, groups: int, eps: float, *, xp: Namespace) -> Array:
    """``rmsnorm(y · silu(z))`` over each of ``groups`` equal slices of the last axis
    (norm_before_gate=False, as mamba_ssm's Mamba2). ``y, z [..., d]``, weight ``[d]``; ``z=None``
    when y arrives already gated (a fused decode kernel). A backend may provide a native version
    (``fast_op(xp, "gated_rms_norm")``, e.g. NumPy's tiled one); :func:`gated_rms_norm_ref` is the
    reference it is tested against."""
    native = fast_op(xp, "gated_rms_norm")
    if native is not None:
        return native(y, z, weight, groups, eps)
    return gated_rms_norm_ref(y, z, weight, groups, eps, xp=xp)


def gated_rms_norm_ref(y: Array, z: Array | None, weight: Array, groups: int, eps: float, *,
                       xp: Namespace) -> Array:
    """The standard-functions gated norm: gate, mean square per group, scale, weight."""
    cdtype = compute_dtype(xp, weight.dtype)
    v = xp.astype(y, cdtype, copy=False)  # [..., d]
    if z is not None:
        v = v * silu(xp.astype(z, cdtype, copy=False), xp=xp)
    *lead, d = v.shape
    v = xp.reshape(v, (*lead, groups, d // groups))  # [..., g, d/g]
    v = v / xp.sqrt(_mean_square(v, xp=xp) + eps)
    v = xp.reshape(v, (*lead, d))  # [..., d]
    return weight * xp.astype(v, weight.dtype, copy=False)


def rms_norm_then_gate(y: Array, z: Array, weight: Array, groups: int, eps: float, *, xp: Namespace) -> Array:
    """``rmsnorm(y) · silu(z)`` per group (mamba_ssm's ``norm_before_gate=True``): the ungated
    grouped norm (its native path too), then the gate in the compute dtype; returns weight's dtype."""
    cdtype = compute_dtype(xp, weight.dtype)
    normed = xp.astype(gated_rms_norm(y, None, weight, groups, eps, xp=xp), cdtype, copy=False)
    gated = normed * silu(xp.astype(z, cdtype, copy=False), xp=xp)
    return xp.astype(gated, weight.dtype, copy=False)
