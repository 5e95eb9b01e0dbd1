"""Input validation at the door: ranks, symbolic shapes, dtypes, devices.

Errors name the argument, the expected shape in the shape legend's letters with the sizes
already bound, and the actual shape, e.g.::

    ValueError: B: expected shape [b, l, g, n] = [2, 16, 1, ?], got (2, 15, 1, 8) (l=16 from x)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._array import Array, Namespace, device, dtype_name, is_floating, same_device


class Shapes:
    """Binds the legend's letters to sizes as arguments are checked, so mismatches name both sides."""

    def __init__(self, **known: int) -> None:
        self._dims: dict[str, tuple[int, str]] = {k: (int(v), "config") for k, v in known.items()}

    def __getitem__(self, letter: str) -> int:
        return self._dims[letter][0]

    def bind(self, letter: str, size: int, source: str) -> None:
        """Binds ``letter`` to ``size`` (as read from ``source``) unless already bound."""
        self._dims.setdefault(letter, (int(size), source))

    def check(self, name: str, x: Array, spec: Sequence[str | int]) -> None:
        """Checks ``x.shape`` against ``spec`` (letters or fixed ints) and binds new letters."""
        shape = tuple(x.shape)
        if len(shape) != len(spec):
            raise ValueError(f"{name}: expected rank {len(spec)} with shape {self._show(spec)}, "
                             f"got rank {len(shape)} with shape {shape}")
        for letter, size in zip(spec, shape):
            if isinstance(letter, int):
                if size != letter:
                    raise ValueError(f"{name}: expected shape {self._show(spec)}, got {shape}")
                continue
            if letter in self._dims and self._dims[letter][0] != size:
                bound, source = self._dims[letter]
                raise ValueError(f"{name}: expected shape {self._show(spec)}, got {shape} "
                                 f"({letter}={bound} from {source})")
        for letter, size in zip(spec, shape):
            if isinstance(letter, str):
                self.bind(letter, size, name)

    def _show(self, spec: Sequence[str | int]) -> str:
        letters = ", ".join(str(s) for s in spec)
        sizes = ", ".join(str(s) if isinstance(s, int) else
                          str(self._dims[s][0]) if s in self._dims else "?" for s in spec)
        return f"[{letters}] = [{sizes}]"


def check_floating(name: str, x: Array, *, xp: Namespace) -> None:
    """TypeError unless ``x`` has a real floating dtype."""
    if not is_floating(xp, x):
        raise TypeError(f"{name}: expected a real floating dtype (float16, bfloat16, float32, float64), "
                        f"got {dtype_name(x.dtype)}")


def check_same_dtype(name: str, x: Array, ref_name: str, ref: Array) -> None:
    """TypeError unless ``x`` has the dtype of ``ref`` (no silent float32/float64 mixing)."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} is {dtype_name(x.dtype)} but {ref_name} is {dtype_name(ref.dtype)}; "
                        f"cast one of them explicitly (xp.astype; portable_ssm.cast_params for a parameter dict): "
                        f"mixed float dtypes are not promoted silently")


def check_same_device(name: str, x: Array, ref_name: str, ref: Array) -> None:
    """ValueError unless ``x`` lives on ``ref``'s device."""
    if not same_device(x, ref):
        raise ValueError(f"{name} is on device {device(x)} but {ref_name} is on {device(ref)}")


def check_dt_limit(dt_limit: Any) -> tuple[float, float]:
    """Validates a ``(low, high)`` clamp for Δ and returns it as floats."""
    try:
        low, high = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit: expected a pair (low, high) of numbers, got {dt_limit!r}") from None
    if not (0.0 <= low < high):
        raise ValueError(f"dt_limit: expected 0 <= low < high, got ({low}, {high})")
    return low, high


def check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """ValueError unless ``value`` is a positive int (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> int:
    """``value`` if it is an int ``>= minimum`` (or None when allowed): TypeError for a non-int
    (bool, float and str included), ValueError below the minimum."""
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_bool(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a bool (no 0/1, no strings)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


def check_given(**arrays: Any) -> None:
    """TypeError naming the first required array argument that is None."""
    for name, value in arrays.items():
        if value is None:
            raise TypeError(f"{name}: expected an array, got None")


#: The dtype names parameters and activations may take.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Every dtype name :func:`portable_ssm.to_backend` converts to.
DTYPE_NAMES = (*FLOAT_DTYPES, "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool")


def check_dtype_name(name: str, value: Any, allowed: tuple[str, ...] = FLOAT_DTYPES, *,
                     allow_none: bool = False) -> None:
    """ValueError unless ``value`` is one of the ``allowed`` dtype names (TypeError for a non-str)."""
    if value is None and allow_none:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a dtype name ({', '.join(allowed)}), got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
