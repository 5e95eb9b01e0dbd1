"""CuPy: the raw-GPU backend (no PyTorch needed). The core runs on CuPy arrays as written."""

from __future__ import annotations

from typing import Any

import array_api_compat.cupy as xp
import cupy
import numpy as np

FAST_OPS: dict[str, Any] = {}


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    if name == "bfloat16":
        raise TypeError("dtype: cupy has no bfloat16 array dtype; use float16, float32 or float64")
    return getattr(cupy, name)


def _device(device: Any) -> cupy.cuda.Device:
    if device is None:
        return cupy.cuda.Device()
    if isinstance(device, str):
        platform, _, index = device.partition(":")
        if platform not in ("cuda", "gpu"):
            raise ValueError(f"device: cupy arrays live on 'cuda:N', got {device!r}")
        return cupy.cuda.Device(int(index or 0))
    return device if isinstance(device, cupy.cuda.Device) else cupy.cuda.Device(int(device))


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    with _device(device):
        out = cupy.asarray(np.asarray(host))
        return out if dtype_name is None else out.astype(dtype(dtype_name), copy=False)


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    with _device(device if device is not None else x.device):
        out = cupy.asarray(x)
        return out if dtype_name is None else out.astype(dtype(dtype_name), copy=False)


def to_numpy(x: Any) -> np.ndarray:
    return cupy.asnumpy(x)
