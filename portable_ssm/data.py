"""Batching variable-length sequences: pad them to one length, or pack them into one row.

A data loader yields one sequence per sample, ``[L_i, D]`` or ``[1, L_i, D]``; the model wants
``[b, l, D]``. :func:`collate` builds either layout from a list of samples of one backend:

- ``mode="pad"``: ``x [B, L_max, D]`` with ``pad_value`` after each sample's end, ``lengths [B]``
  and ``mask [B, L_max]`` (True at real steps). Mamba-2 is causal and the padding comes after the
  real steps, so the outputs at real steps are each sample's own, whatever the pad value; the
  states after a padded row's end are not (pack to get those).
- ``mode="pack"``: ``x [1, ΣL_i, D]`` and ``seq_idx [1, ΣL_i]`` (sample i has id i) for
  ``forward(batch.x, params, config=..., seq_idx=batch.seq_idx)``: no step is spent on padding
  and every sample is computed as if alone.

:func:`unpack` cuts a model output of either layout back into per-sample pieces ``[L_i, ...]``
and :func:`to_padded` lays those out as ``[B, L_max, ...]``. Only standard array functions are
used, on the samples' own namespace and device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ._array import Array, Namespace, device, namespace
from ._checks import check_same_device, check_same_dtype

MODES = ("pad", "pack")


@dataclass(frozen=True)
class Batch:
    """Collated samples. ``sizes`` holds the lengths as Python ints for slicing on the host."""

    mode: str  # "pad" or "pack"
    x: Array  # pad: [B, L_max, D]; pack: [1, ΣL_i, D]
    lengths: Array  # [B] int32, each sample's length
    sizes: tuple[int, ...]  # the same lengths, as ints
    mask: Array | None = None  # pad: [B, L_max] bool, True at real steps; pack: None
    seq_idx: Array | None = None  # pack: [1, ΣL_i] int32, sample i has id i; pad: None
    targets: Array | None = None  # collated like x when targets were given


def collate(samples: Sequence[Array], *, mode: str = "pad", targets: Sequence[Array] | None = None,
            pad_value: float = 0.0, target_pad_value: float = 0) -> Batch:
    """Batches sequences of different lengths by padding (``mode="pad"``) or packing (``"pack"``).

    Args:
        samples: ``[L_i, D]`` arrays, or ``[1, L_i, D]`` (all the same rank), of one backend,
            dtype and device; L_i >= 1.
        mode: ``"pad"`` -> ``x [B, L_max, D]``, ``mask``; ``"pack"`` -> ``x [1, ΣL_i, D]``, ``seq_idx``.
        targets: optional one array per sample, ``[L_i, *T]`` (``[1, L_i, *T]`` when the samples
            have the leading 1), e.g. token ids ``[L_i]``; collated the same way.
        pad_value: what fills x after each sample's end (pad mode).
        target_pad_value: what fills the targets there (e.g. -100 for an ignore index).

    Returns:
        a :class:`Batch`. An empty list raises ValueError; mismatched ranks, feature sizes or
        target lengths raise ValueError naming the sample index and both sizes; a non-list,
        mixed backends or mixed dtypes raise TypeError (naming both samples).
    """
    _check_fill("pad_value", pad_value)
    _check_fill("target_pad_value", target_pad_value)
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(samples, (list, tuple)):
        raise TypeError(f"samples: expected a list of [L, D] or [1, L, D] arrays, "
                        f"got {type(samples).__name__}")
    if not samples:
        raise ValueError("samples: expected at least one sample, got an empty list")
    xp = namespace(**{f"samples[{i}]": s for i, s in enumerate(samples)})
    lead = _leading_axis(samples[0])
    seqs = _sequences("samples", samples, lead=lead, lengths=None)
    sizes = tuple(int(s.shape[0]) for s in seqs)
    lengths = xp.asarray(sizes, dtype=xp.int32, device=device(samples[0]))  # [B]
    target_seqs = None
    if targets is not None:
        if not isinstance(targets, (list, tuple)):
            raise TypeError(f"targets: expected a list of arrays, got {type(targets).__name__}")
        if len(targets) != len(samples):
            raise ValueError(f"targets: expected one array per sample ({len(samples)}), got {len(targets)}")
        namespace(**{"samples[0]": samples[0]}, **{f"targets[{i}]": t for i, t in enumerate(targets)})
        target_seqs = _sequences("targets", targets, lead=lead, lengths=sizes)
    if mode == "pad":
        longest = max(sizes)
        mask = xp.arange(longest, device=device(samples[0]))[None, :] < lengths[:, None]  # [B, L_max]
        return Batch(mode=mode, x=_pad_stack(seqs, longest, pad_value, xp=xp), lengths=lengths,
                     sizes=sizes, mask=mask,
                     targets=None if target_seqs is None else
                     _pad_stack(target_seqs, longest, target_pad_value, xp=xp))
    ids = [i for i, size in enumerate(sizes) for _ in range(size)]
    seq_idx = xp.asarray(ids, dtype=xp.int32, device=device(samples[0]))[None, :]  # [1, ΣL_i]
    return Batch(mode=mode, x=xp.concat(seqs, axis=0)[None, ...], lengths=lengths, sizes=sizes,
                 seq_idx=seq_idx,
                 targets=None if target_seqs is None else xp.concat(target_seqs, axis=0)[None, ...])


def unpack(y: Array, batch: Batch) -> list[Array]:
    """Cuts a model output laid out like ``batch.x`` (``[B, L_max, ...]`` padded or
    ``[1, ΣL_i, ...]`` packed) into one ``[L_i, ...]`` piece per sample, padding dropped."""
    namespace(y=y)
    if not isinstance(batch, Batch):
        raise TypeError(f"batch: expected the Batch from collate, got {type(batch).__name__}")
    want = (len(batch.sizes), max(batch.sizes)) if batch.mode == "pad" else (1, sum(batch.sizes))
    if y.ndim < 2 or tuple(y.shape[:2]) != want:
        layout = "[B, L_max, ...]" if batch.mode == "pad" else "[1, sum(L_i), ...]"
        raise ValueError(f"y: expected shape {layout} = {list(want)} + [...] like batch.x "
                         f"({batch.mode} mode), got {tuple(y.shape)}")
    if batch.mode == "pad":
        return [y[i, :size, ...] for i, size in enumerate(batch.sizes)]
    ends = list(accumulate(batch.sizes))
    return [y[0, end - size:end, ...] for end, size in zip(ends, batch.sizes, strict=True)]


def to_padded(y: Array, batch: Batch, *, pad_value: float = 0.0) -> Array:
    """A packed (or padded) output as ``[B, L_max, ...]`` with ``pad_value`` after each sample's end."""
    pieces = unpack(y, batch)
    _check_fill("pad_value", pad_value)
    return _pad_stack(pieces, max(batch.sizes), pad_value, xp=namespace(y=y))


