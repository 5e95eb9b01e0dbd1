"""array-api-strict: the standard and nothing else; the proof that the core is portable."""

from __future__ import annotations

from typing import Any

import array_api_strict as xp
import numpy as np

FAST_OPS: dict[str, Any] = {}


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    if not hasattr(xp, name):
        raise TypeError(f"dtype: array_api_strict has no {name}")
    return getattr(xp, name)


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    out = xp.asarray(np.asarray(host))
    return out if dtype_name is None else xp.astype(out, dtype(dtype_name))


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    return x if dtype_name is None else xp.astype(x, dtype(dtype_name))


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)
