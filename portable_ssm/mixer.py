"""The Mamba-2 mixer (MAMBA2_SPEC.md steps 1 to 9): projections, conv, SSM, gated norm.

The layer reads as three phases: conv (``xBC``), ssm (chunked scan or one recurrence step),
gated norm and out projection. Packed in_proj output order: ``[z0, x0, z, x, B, C, dt]``, where
``z0, x0 [d_mlp]`` exist only with ``d_ssm < d_inner`` (a gated MLP, ``silu(z0)·x0``, whose
channels go to out_proj in front of the SSM's). With
``seq_idx`` (several sequences packed in one row) the conv and the scan both restart at every
sequence boundary.
"""

from __future__ import annotations

import itertools
from typing import Any

from ._array import Array, Namespace, compute_dtype, namespace, silu
from .backends import fast_op
from .config import Mamba2Config
from .conv import causal_conv1d_silu, conv_step
from .discretize import delta
from .norm import gated_rms_norm, rms_norm_then_gate
from .padding import padded_conv, unpadded_delta
from .quantized import QuantizedWeight, quantized_matmul
from .recurrence import recurrence_step
from .ssd import ssd_chunked, ssd_last
from .ssm_inputs import heads_from_groups, skip_and_gate
from .varlen import Varlen


def _linear(v: Array, weight: Array | QuantizedWeight, bias: Array | None, *, xp: Namespace) -> Array:
    """``v @ weight.T + bias`` for ``v [..., in]``, as one matrix multiply over all leading axes
    (a :class:`~portable_ssm.quantized.QuantizedWeight` through :func:`quantized_matmul`)."""
    *lead, d = v.shape
    rows = xp.reshape(v, (-1, d))  # [prod(lead), in]
    if isinstance(weight, QuantizedWeight):
        out = quantized_matmul(rows, weight, xp=xp)  # [prod(lead), out]
    elif rows.shape[0] < 16:  # decode: W @ vᵀ streams the weight row-major, several times faster
        native = fast_op(xp, "decode_linear")
        out = (xp.matrix_transpose(xp.matmul(weight, xp.matrix_transpose(rows))) if native is None
               else native(rows, weight))  # [prod(lead), out]
    else:
        native = fast_op(xp, "linear")
        out = xp.matmul(rows, xp.matrix_transpose(weight)) if native is None else native(rows, weight)
    if bias is not None:
        out = out + bias
    return xp.reshape(out, (*lead, weight.shape[0]))  # [..., out]


def _split_last(v: Array, sizes: tuple[int, ...], *, xp: Namespace) -> tuple[Array, ...]:
    """``v [..., sum(sizes)]`` cut along its last axis into consecutive parts of ``sizes``: slices,
    or the backend's ``fast_op(xp, "split")`` (torch's ``split``, whose backward concatenates the
    parts' gradients where each slice's fills a zero array of v's size)."""
    native = fast_op(xp, "split")
    if native is not None:
        return tuple(native(v, sizes))
    bounds = list(itertools.accumulate(sizes, initial=0))
    return tuple(v[..., start:stop] for start, stop in zip(bounds[:-1], bounds[1:]))


def _split(zxbcdt: Array, c: Mamba2Config, *, xp: Namespace) -> tuple[Array | None, Array, Array, Array]:
    """``[..., d_in_proj] -> mlp [..., 2·d_mlp] (z0 then x0; None without d_ssm), z [..., ssm_dim],
    xBC [..., conv_dim], dt [..., nheads]``: mamba_ssm's order ``[z0, x0, z, xBC, dt]``."""
    m = 2 * c.d_mlp
    mlp, z, xBC, dt = _split_last(zxbcdt, (m, c.ssm_dim, c.conv_dim, c.nheads), xp=xp)
    return mlp if m else None, z, xBC, dt