def _check_fill(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a number (a fill value; bool and str are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")


def _leading_axis(first: Array) -> bool:
    """Whether the samples come as ``[1, L, D]`` (True) or ``[L, D]`` (False), from the first one."""
    if first.ndim not in (2, 3):
        raise ValueError(f"samples[0]: expected shape [L, D] or [1, L, D], got {tuple(first.shape)}")
    return first.ndim == 3


def _sequences(name: str, items: Sequence[Array], *, lead: bool,
               lengths: tuple[int, ...] | None) -> list[Array]:
    """``items[i] [L_i, *F]`` (``[1, L_i, *F]`` with ``lead``) as ``[L_i, *F]`` arrays, checked:
    one rank, one trailing shape F, one dtype and device, L_i >= 1 (and L_i = ``lengths[i]``)."""
    first, first_label = items[0], f"{name}[0]"
    if first.ndim < 1 + lead:
        raise ValueError(f"{first_label}: expected shape {'[1, L, ...]' if lead else '[L, ...]'} "
                         f"like the samples, got {tuple(first.shape)}")
    features = tuple(first.shape[1 + lead:])
    out = []
    for i, item in enumerate(items):
        label, shape = f"{name}[{i}]", tuple(item.shape)
        if item.ndim != first.ndim:
            raise ValueError(f"{label}: rank {item.ndim} (shape {shape}) but {first_label} has rank "
                             f"{first.ndim} (shape {tuple(first.shape)})")
        if lead and shape[0] != 1:
            raise ValueError(f"{label}: expected one sequence [1, L, ...] like {first_label}, got shape "
                             f"{shape}; split a batch into its rows first")
        if shape[1 + lead:] != features:
            raise ValueError(f"{label}: feature size {list(shape[1 + lead:])} but {first_label} has "
                             f"{list(features)} (shapes {shape} and {tuple(first.shape)})")
        check_same_dtype(label, item, first_label, first)
        check_same_device(label, item, first_label, first)
        seq = item[0, ...] if lead else item  # [L_i, *F]
        size = int(seq.shape[0])
        if size == 0:
            raise ValueError(f"{label}: empty sequence (shape {shape}); drop it before collating")
        if lengths is not None and size != lengths[i]:
            raise ValueError(f"{label}: length {size} but samples[{i}] has length {lengths[i]}")
        out.append(seq)
    return out


def _pad_stack(seqs: Sequence[Array], length: int, value: float, *, xp: Namespace) -> Array:
    """``[L_i, *F]`` pieces -> ``[B, length, *F]``, each filled with ``value`` after its end."""
    padded = []
    for seq in seqs:
        fill = xp.full((length - seq.shape[0], *seq.shape[1:]), value, dtype=seq.dtype,
                       device=device(seq))  # [length - L_i, *F]
        padded.append(xp.concat([seq, fill], axis=0))  # [length, *F]
    return xp.stack(padded, axis=0)  # [B, length, *F]
