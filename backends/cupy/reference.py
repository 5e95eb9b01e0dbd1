"""The array-API twins of the CuPy kernels: what each kernel must equal, on any backend.

``causal_conv1d`` and ``ssd_chunked`` have theirs in the core (:func:`portable_ssm.conv.causal_conv1d_ref`
and :func:`portable_ssm.ssd.ssd_chunked_ref`); the fused decode step's twin is
written here from the core's pieces, in the order ``portable_ssm.mixer.mixer_step`` runs them.
Nothing here imports cupy.
"""

from __future__ import annotations

from portable_ssm._array import Array, compute_dtype, namespace, silu
from portable_ssm.conv import causal_conv1d_ref, conv_step
from portable_ssm.discretize import delta
from portable_ssm.recurrence import recurrence_step
from portable_ssm.ssd import ssd_chunked_ref
from portable_ssm.ssm_inputs import heads_from_groups, skip_and_gate

__all__ = ["causal_conv1d_ref", "decode_step_ref", "ssd_chunked_ref"]


def decode_step_ref(xBC: Array, dt: Array, z: Array, conv_state: Array, ssm_state: Array,
                    conv_weight: Array, conv_bias: Array | None, dt_bias: Array, A: Array, D: Array,
                    dt_limit: tuple[float, float], ngroups: int, headdim: int) -> tuple[Array, Array, Array]:
    """One token of one Mamba-2 layer after in_proj, up to the gate (the norm and out_proj follow).

    Args:
        xBC: ``[b, conv_dim]`` raw conv input, ``conv_dim = h·p + 2·g·n`` (x, then B, then C).
        dt: ``[b, h]`` raw time step (before ``dt_bias`` and the softplus).
        z: ``[b, h·p]`` gate.
        conv_state: ``[b, conv_dim, k]`` the last k inputs (xBC's dtype).
        ssm_state: ``[b, h, p, n]`` in the compute dtype.
        conv_weight, conv_bias: ``[conv_dim, k]`` and ``[conv_dim]`` or None.
        dt_bias, A: ``[h]`` (A = -exp(A_log)); D: ``[h]`` or ``[h, p]``.
        dt_limit: ``(low, high)`` clamp of Δ; ngroups: g; headdim: p.

    Returns:
        ``(y [b, h·p] in xBC's dtype, new_conv_state, new_ssm_state)`` with
        ``y = (H @ C + D·x) · silu(z)`` after ``H = exp(Δ·A)·H + Δ·outer(x, B)``.
    """
    xp = namespace(xBC=xBC, dt=dt, z=z, conv_state=conv_state, ssm_state=ssm_state, conv_weight=conv_weight,
                   conv_bias=conv_bias, dt_bias=dt_bias, A=A, D=D)
    b, conv_dim = xBC.shape
    out_dtype, cdtype = xBC.dtype, compute_dtype(xp, xBC.dtype)
    h = dt.shape[-1]
    d_inner = h * headdim
    n = (conv_dim - d_inner) // (2 * ngroups)
    xBC, conv_state = conv_step(xBC, conv_weight, conv_bias, conv_state, xp=xp)
    xBC = silu(xBC, xp=xp)
    x = xp.reshape(xBC[:, :d_inner], (b, h, headdim))  # [b, h, p]
    B = xp.reshape(xBC[:, d_inner:d_inner + ngroups * n], (b, ngroups, n))  # [b, g, n]
    C = xp.reshape(xBC[:, d_inner + ngroups * n:], (b, ngroups, n))  # [b, g, n]
    x, B, C = (xp.astype(v, cdtype) for v in (x, B, C))
    step = xp.astype(delta(dt, dt_bias, True, dt_limit, xp=xp), cdtype)  # Δ [b, h]
    y, ssm_state = recurrence_step(ssm_state, x, step, xp.astype(A, cdtype), heads_from_groups(B, h, xp=xp),
                                   heads_from_groups(C, h, xp=xp), xp=xp)
    gate = xp.astype(xp.reshape(z, (b, h, headdim)), cdtype)  # [b, h·p] -> [b, h, p]
    y = skip_and_gate(y, x, xp.astype(D, cdtype), gate, xp=xp)
    return xp.astype(xp.reshape(y, (b, d_inner)), out_dtype), conv_state, ssm_state  # [b, h, p] -> [b, h·p]
