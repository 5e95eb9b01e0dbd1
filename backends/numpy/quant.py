"""NumPy's paths for low-precision weights (:mod:`portable_ssm.quantized`).

- :func:`bfloat16_bits`: float32 rounded to bfloat16 (nearest, ties to even), as ``uint16`` bits
  (NumPy has no bfloat16 dtype);
- :func:`quantized_matmul`: ``rows @ W.T`` for a quantized ``W``, widening it to float32 in tiles
  of QUANT_TILE_ROWS rows so each tile is multiplied while in cache and no float32 copy of the
  whole matrix is made; the int8 scales multiply the output columns, not the weight. One float32
  row (a batch-1 decode step) goes through the compiled row product instead
  (:func:`.kernels.row_product`), which widens each weight as it reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels

#: Weight rows widened to float32 at a time by :func:`quantized_matmul` (512 × 768 floats: 1.5 MiB).
QUANT_TILE_ROWS = 512


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each finite float32 of ``x`` (ties to even), as ``uint16`` bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _widen(data: np.ndarray) -> np.ndarray:
    """int8 values or bfloat16 ``uint16`` bits as float32."""
    if data.dtype == np.uint16:
        return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return data.astype(np.float32)


def quantized_matmul(rows: np.ndarray, weight: Any) -> np.ndarray:
    """``rows [m, in]`` (float32) times the :class:`~portable_ssm.quantized.QuantizedWeight`
    ``weight [out, in]`` transposed: ``[m, out]`` float32, tile by tile of weight rows."""
    one_row = kernels.row_product(rows, weight.data, weight.scale)  # a decode step's row: read in place
    if one_row is not None:
        return one_row
    n = weight.shape[0]
    out = np.empty((rows.shape[0], n), dtype=np.float32)
    for start in range(0, n, QUANT_TILE_ROWS):
        stop = min(start + QUANT_TILE_ROWS, n)
        tile = _widen(weight.data[start:stop])  # [tile, in]
        np.matmul(rows, tile.T, out=out[:, start:stop])
        if weight.scale is not None:
            out[:, start:stop] *= weight.scale[start:stop]
    return out
