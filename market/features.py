"""Leak-free features, targets, windows and walk-forward splits over :class:`~portable_ssm.market.Bars`.

Bar t's features use bars t-1 and t only (``LOOKBACK`` = 2), so they are known when bar t closes;
row 0 is NaN. Targets look ahead by construction: ``forward_return(k)[t] = log(close[t+k] / close[t])``
(NaN where t+k is past the end); ``direction = forward_return > 0``. A window ending at bar e holds
feature rows e-L+1 .. e and predicts the target of each of its bars.

Walk-forward: a boundary B splits the bars. Training windows end at e <= B-1-k, so every target
they learn from lies before B; validation windows start at bar B + embargo or later, so no window
straddles the boundary. The normaliser is fitted on feature rows before B only and then frozen.

Missing data: a bar with a non-finite or non-positive price or a negative or non-finite volume is
missing; its feature row and the next one (which reads it) are NaN, and no other row changes.
:meth:`Normaliser.fit` skips rows holding a NaN (its statistics equal those of the span with those
rows deleted, bit for bit), so a NaN bar never turns another bar's normalised features NaN;
:func:`model_inputs` then reads a NaN feature as 0 (the training mean), in training and streaming
alike. Nothing here reads a bar later than the row it computes, except :func:`targets` by definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._checks import check_choice, check_float_array, check_index_array, check_int, check_real
from .bars import Bars

FEATURES = ("log_return", "log_range", "log_body", "log_volume", "volume_change")
"""The names of ``bar_features``' columns, in order."""
LOOKBACK = 2  # bars a feature row reads: the bar itself and the one before
"""Bars one feature row reads: the bar itself and the one before (the first row is NaN)."""
TARGETS = ("return", "direction")


