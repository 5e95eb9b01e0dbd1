"""Leak-free features, targets, windows and walk-forward splits over :class:`~portable_ssm.market.Bars`.

Bar t's features use bars t-1 and t only (``LOOKBACK`` = 2), so they are known when bar t closes;
row 0 is NaN. Targets look ahead by construction: ``forward_return(k)[t] = log(close[t+k] / close[t])``
(NaN where t+k is past the end); ``direction = forward_return > 0``. A window ending at bar e holds
feature rows e-L+1 .. e and predicts the target of each of its bars.

Walk-forward: a boundary B splits the bars. Training windows end at e <= B-1-k, so every target
they learn from lies before B; validation windows start at bar B + embargo or later, so no window
straddles the boundary. The normaliser is fitted on feature rows before B only and then frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bars import Bars

FEATURES = ("log_return", "log_range", "log_body", "log_volume", "volume_change")
"""The names of ``bar_features``' columns, in order."""
LOOKBACK = 2  # bars a feature row reads: the bar itself and the one before
"""Bars one feature row reads: the bar itself and the one before (the first row is NaN)."""
TARGETS = ("return", "direction")


def bar_features(bars: Bars) -> np.ndarray:
    """``[N, F]`` float64 features (``FEATURES``) of each bar from it and the bar before; row 0 NaN."""
    log_close, log_volume = np.log(bars.close), np.log1p(bars.volume)
    previous = np.concatenate([[np.nan], log_close[:-1]])  # [N]
    previous_volume = np.concatenate([[np.nan], log_volume[:-1]])  # [N]
    columns = (log_close - previous, np.log(bars.high / bars.low), log_close - np.log(bars.open),
               log_volume, log_volume - previous_volume)
    out = np.stack(columns, axis=-1)  # [N, F]
    out[0] = np.nan
    return out


def targets(bars: Bars, *, horizon: int, kind: str) -> np.ndarray:
    """``[N]`` float64: ``kind="return"`` -> log(close[t+k] / close[t]); ``"direction"`` -> 1.0 when
    that return is positive, else 0.0. NaN where t+k is past the end."""
    if kind not in TARGETS:
        raise ValueError(f"kind: expected one of {TARGETS}, got {kind!r}")
    if horizon < 1:
        raise ValueError(f"horizon: expected k >= 1 bars ahead, got {horizon}")
    log_close = np.log(bars.close)
    ahead = np.full(log_close.shape, np.nan)
    ahead[:-horizon] = log_close[horizon:] - log_close[:-horizon]
    if kind == "direction":
        return np.where(np.isnan(ahead), np.nan, (ahead > 0).astype(np.float64))
    return ahead


def trailing_return(bars: Bars, *, horizon: int) -> np.ndarray:
    """``[N]`` log(close[t] / close[t-k]) (NaN for t < k): the last k-bar return, known at t."""
    log_close = np.log(bars.close)
    out = np.full(log_close.shape, np.nan)
    out[horizon:] = log_close[horizon:] - log_close[:-horizon]
    return out


@dataclass(frozen=True)
class Normaliser:
    """Per-feature mean and standard deviation, fitted on a training span and then frozen."""

    mean: np.ndarray  # [F]
    std: np.ndarray  # [F]

    @classmethod
    def fit(cls, features: np.ndarray, stop: int) -> Normaliser:
        """Statistics of feature rows ``LOOKBACK - 1 .. stop - 1`` (rows before ``stop`` only)."""
        rows = features[LOOKBACK - 1:stop]
        if rows.shape[0] < 2:
            raise ValueError(f"stop: need at least 2 feature rows before it to fit, got {rows.shape[0]}")
        return cls(mean=rows.mean(axis=0), std=rows.std(axis=0) + 1e-12)

    def __call__(self, features: np.ndarray) -> np.ndarray:
        return (features - self.mean) / self.std


def windows(values: np.ndarray, ends: np.ndarray, length: int) -> np.ndarray:
    """``values[e-length+1 .. e]`` for each end e: ``[N, *S]`` -> ``[len(ends), length, *S]``."""
    ends = np.asarray(ends, dtype=np.int64)
    if ends.size and (ends.min() < length - 1 or ends.max() >= values.shape[0]):
        raise ValueError(f"ends: windows of {length} need ends in [{length - 1}, {values.shape[0] - 1}], "
                         f"got [{ends.min()}, {ends.max()}]")
    index = ends[:, None] - np.arange(length - 1, -1, -1)[None, :]  # [n, length]
    return values[index]


@dataclass(frozen=True)
class Split:
    """One walk-forward fold: the boundary bar and the window ends on each side."""

    boundary: int  # first bar that training never sees (features nor targets)
    train_ends: np.ndarray  # [n_train] int64
    val_ends: np.ndarray  # [n_val] int64


def walk_forward(n_bars: int, *, window: int, horizon: int, embargo: int, folds: int = 1,
                 val_fraction: float = 0.2, stride: int = 1) -> list[Split]:
    """``folds`` expanding-window splits whose validation spans tile the last ``val_fraction`` of
    the bars. Fold i trains on windows ending at ``e <= B_i - 1 - horizon`` (every ``stride`` bars)
    and validates on every window starting at ``B_i + embargo`` or later and ending before the next
    boundary (its targets must exist)."""
    if embargo < 0 or stride < 1 or folds < 1 or not 0 < val_fraction < 1:
        raise ValueError(f"embargo >= 0, stride >= 1, folds >= 1, 0 < val_fraction < 1 expected, got "
                         f"{embargo}, {stride}, {folds}, {val_fraction}")
    first = LOOKBACK - 1 + window - 1  # the first window whose rows all have features
    span = int(n_bars * val_fraction) // folds
    out = []
    for i in range(folds):
        boundary = n_bars - (folds - i) * span
        stop = min(boundary + span, n_bars - horizon)  # validation targets must exist
        train_ends = np.arange(first, boundary - horizon, stride, dtype=np.int64)
        val_ends = np.arange(boundary + embargo + window - 1, stop, dtype=np.int64)
        if train_ends.size < 1 or val_ends.size < 1:
            raise ValueError(f"n_bars: {n_bars} bars leave fold {i} with {train_ends.size} training and "
                             f"{val_ends.size} validation windows of {window} (need at least one each)")
        out.append(Split(boundary=boundary, train_ends=train_ends, val_ends=val_ends))
    return out
