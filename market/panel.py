"""Training over many instruments: one walk-forward split in time shared by all, one normaliser.

:func:`shared_split` picks one boundary time ``boundary_ns`` for every instrument (by default the
time that leaves the last ``val_fraction`` of all instruments' bars, pooled, on its right). Each
instrument's boundary bar is its first bar at or after that time; its windows are cut exactly as
the single-instrument :func:`~portable_ssm.market.walk_forward` cuts them about that bar
(:func:`~portable_ssm.market.features.split_at`): training windows and their targets lie wholly
before ``boundary_ns``, validation windows start ``embargo`` bars after it. So no instrument's
validation data precedes any instrument's training data. :func:`shared_normaliser` fits one
:class:`~portable_ssm.market.Normaliser` on every instrument's training span (rows before its
boundary bar) pooled, and :func:`stack_windows` stacks the instruments' windows into one batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ._checks import check_int, check_real
from .bars import Bars
from .features import Normaliser, Split, split_at, windows


@dataclass(frozen=True)
class SharedSplit:
    """One walk-forward split of several instruments at one time: ``boundary_ns`` (int ns; no
    training bar is at or after it) and each instrument's :class:`~portable_ssm.market.Split`
    (its boundary bar and window ends, either side possibly empty), ids ascending."""

    boundary_ns: int
    splits: dict[int, Split]

    @property
    def instruments(self) -> tuple[int, ...]:
        """The instrument ids, ascending."""
        return tuple(self.splits)


def _check_bars(bars: Mapping[int, Bars]) -> dict[int, Bars]:
    if not isinstance(bars, Mapping) or not bars:
        raise TypeError(f"bars: expected a non-empty mapping of instrument id -> Bars, got {type(bars).__name__}")
    out = {}
    for key in bars:
        instrument = check_int("bars (an instrument id)", key, minimum=0, maximum=2**32 - 1)
        if not isinstance(bars[key], Bars):
            raise TypeError(f"bars[{key!r}]: expected Bars, got {type(bars[key]).__name__}")
        out[instrument] = bars[key]
    return dict(sorted(out.items()))


def shared_split(bars: Mapping[int, Bars], *, window: int, horizon: int, embargo: int, val_fraction: float = 0.2,
                 stride: int = 1, boundary_ns: int | None = None) -> SharedSplit:
    """Each instrument's training and validation window ends about one shared boundary time.

    ``bars``: ``{instrument_id: Bars}`` (each in time order, as the readers give them);
    ``boundary_ns``: the boundary time (int ns), or None for the time that puts the last
    ``val_fraction`` of all the bars pooled after it (the single-instrument split's boundary when
    there is one instrument with distinct times). ``window``, ``horizon``, ``stride`` ints >= 1,
    ``embargo`` >= 0, as :func:`~portable_ssm.market.walk_forward`. ValueError when no instrument
    has a training window, or none a validation window."""
    bars = _check_bars(bars)
    window, horizon = check_int("window", window, minimum=1), check_int("horizon", horizon, minimum=1)
    embargo, stride = check_int("embargo", embargo, minimum=0), check_int("stride", stride, minimum=1)
    if boundary_ns is None:
        val_fraction = check_real("val_fraction", val_fraction, low=0.0, high=1.0, open_low=True, open_high=True)
        pooled = np.sort(np.concatenate([b.ts_event for b in bars.values()]))  # [n] every bar's time
        held_out = int(pooled.shape[0] * val_fraction)  # bars after the boundary, as walk_forward counts
        boundary_ns = int(pooled[pooled.shape[0] - held_out]) if held_out else int(pooled[-1]) + 1
    boundary_ns = check_int("boundary_ns", boundary_ns)
    splits = {}
    for instrument, b in bars.items():
        boundary = int(np.searchsorted(b.ts_event, boundary_ns, side="left"))  # first bar at or after the time
        splits[instrument] = split_at(boundary, len(b), len(b), window=window, horizon=horizon, embargo=embargo,
                                      stride=stride)
    for side in ("train_ends", "val_ends"):
        if not any(getattr(s, side).size for s in splits.values()):
            raise ValueError(f"bars: no instrument has a {side.split('_')[0]}ing window of {window} bars about the "
                             f"boundary time {boundary_ns} (bars per instrument: "
                             f"{ {i: len(b) for i, b in bars.items()} })")
    return SharedSplit(boundary_ns=boundary_ns, splits=splits)


def shared_normaliser(features: Mapping[int, np.ndarray], split: SharedSplit) -> Normaliser:
    """One :class:`~portable_ssm.market.Normaliser` fitted on every instrument's feature rows
    before its boundary bar, pooled (``features``: ``{instrument_id: [N_i, F]}`` for each
    instrument of ``split``): no row at or after the boundary time is read."""
    if not isinstance(split, SharedSplit):
        raise TypeError(f"split: expected a SharedSplit, got {type(split).__name__}")
    if not isinstance(features, Mapping) or set(features) != set(split.splits):
        raise ValueError(f"features: expected one array per instrument {split.instruments}, got "
                         f"{sorted(features) if isinstance(features, Mapping) else type(features).__name__}")
    rows = [np.asarray(features[i]) for i in split.instruments]
    for i, f in zip(split.instruments, rows):
        if f.ndim != 2 or not np.issubdtype(f.dtype, np.floating) or f.shape[1] != rows[0].shape[1]:
            raise ValueError(f"features[{i}]: expected a float array [N, {rows[0].shape[-1]}], got {f.dtype} "
                             f"{f.shape}")
    return Normaliser.fit_spans(rows, [split.splits[i].boundary for i in split.instruments], name="split")


def stack_windows(values: Mapping[int, np.ndarray], ends: Mapping[int, np.ndarray],
                  length: int) -> tuple[np.ndarray, np.ndarray]:
    """Every instrument's :func:`~portable_ssm.market.windows` stacked, ids ascending:
    ``([sum n_i, length, *S], instrument id of each [sum n_i] int64)`` from ``values`` ``{id: [N_i, *S]}``
    and ``ends`` ``{id: [n_i] ints}`` (the same ids)."""
    if not isinstance(values, Mapping) or not isinstance(ends, Mapping) or set(values) != set(ends) or not ends:
        raise ValueError("values, ends: expected two non-empty mappings with the same instrument ids")
    ids = sorted(ends)
    stacked = np.concatenate([windows(values[i], ends[i], length) for i in ids])  # [sum n_i, length, *S]
    owner = np.concatenate([np.full(np.asarray(ends[i]).shape[0], i, dtype=np.int64) for i in ids])  # [sum n_i]
    return stacked, owner