def feature_rows(previous_log_close: np.ndarray, previous_log_volume: np.ndarray, o: np.ndarray, h: np.ndarray,
                 lo: np.ndarray, c: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The feature rows ``[n, F]`` of n bars given the log close and log1p volume of the bar before
    each (NaN: none or missing), and each bar's own ``(log close, log1p volume)`` for the next call.
    :func:`bar_features` and the streaming predictors' NumPy paths both compute features through it,
    so such a streamed row equals the batch row bit for bit; the compiled bar
    (``portable_ssm.backends.numpy.rows.MarketBar``) computes the same formulas in C, whose ``log``
    and ``log1p`` may differ from NumPy's in the last bit."""
    prices = np.array([o, h, lo, c])  # [4, n] (np.array: np.stack's checks cost a stream's bar more than this)
    present = (np.isfinite(prices) & (prices > 0)).all(axis=0) & np.isfinite(v) & (v >= 0)
    o, h, lo, c = np.where(present, prices, np.nan)  # [n] each: a missing bar is NaN throughout
    v = np.where(present, v, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        log_close, log_volume = np.log(c), np.log1p(v)
        rows = np.array([log_close - previous_log_close, np.log(h / lo), log_close - np.log(o), log_volume,
                         log_volume - previous_log_volume]).T  # [F, n] -> [n, F]
    return rows, log_close, log_volume


def bar_features(bars: Bars) -> np.ndarray:
    """``[N, F]`` float64 features (``FEATURES``) of each bar from it and the bar before; row 0 NaN,
    and a missing bar's row and the next NaN (see the module docstring)."""
    if not isinstance(bars, Bars):
        raise TypeError(f"bars: expected Bars, got {type(bars).__name__}")
    nan = np.full(1, np.nan)
    _, log_close, log_volume = feature_rows(nan, nan, bars.open, bars.high, bars.low, bars.close, bars.volume)
    previous_close = np.concatenate([nan, log_close[:-1]])  # [N]
    previous_volume = np.concatenate([nan, log_volume[:-1]])  # [N]
    out = feature_rows(previous_close, previous_volume, bars.open, bars.high, bars.low, bars.close, bars.volume)[0]
    out[:1] = np.nan
    return out


def targets(bars: Bars, *, horizon: int, kind: str) -> np.ndarray:
    """``[N]`` float64: ``kind="return"`` -> log(close[t+k] / close[t]); ``"direction"`` -> 1.0 when
    that return is positive, else 0.0. NaN where t+k is past the end or either bar is missing.
    ``horizon`` k: an int >= 1 (ValueError otherwise: k <= 0 would make a target of the past)."""
    kind = check_choice("kind", kind, TARGETS)
    horizon = check_int("horizon", horizon, minimum=1)
    log_close = _log_close(bars)
    ahead = np.full(log_close.shape, np.nan)
    ahead[:-horizon] = log_close[horizon:] - log_close[:-horizon]
    if kind == "direction":
        return np.where(np.isnan(ahead), np.nan, (ahead > 0).astype(np.float64))
    return ahead


def _log_close(bars: Bars) -> np.ndarray:
    if not isinstance(bars, Bars):
        raise TypeError(f"bars: expected Bars, got {type(bars).__name__}")
    nan = np.full(1, np.nan)
    return feature_rows(nan, nan, bars.open, bars.high, bars.low, bars.close, bars.volume)[1]


def trailing_return(bars: Bars, *, horizon: int) -> np.ndarray:
    """``[N]`` log(close[t] / close[t-k]) (NaN for t < k): the last k-bar return, known at t;
    ``horizon`` k an int >= 1 (k <= 0 would read the future)."""
    horizon = check_int("horizon", horizon, minimum=1)
    log_close = _log_close(bars)
    out = np.full(log_close.shape, np.nan)
    out[horizon:] = log_close[horizon:] - log_close[:-horizon]
    return out


@dataclass(frozen=True)
class Normaliser:
    """Per-feature mean and standard deviation, fitted on a training span and then frozen.

    ``mean [F]`` finite, ``std [F]`` finite and positive (ValueError otherwise)."""

    mean: np.ndarray  # [F]
    std: np.ndarray  # [F]

    def __post_init__(self) -> None:
        mean, std = check_float_array("mean", self.mean, ndim=1), check_float_array("std", self.std, ndim=1)
        if mean.shape != std.shape:
            raise ValueError(f"std: expected shape {mean.shape} like mean, got {std.shape}")
        if not np.isfinite(mean).all() or not (np.isfinite(std) & (std > 0)).all():
            raise ValueError(f"mean, std: expected finite means and finite positive deviations, got {mean}, {std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @classmethod
    def fit(cls, features: np.ndarray, stop: int) -> Normaliser:
        """Statistics of the feature rows ``LOOKBACK - 1 .. stop - 1`` (rows before ``stop`` only)
        that hold no NaN: equal bit for bit to those of the span with such rows deleted.
        ``features [N, F]`` float; ``stop`` an int in ``[LOOKBACK + 1, N]``."""
        features = check_float_array("features", features, ndim=2)
        stop = check_int("stop", stop, minimum=LOOKBACK + 1, maximum=features.shape[0])
        return cls.fit_spans([features], [stop], name="stop")

    @classmethod
    def fit_spans(cls, features: list[np.ndarray], stops: list[int], *, name: str = "stops") -> Normaliser:
        """Statistics pooled over several series' training spans: rows ``LOOKBACK - 1 .. stops[i] - 1``
        of each ``features[i] [N_i, F]`` (checked float arrays, ``0 <= stops[i] <= N_i``) without NaN;
        one series gives exactly :meth:`fit`. ValueError naming ``name`` when fewer than 2 rows remain."""
        rows = np.concatenate([f[LOOKBACK - 1:max(stop, LOOKBACK - 1)] for f, stop in zip(features, stops)])
        rows = rows[np.isfinite(rows).all(axis=1)]  # [n_finite, F]
        if rows.shape[0] < 2:
            raise ValueError(f"{name}: need at least 2 feature rows without NaN before it to fit, got {rows.shape[0]}")
        return cls(mean=rows.mean(axis=0), std=rows.std(axis=0) + 1e-12)

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """``features [..., F]`` -> normalised ``[..., F]`` (NaN stays NaN, row by row)."""
        features = np.asarray(features)
        if features.ndim < 1 or features.shape[-1] != self.mean.shape[0]:
            raise ValueError(f"features: expected shape [..., {self.mean.shape[0]}], got {features.shape}")
        return (features - self.mean) / self.std


def model_inputs(features: np.ndarray, normaliser: Normaliser) -> np.ndarray:
    """What the model reads: ``normaliser(features)`` as float32 with every non-finite value 0 (the
    training mean), ``[..., F]``. Training, batch prediction and streaming all go through it."""
    x = normaliser(features)
    return np.where(np.isfinite(x), x, 0.0).astype(np.float32)


def windows(values: np.ndarray, ends: np.ndarray, length: int) -> np.ndarray:
    """``values[e-length+1 .. e]`` for each end e: ``[N, *S]`` -> ``[len(ends), length, *S]``;
    ``length`` an int >= 1, ``ends`` integers in ``[length - 1, N - 1]``."""
    length = check_int("length", length, minimum=1)
    ends = check_index_array("ends", ends)
    values = np.asarray(values)
    if values.ndim < 1:
        raise ValueError(f"values: expected an array of rank >= 1, got shape {values.shape}")
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
    boundary (its targets must exist). Every argument is an int (``val_fraction`` a float in
    (0, 1)): ``window``, ``horizon``, ``stride``, ``folds`` >= 1, ``embargo`` >= 0; TypeError /
    ValueError naming it otherwise, and ValueError when a fold would be empty."""
    n_bars = check_int("n_bars", n_bars, minimum=1)
    window, horizon = check_int("window", window, minimum=1), check_int("horizon", horizon, minimum=1)
    embargo, stride = check_int("embargo", embargo, minimum=0), check_int("stride", stride, minimum=1)
    folds = check_int("folds", folds, minimum=1)
    val_fraction = check_real("val_fraction", val_fraction, low=0.0, high=1.0, open_low=True, open_high=True)
    span = int(n_bars * val_fraction) // folds
    out = []
    for i in range(folds):
        boundary = n_bars - (folds - i) * span
        split = split_at(boundary, boundary + span, n_bars, window=window, horizon=horizon, embargo=embargo,
                         stride=stride)
        train_ends, val_ends = split.train_ends, split.val_ends
        if train_ends.size < 1 or val_ends.size < 1:
            raise ValueError(f"n_bars: {n_bars} bars leave fold {i} with {train_ends.size} training and "
                             f"{val_ends.size} validation windows of {window} (need at least one each)")
        out.append(split)
    return out


def split_at(boundary: int, stop: int, n_bars: int, *, window: int, horizon: int, embargo: int,
             stride: int = 1) -> Split:
    """The windows on each side of bar ``boundary`` (ints, checked by the caller): training windows
    end at ``e <= boundary - 1 - horizon`` every ``stride`` bars from the first whose rows all have
    features; validation windows start at ``boundary + embargo`` or later and end before ``stop``
    and ``n_bars - horizon`` (their targets must exist). Either side may be empty."""
    first = LOOKBACK - 1 + window - 1  # the first window whose rows all have features
    train_ends = np.arange(first, boundary - horizon, stride, dtype=np.int64)
    val_ends = np.arange(boundary + embargo + window - 1, min(stop, n_bars - horizon), dtype=np.int64)
    return Split(boundary=boundary, train_ends=train_ends, val_ends=val_ends)
