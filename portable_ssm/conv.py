"""Causal depthwise conv1d over time (MAMBA2_SPEC.md step 2) and its one-token update.

The conv state keeps the last k inputs per channel, ``[b, channels, k]`` (mamba_ssm and
transformers layout). The output at t sees inputs t-k+1..t only. With ``seq_idx`` (packed
sequences) a tap that reaches back into an earlier sequence reads zero, as if each sequence were
convolved alone; the incoming state belongs to each row's first sequence. With ``varlen`` (one
packed row by ``cu_seqlens``, :mod:`portable_ssm.varlen`) every sequence has its own state in
``[n_seq, channels, k]``: a tap reaching back before a sequence's first step reads that sequence's
incoming state, and the state after each sequence's last step comes back.
"""

from __future__ import annotations

from ._array import Array, Namespace, device, row_major, silu
from .backends import fast_op
from .ssm_inputs import within
from .varlen import Varlen


def causal_conv1d(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                  xp: Namespace, seq_idx: Array | None = None,
                  varlen: Varlen | None = None) -> tuple[Array, Array]:
    """``x [b, l, d]``, weight ``[d, k]``, bias ``[d]``, state ``[b, d, k]`` or None (zeros),
    ``seq_idx [b, l]`` ids where equal means one contiguous sequence, or None.

    Returns ``(y [b, l, d], new_state [b, d, k])``. A backend may provide a native version
    (``fast_op(xp, "causal_conv1d")``), used without ``seq_idx``; this one is the reference
    both are tested against. With ``varlen`` (b = 1, :func:`portable_ssm.varlen.varlen_of`) the
    states are ``[n_seq, d, k]``, one per sequence (:func:`causal_conv1d_varlen`).
    """
    if varlen is not None:
        return causal_conv1d_varlen(x, weight, bias, state, varlen, xp=xp)
    native = fast_op(xp, "causal_conv1d") if seq_idx is None else None
    if native is not None:
        return native(x, weight, bias, state)
    return causal_conv1d_ref(x, weight, bias, state, xp=xp, seq_idx=seq_idx)


def causal_conv1d_silu(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                       xp: Namespace, seq_idx: Array | None = None,
                       varlen: Varlen | None = None) -> tuple[Array, Array]:
    """:func:`causal_conv1d` followed by SiLU (the mixer's conv phase, mamba_ssm's
    ``activation="silu"``): ``(silu(y) [b, l, d], new_state [b, d, k])``. A backend may fuse the two
    (``fast_op(xp, "causal_conv1d_silu")``, used without ``seq_idx`` and ``varlen``)."""
    native = fast_op(xp, "causal_conv1d_silu") if seq_idx is None and varlen is None else None
    if native is not None:
        return native(x, weight, bias, state)
    y, new_state = causal_conv1d(x, weight, bias, state, xp=xp, seq_idx=seq_idx, varlen=varlen)
    return silu(y, xp=xp), new_state


