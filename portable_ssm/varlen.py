"""Packed prefill by ``cu_seqlens`` (mamba_ssm's and vLLM's varlen layout): one batch-1 row holds
n_seq sequences back to back, ``cu_seqlens [n_seq + 1]`` their cumulative lengths (0 first, l last).

Unlike ``seq_idx`` every sequence of the row has its own incoming state (``[n_seq, ...]``) and gives
back its own final state: the continuous-batching prefill, where new prompts and resumed ones share
one call. n_seq is the static length of cu_seqlens; everything inside is gathered by sequence index
(``take``) and masked (``where``), never shaped by the lengths' values.

:class:`Varlen` holds what the conv and the scan read: the sequence index of every step and each
sequence's first and last step. Beside the per-step work, the scan keeps the state leaving every
chunk (``[c, h, p, n]``, as mamba_ssm's kernels do) and gathers one chunk of inputs per sequence
(``[n_seq, Q, h, p]``) for the initial and final states.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._array import Array, Namespace, device, dtype_name, is_traced, namespace
from ._checks import Shapes, check_same_device


class Varlen(NamedTuple):
    """Packed-row bookkeeping from ``cu_seqlens`` (int32 arrays on x's device)."""

    seq: Array  # sequence index of every step, [l]
    first: Array  # each sequence's first step, [n_seq]
    last: Array  # each sequence's last step, [n_seq]

    @property
    def n_seq(self) -> int:
        """The number of sequences (static: cu_seqlens' length minus one)."""
        return self.first.shape[0]


def check_cu_seqlens(cu_seqlens: Array, seq_idx: Any, shapes: Shapes, ref_name: str, ref: Array, *,
                     xp: Namespace) -> Varlen:
    """Checks ``cu_seqlens`` against ``ref`` (x or input_ids, ``[b, l, ...]`` with b and l bound in
    ``shapes``) and returns its :class:`Varlen`; binds ``s`` (n_seq) in ``shapes``.

    TypeError for a non-integer dtype or another backend; ValueError beside ``seq_idx``, for b != 1,
    a rank other than 1, fewer than 2 entries, and (when the values are concrete, not traced) a
    first entry other than 0, a last other than l, or entries not strictly increasing (a sequence
    of length 0)."""
    namespace(**{ref_name: ref}, cu_seqlens=cu_seqlens)
    if seq_idx is not None:
        raise ValueError("cu_seqlens: not supported together with seq_idx; pass one of them "
                         "(cu_seqlens for per-sequence states)")
    if not xp.isdtype(cu_seqlens.dtype, "integral"):
        raise TypeError(f"cu_seqlens: expected an integer dtype (cumulative sequence lengths), "
                        f"got {dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape [n_seq + 1] with n_seq >= 1, got {tuple(cu_seqlens.shape)}")
    if shapes["b"] != 1:
        raise ValueError(f"{ref_name}: expected batch 1 with cu_seqlens (one packed row), got b={shapes['b']}")
    check_same_device("cu_seqlens", cu_seqlens, ref_name, ref)
    l = shapes["l"]
    shapes.bind("s", cu_seqlens.shape[0] - 1, "cu_seqlens")
    if not is_traced(cu_seqlens):  # a few host syncs, none per sequence
        if int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens: expected 0 first, got {int(cu_seqlens[0])}")
        if int(cu_seqlens[-1]) != l:
            raise ValueError(f"cu_seqlens: expected l={l} (from {ref_name}) last, got {int(cu_seqlens[-1])}")
        empty = xp.astype(cu_seqlens[1:] <= cu_seqlens[:-1], xp.int8)  # 1 where a length is <= 0, [n_seq]
        if bool(xp.any(empty == 1)):
            at = int(xp.argmax(empty))
            raise ValueError(f"cu_seqlens: expected strictly increasing entries (no empty or decreasing "
                             f"sequence), got {int(cu_seqlens[at])} then {int(cu_seqlens[at + 1])} at index {at}")
    return varlen_of(cu_seqlens, l, xp=xp)


def varlen_of(cu_seqlens: Array, l: int, *, xp: Namespace) -> Varlen:
    """The :class:`Varlen` of checked ``cu_seqlens`` over ``l`` steps."""
    cu = xp.astype(cu_seqlens, xp.int32, copy=False)  # int32: no int64 needed, none asked of JAX without x64
    steps = xp.arange(l, dtype=xp.int32, device=device(cu))
    seq = xp.searchsorted(cu[1:], steps, side="right")  # sequences ended at or before t, [l]
    return Varlen(seq=xp.astype(seq, xp.int32, copy=False), first=cu[:-1], last=cu[1:] - 1)


def windows(v: Array, at: Array, size: int, *, xp: Namespace) -> tuple[Array, Array]:
    """``size`` consecutive steps of ``v [l, ...]`` from each start ``at [n]`` (clipped to the last
    step): ``(values [n, size, ...], their steps [n, size])``; steps past l read step l-1."""
    l = v.shape[0]
    steps = at[:, None] + xp.arange(size, dtype=at.dtype, device=device(at))  # [n, size]
    index = xp.clip(steps, 0, l - 1)
    taken = xp.take(v, xp.reshape(index, (-1,)), axis=0)  # [n·size, ...]
    return xp.reshape(taken, (*steps.shape, *v.shape[1:])), steps  # [n, size, ...]
