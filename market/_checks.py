"""Validation at the door for the market tooling, and its one file error.

Every size, horizon, order and split argument is an ``int`` (a NumPy integer too; never a bool or
a float) in a stated range, else TypeError / ValueError naming the argument, what was expected and
what came. Files are opened only when they are regular files (a FIFO, socket or device is refused
without a blocking open), and a malformed file is a :class:`MarketDataError` naming it.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from portable_ssm.io import paths


class MarketDataError(ValueError):
    """A market data file (DBN, csv, parquet) or run directory that is malformed, truncated, out of
    time order or not a regular file. The message names the file (and the record where one is at
    fault)."""


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int: TypeError unless it is an integer (bool is not), ValueError outside
    ``[minimum, maximum]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else minimum
        high = "inf" if maximum is None else maximum
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
    return value


def check_real(name: str, value: Any, *, low: float, high: float, open_low: bool = False,
               open_high: bool = False) -> float:
    """``value`` as a finite float in the interval (``open_*`` excludes that end); bool is refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    below = value <= low if open_low else value < low
    above = value >= high if open_high else value > high
    if not np.isfinite(value) or below or above:
        interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        raise ValueError(f"{name}: expected a number in {interval}, got {value}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` when it is one of ``choices`` (strings), else ValueError (TypeError for a non-string)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


def check_index_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a 1-D int64 array: TypeError for a non-integer (or bool) dtype, ValueError for another rank."""
    array = np.asarray(value)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name}: expected integer indices, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of indices, got shape {array.shape}")
    return array.astype(np.int64, copy=False)


def check_float_array(name: str, value: Any, *, ndim: int) -> np.ndarray:
    """``value`` as a float64 array of rank ``ndim`` (TypeError for a non-float dtype, ValueError for another rank)."""
    if type(value) is np.ndarray and value.dtype == np.float64 and value.ndim == ndim:
        return value  # already one (a stream's usual bar): no conversion calls
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"{name}: expected a floating array, got dtype {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected rank {ndim}, got shape {array.shape}")
    return array.astype(np.float64, copy=False)


def open_regular(path: str | os.PathLike) -> tuple[BinaryIO, int]:
    """``path`` opened for binary reading, and its size (:func:`portable_ssm.io.paths.open_regular`):
    MarketDataError naming the path unless it is a regular file (OSError, e.g. FileNotFoundError,
    when it cannot be opened at all)."""
    return paths.open_regular(path, what="data file", error=MarketDataError)


def as_path(name: str, value: Any) -> Path:
    """``value`` (str or os.PathLike) as a Path; TypeError for anything else."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a path (str or os.PathLike), got {type(value).__name__}")
    return Path(value)