def _in_proj(u: Array, p: dict[str, Array], c: Mamba2Config, last_only: bool, *,
             xp: Namespace) -> tuple[Array | None, Array, Array, Array]:
    """in_proj of ``u [b, l, d_model]``, split as :func:`_split` does; with ``last_only`` the gated
    MLP's and the gate's channels (the weight's first ``2·d_mlp + ssm_dim`` rows) for the last
    position only, ``[b, 1, ...]`` (a quantized weight is projected whole, then cut)."""
    weight, bias = p["in_proj.weight"], p.get("in_proj.bias")
    if not last_only:
        return _split(_linear(u, weight, bias, xp=xp), c, xp=xp)
    if isinstance(weight, QuantizedWeight):
        mlp, z, xBC, dt = _split(_linear(u, weight, bias, xp=xp), c, xp=xp)
        return None if mlp is None else mlp[:, -1:, :], z[:, -1:, :], xBC, dt
    gated = 2 * c.d_mlp + c.ssm_dim
    head = _linear(u[:, -1:, :], weight[:gated, :], None if bias is None else bias[:gated], xp=xp)  # [b, 1, gated]
    rest = _linear(u, weight[gated:, :], None if bias is None else bias[gated:], xp=xp)  # [b, l, conv_dim + h]
    xBC, dt = _split_last(rest, (c.conv_dim, c.nheads), xp=xp)
    mlp, z = (None, head) if not c.d_mlp else _split_last(head, (2 * c.d_mlp, c.ssm_dim), xp=xp)
    return mlp, z, xBC, dt


def _split_xbc(xBC: Array, c: Mamba2Config, *, xp: Namespace) -> tuple[Array, Array, Array]:
    """``xBC [..., conv_dim] -> x [..., h, p], B [..., g, n], C [..., g, n]``."""
    gn = c.ngroups * c.d_state
    *lead, _ = xBC.shape
    x, B, C = _split_last(xBC, (c.ssm_dim, gn, gn), xp=xp)
    x = xp.reshape(x, (*lead, c.nheads, c.headdim))  # [..., ssm_dim] -> [..., h, p]
    B = xp.reshape(B, (*lead, c.ngroups, c.d_state))  # [..., g·n] -> [..., g, n]
    C = xp.reshape(C, (*lead, c.ngroups, c.d_state))  # [..., g·n] -> [..., g, n]
    return x, B, C


def _ssm_params(p: dict[str, Array], c: Mamba2Config, cdtype: Any, *, xp: Namespace) -> tuple[Array, Array]:
    """``(A [h], D)`` in the compute dtype: ``A = -exp(A_log)``."""
    return -xp.exp(xp.astype(p["A_log"], cdtype, copy=False)), xp.astype(p["D"], cdtype, copy=False)


def _gate(y: Array, z: Array | None, dtype: Any, *, xp: Namespace) -> Array:
    """``y · silu(z)`` in the compute dtype, returned in ``dtype`` (``z=None``: y itself, cast); the
    backend's ``fast_op(xp, "silu_gate")`` (NumPy's one-pass kernel) where it takes the arrays."""
    cdtype = compute_dtype(xp, dtype)
    v = xp.astype(y, cdtype, copy=False)
    if z is not None:
        z = xp.astype(z, cdtype, copy=False)
        native = fast_op(xp, "silu_gate")
        fused = None if native is None else native(v, z)
        v = v * silu(z, xp=xp) if fused is None else fused
    return xp.astype(v, dtype, copy=False)


def _gate_and_norm(y: Array, z: Array | None, p: dict[str, Array], c: Mamba2Config, *, xp: Namespace) -> Array:
    """mamba_ssm's three ways to apply the gate to ``y, z [..., ssm_dim]``, in the params' dtype:
    ``rmsnorm(y · silu(z))`` (the default), ``rmsnorm(y) · silu(z)`` (norm_before_gate) and
    ``y · silu(z)`` (rmsnorm=False, which ignores norm_before_gate); ``z=None``: y is already
    gated (the fused decode, never used with norm_before_gate)."""
    if not c.rmsnorm:
        return _gate(y, z, p["out_proj.weight"].dtype, xp=xp)
    if c.norm_before_gate:
        return rms_norm_then_gate(y, z, p["norm.weight"], c.ngroups, c.norm_eps, xp=xp)
    return gated_rms_norm(y, z, p["norm.weight"], c.ngroups, c.norm_eps, xp=xp)


