"""NumPy: the host backend. It also owns the random generator ``init_params`` draws from, so
every backend starts from the same numbers for the same seed, and registers the native paths of
:mod:`.ops` (in-place, cache-tiled conv, norm and scan) and :mod:`.quant` (the tiled quantized
matmul) as its fast ops."""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as xp
import numpy as np

from .attention import attend, write_slots
from .decode import decode_model_hook
from .experts import moe
from .hybrid import decode_hybrid_hook
from .ops import (
    causal_conv1d,
    causal_conv1d_silu,
    gated_activation,
    gated_rms_norm,
    linear,
    pass_states,
    silu_gate,
    ssd_chunked,
)
from .quant import bfloat16_bits, quantized_matmul, take_rows


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    if name == "bfloat16":
        raise TypeError("dtype: numpy has no bfloat16; use float32 or float64 (or torch/jax for bf16)")
    return getattr(np, name)


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    if device not in (None, "cpu"):
        raise ValueError(f"device: numpy arrays live on 'cpu', got {device!r}")
    out = np.asarray(host)
    return out if dtype_name is None else out.astype(dtype(dtype_name), copy=False)


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    return asarray(x, dtype_name, device)


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)


def rng(seed: int) -> np.random.Generator:
    """The generator behind ``init_params(seed=...)``."""
    return np.random.default_rng(seed)


FAST_OPS: dict[str, Any] = {"attend": attend, "causal_conv1d": causal_conv1d, "causal_conv1d_silu": causal_conv1d_silu,
                            "decode_hybrid": decode_hybrid_hook, "decode_model": decode_model_hook,
                            "gated_activation": gated_activation, "gated_rms_norm": gated_rms_norm, "linear": linear,
                            "moe": moe, "pass_states": pass_states, "quantized_matmul": quantized_matmul,
                            "silu_gate": silu_gate, "ssd_chunked": ssd_chunked, "take_rows": take_rows,
                            "write_slots": write_slots}

__all__ = ["FAST_OPS", "asarray", "bfloat16_bits", "convert", "dtype", "namespace", "rng", "to_numpy"]
