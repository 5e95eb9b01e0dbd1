"""Causal depthwise conv1d over time (MAMBA2_SPEC.md step 2) and its one-token update.

The conv state keeps the last k inputs per channel, ``[b, channels, k]`` (mamba_ssm and
transformers layout). The output at t sees inputs t-k+1..t only. With ``seq_idx`` (packed
sequences) a tap that reaches back into an earlier sequence reads zero, as if each sequence were
convolved alone; the incoming state belongs to each row's first sequence.
"""

from __future__ import annotations

from ._array import Array, Namespace, device, silu
from .backends import fast_op
from .ssm_inputs import within


def causal_conv1d(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                  xp: Namespace, seq_idx: Array | None = None) -> tuple[Array, Array]:
    """``x [b, l, d]``, weight ``[d, k]``, bias ``[d]``, state ``[b, d, k]`` or None (zeros),
    ``seq_idx [b, l]`` ids where equal means one contiguous sequence, or None.

    Returns ``(y [b, l, d], new_state [b, d, k])``. A backend may provide a native version
    (``fast_op(xp, "causal_conv1d")``), used without ``seq_idx``; this one is the reference
    both are tested against.
    """
    native = fast_op(xp, "causal_conv1d") if seq_idx is None else None
    if native is not None:
        return native(x, weight, bias, state)
    return causal_conv1d_ref(x, weight, bias, state, xp=xp, seq_idx=seq_idx)


def causal_conv1d_silu(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                       xp: Namespace, seq_idx: Array | None = None) -> tuple[Array, Array]:
    """:func:`causal_conv1d` followed by SiLU (the mixer's conv phase, mamba_ssm's
    ``activation="silu"``): ``(silu(y) [b, l, d], new_state [b, d, k])``. A backend may fuse the two
    (``fast_op(xp, "causal_conv1d_silu")``, used without ``seq_idx``)."""
    native = fast_op(xp, "causal_conv1d_silu") if seq_idx is None else None
    if native is not None:
        return native(x, weight, bias, state)
    y, new_state = causal_conv1d(x, weight, bias, state, xp=xp, seq_idx=seq_idx)
    return silu(y, xp=xp), new_state


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

    y = tap(0) * weight[:, 0]
    for j in range(1, k):
        y = y + tap(j) * weight[:, j]  # [b, l, d]
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