def _output(y: Array, z: Array | None, mlp: Array | None, p: dict[str, Array], c: Mamba2Config, *,
            xp: Namespace) -> Array:
    """Gate and norm, the gated MLP's channels in front, out_proj: ``y, z [..., ssm_dim]`` and
    ``mlp [..., 2·d_mlp]`` (or None) -> ``[..., d_model]``."""
    y = _gate_and_norm(y, z, p, c, xp=xp)
    if mlp is not None:
        z0, x0 = mlp[..., :c.d_mlp], mlp[..., c.d_mlp:]
        y = xp.concat([_gate(x0, z0, y.dtype, xp=xp), y], axis=-1)  # silu(z0)·x0 then y: [..., d_inner]
    return _linear(y, p["out_proj.weight"], p.get("out_proj.bias"), xp=xp)


def _fused_decode(c: Mamba2Config, *, xp: Namespace) -> Any:
    """The backend's fused decode kernel (``fast_op(xp, "decode_step")``, :func:`decode_step_ref`'s
    arguments and results; it may return None for inputs it does not take, and the array-API step
    runs), or None where it cannot compute this variant: it gates y before the norm, so
    norm_before_gate=True runs the reference."""
    if c.rmsnorm and c.norm_before_gate:
        return None
    return fast_op(xp, "decode_step")


def mixer(u: Array, p: dict[str, Array], c: Mamba2Config, conv_state: Array | None,
          ssm_state: Array | None, *, xp: Namespace,
          seq_idx: Array | None = None, pad: Array | None = None,
          varlen: Varlen | None = None, last_only: bool = False) -> tuple[Array, Array, Array]:
    """One Mamba-2 layer over a sequence: ``u [b, l, d_model]`` with layer params ``p`` (names
    relative to ``mixer.``). Returns ``(out [b, l, d_model], conv_state [b, conv_dim, k],
    ssm_state [b, h, p, n])``. ``seq_idx [b, l]``: run ids of packed sequences (the incoming
    states feed each row's first sequence, the returned ones are its last sequence's), or None.
    ``pad [b]``: each row's left-padding length (:mod:`portable_ssm.padding`), or None.
    ``varlen``: one packed row by cu_seqlens (:mod:`portable_ssm.varlen`), the states then
    ``[n_seq, ...]`` in and out, one per sequence; or None. ``last_only`` (a prompt pass, without
    seq_idx and varlen): ``out`` is the last position's alone, ``[b, 1, d_model]``; the scan then
    computes the final state and one output (:func:`~portable_ssm.ssd.ssd_last`), and the gate's
    projection, the norm and out_proj take one row."""
    b, l, _ = u.shape
    if last_only and (seq_idx is not None or varlen is not None):
        raise ValueError("last_only: a prompt pass of whole rows; packed rows (seq_idx, cu_seqlens) need every output")
    mlp, z, xBC, dt = _in_proj(u, p, c, last_only, xp=xp)
    conv_w = xp.reshape(p["conv1d.weight"], (c.conv_dim, c.d_conv))  # [conv_dim, 1, k] -> [conv_dim, k]
    if pad is None:
        xBC, conv_state = causal_conv1d_silu(xBC, conv_w, p.get("conv1d.bias"), conv_state, xp=xp, seq_idx=seq_idx,
                                              varlen=varlen)
    else:
        xBC, conv_state = padded_conv(causal_conv1d_silu, xBC, conv_w, p.get("conv1d.bias"), conv_state, pad, xp=xp)
    x, B, C = _split_xbc(xBC, c, xp=xp)

    cdtype = compute_dtype(xp, u.dtype)
    A, D = _ssm_params(p, c, cdtype, xp=xp)
    step = delta(dt, p["dt_bias"], True, c.dt_limit, xp=xp)  # Δ [b, l, h]
    if pad is not None:
        step = unpadded_delta(step, pad, xp=xp)
    x, B, C = (xp.astype(v, cdtype, copy=False) for v in (x, B, C))
    if last_only:
        y, ssm_state = ssd_last(x, xp.astype(step, cdtype, copy=False), A, B, C, initial_states=ssm_state,
                                D=D, xp=xp)
        y = xp.reshape(y, (b, 1, c.ssm_dim))  # [b, h, p] -> [b, 1, ssm_dim]
    else:
        y, ssm_state = ssd_chunked(x, xp.astype(step, cdtype, copy=False), A, B, C, chunk_size=None,
                                   initial_states=ssm_state, seq_idx=seq_idx, D=D, xp=xp, varlen=varlen)
        y = xp.reshape(y, (b, l, c.ssm_dim))  # [b, l, h, p] -> [b, l, ssm_dim]
    return _output(y, z, mlp, p, c, xp=xp), conv_state, ssm_state