def causal_conv1d_varlen(x: Array, weight: Array, bias: Array | None, states: Array | None, varlen: Varlen, *,
                         xp: Namespace) -> tuple[Array, Array]:
    """The conv of one packed row ``x [1, l, d]`` whose sequences each start from their own state,
    ``states [n_seq, d, k]`` (None: zeros): ``(y [1, l, d], the state after each sequence [n_seq, d, k])``.

    Every tap is one gather: inputs at or after the step's first sequence step come from x, earlier
    ones from that sequence's incoming state."""
    _, l, d = x.shape
    k = weight.shape[-1]
    s = varlen.n_seq
    if states is None:
        history = xp.zeros((s * k, d), dtype=x.dtype, device=device(x))
    else:  # [n_seq, d, k] -> [n_seq, k, d] -> [n_seq·k, d]: sequence i's inputs at rows i·k .. i·k+k-1
        history = xp.reshape(xp.permute_dims(xp.astype(states, x.dtype, copy=False), (0, 2, 1)), (s * k, d))
    inputs = x[0, ...]  # [l, d]

    def read(at: Array, seq: Array, first: Array) -> Array:
        """The inputs at steps ``at`` of sequences ``seq`` beginning at ``first`` (all ``[m]``): ``[m, d]``."""
        from_x = xp.take(inputs, xp.clip(at, 0, l - 1), axis=0)
        from_state = xp.take(history, seq * k + xp.clip(k + at - first, 0, k - 1), axis=0)
        return xp.where((at >= first)[:, None], from_x, from_state)

    steps = xp.arange(l, dtype=varlen.seq.dtype, device=device(x))
    first = xp.take(varlen.first, varlen.seq)  # each step's sequence start, [l]
    taps = row_major(xp.permute_dims(weight, (1, 0)), xp=xp)  # [d, k] -> [k, d]: each tap's weights contiguous
    y = read(steps - (k - 1), varlen.seq, first) * taps[0, ...]
    for j in range(1, k):
        y = y + read(steps - (k - 1) + j, varlen.seq, first) * taps[j, ...]  # [l, d]
    if bias is not None:
        y = y + bias
    window = varlen.last[:, None] + xp.arange(1 - k, 1, dtype=steps.dtype, device=device(x))  # [n_seq, k]
    ids = xp.broadcast_to(xp.arange(s, dtype=steps.dtype, device=device(x))[:, None], (s, k))
    kept = read(xp.reshape(window, (-1,)), xp.reshape(ids, (-1,)),
                xp.reshape(xp.broadcast_to(varlen.first[:, None], (s, k)), (-1,)))  # [n_seq·k, d]
    new_states = xp.permute_dims(xp.reshape(kept, (s, k, d)), (0, 2, 1))  # [n_seq, d, k]
    return y[None, ...], new_states


def causal_conv1d_ref(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                      xp: Namespace, seq_idx: Array | None = None) -> tuple[Array, Array]:
    """The standard-functions conv: a sum of k shifted slices (k is small, 4 by default).

    With ``seq_idx`` the taps crossing a boundary are masked, and the returned state keeps only
    the inputs of each row's last sequence (zeros before it), ready to continue that sequence."""
    b, l, d = x.shape
    k = weight.shape[-1]
    if state is None:
        history = xp.zeros((b, k - 1, d), dtype=x.dtype, device=device(x))  # [b, k-1, d]
    else:
        history = xp.permute_dims(xp.astype(state[:, :, 1:], x.dtype, copy=False), (0, 2, 1))  # [b, k-1, d]
    padded = xp.concat([history, x], axis=1)  # [b, k-1+l, d]
    ids = None
    if seq_idx is not None:  # the history belongs to the first sequence
        ids = xp.concat([xp.broadcast_to(seq_idx[:, :1], (b, k - 1)), seq_idx], axis=1)  # [b, k-1+l]

    def tap(j: int) -> Array:
        """Inputs j-(k-1) steps back from each t, zero where they belong to another sequence."""
        keep = None if ids is None else (ids[:, j:j + l] == seq_idx)[..., None]  # [b, l, 1]
        return within(padded[:, j:j + l, :], keep, xp=xp)  # [b, l, d]

    taps = row_major(xp.permute_dims(weight, (1, 0)), xp=xp)  # [d, k] -> [k, d]: each tap's weights contiguous
    y = tap(0) * taps[0, ...]
    for j in range(1, k):
        y = y + tap(j) * taps[j, ...]  # [b, l, d]
    if bias is not None:
        y = y + bias
    in_last = None if ids is None else (ids[:, l - 1:] == seq_idx[:, -1:])[..., None]  # [b, k, 1]
    kept = within(padded[:, l - 1:, :], in_last, xp=xp)  # last k inputs, [b, k, d]
    new_state = xp.permute_dims(kept, (0, 2, 1))  # [b, d, k]
    return y, new_state


def conv_step(x: Array, weight: Array, bias: Array | None, state: Array, *,
              xp: Namespace) -> tuple[Array, Array]:
    """One token: ``x [b, d]``, state ``[b, d, k]`` -> ``(y [b, d], new_state [b, d, k])``."""
    state = xp.concat([state[:, :, 1:], xp.astype(x, state.dtype, copy=False)[:, :, None]], axis=-1)  # [b, d, k]
    y = xp.sum(state * weight, axis=-1)  # [b, d]
    if bias is not None:
        y = y + bias
    return y, state