def mixer_step(u: Array, p: dict[str, Array], c: Mamba2Config, conv_state: Array, ssm_state: Array, *,
               xp: Namespace) -> tuple[Array, Array, Array]:
    """One token through one layer: ``u [b, d_model]`` -> ``(out [b, d_model], conv_state, ssm_state)``."""
    b, _ = u.shape
    mlp, z, xBC, dt = _split(_linear(u, p["in_proj.weight"], p.get("in_proj.bias"), xp=xp), c, xp=xp)
    conv_w = xp.reshape(p["conv1d.weight"], (c.conv_dim, c.d_conv))  # [conv_dim, 1, k] -> [conv_dim, k]
    cdtype = compute_dtype(xp, u.dtype)
    A, D = _ssm_params(p, c, cdtype, xp=xp)
    native = _fused_decode(c, xp=xp)
    fused = None if native is None else native(xBC, dt, z, conv_state, ssm_state, conv_w, p.get("conv1d.bias"),
                                               p["dt_bias"], A, D, c.dt_limit, c.ngroups, c.headdim)
    if fused is not None:  # one fused kernel: conv, SiLU, Δ, state update, output, D skip and gate
        y, conv_state, ssm_state = fused
        return _output(y, None, mlp, p, c, xp=xp), conv_state, ssm_state

    xBC, conv_state = conv_step(xBC, conv_w, p.get("conv1d.bias"), conv_state, xp=xp)
    x, B, C = _split_xbc(silu(xBC, xp=xp), c, xp=xp)
    step = xp.astype(delta(dt, p["dt_bias"], True, c.dt_limit, xp=xp), cdtype, copy=False)  # Δ [b, h]
    x, B, C = (xp.astype(v, cdtype, copy=False) for v in (x, B, C))
    y, ssm_state = recurrence_step(ssm_state, x, step, A, heads_from_groups(B, c.nheads, xp=xp),
                                   heads_from_groups(C, c.nheads, xp=xp), xp=xp)
    y = xp.reshape(skip_and_gate(y, x, D, None, xp=xp), (b, c.ssm_dim))  # [b, h, p] -> [b, ssm_dim]
    return _output(y, z, mlp, p, c, xp=xp), conv_state, ssm_state


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
        conv_weight: ``[conv_dim, k]``.
        conv_bias: ``[conv_dim]`` or None.
        dt_bias: ``[h]``.
        A: ``[h]`` (A = -exp(A_log)).
        D: ``[h]`` or ``[h, p]``.
        dt_limit: ``(low, high)`` clamp of Δ.
        ngroups: g.
        headdim: p.

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
