"""NumPy's paths for low-precision weights (:mod:`portable_ssm.quantized`).

- :func:`bfloat16_bits`: float32 rounded to bfloat16 (nearest, ties to even), as ``uint16`` bits
  (NumPy has no bfloat16 dtype);
- :func:`quantized_matmul`: ``rows @ W.T`` for a quantized ``W``: the weight widened to float32
  (int8 times its row scales: the reference's values exactly) a tile of rows at a time
  (:func:`widen_rows`, at most QUANT_TILE_BYTES of float32), each tile multiplied by the float32
  GEMM as :func:`.ops.linear` does it (the rows split over the thread pool), so no float32 copy of a
  large matrix (an LM head) is made. One float32 row (a batch-1 decode step) goes through the
  compiled row product instead (:func:`.kernels.row_product`), which widens each weight as it
  reads it. torch's many-row product on CPU widens its tiles here too;
- :func:`take_rows`: the entries of a quantized weight an embedding lookup or a MoE block's choice
  takes, widened as those tiles are (:func:`widen`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels
from .ops import linear

#: Bytes of float32 one tile of widened weight rows takes at most (16 MiB: a 130m layer's in_proj
#: and out_proj are one tile each, a 50k-row LM head ten). Not a cache-sized tile: OpenBLAS's and
#: MKL's GEMMs with a few hundred output columns ran 1.5x to 3.8x slower per column than with
#: thousands on the 2-core AVX-512 VM (x [2048, 768]), while widening a whole in_proj costs about
#: 1.5 ms against its 110 ms product.
QUANT_TILE_BYTES = 16 << 20


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each finite float32 of ``x`` (ties to even), as ``uint16`` bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def widen(data: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """A quantized weight's storage ``data [..., in]`` (int8, or bfloat16 bits as ``uint16``) as
    float32: int8 times its row scales ``scale [...]`` (one rounding, as the reference's
    ``astype(q, float32) * scale``), bfloat16 bits as the high half of a float32."""
    if data.dtype == np.uint16:
        return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.multiply(data, scale[..., None], dtype=np.float32)


def widen_rows(data: np.ndarray, scale: np.ndarray | None, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``data [out, in]`` (scales ``[out]``) widened: float32 ``[stop - start, in]``."""
    return widen(data[start:stop], None if scale is None else scale[start:stop])


def take_rows(w: Any, ids: np.ndarray) -> np.ndarray:
    """``portable_ssm.quantized.take_rows_ref`` of NumPy arrays, to the bit: the entries ``ids [k]``
    along the first axis of the storage of the ``QuantizedWeight`` ``w`` (rows ``[k, in]`` or
    matrices ``[k, out, in]``), widened."""
    return widen(np.take(w.data, ids, axis=0), None if w.scale is None else np.take(w.scale, ids, axis=0))


def tile_ranges(out: int, d_in: int) -> list[tuple[int, int]]:
    """``(start, stop)`` tiles of a weight's ``out`` rows of ``d_in`` values: as few as keep each tile's
    float32 under :data:`QUANT_TILE_BYTES`, of equal size (to a row)."""
    most = max(1, QUANT_TILE_BYTES // (4 * max(d_in, 1)))
    tiles = max(1, -(-out // most))
    bounds = [out * i // tiles for i in range(tiles + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def quantized_matmul(rows: np.ndarray, weight: Any) -> np.ndarray:
    """``rows [m, in]`` (float32) times the :class:`~portable_ssm.quantized.QuantizedWeight`
    ``weight [out, in]`` transposed: ``[m, out]``, tile by tile of widened weight rows."""
    one_row = kernels.row_product(rows, weight.data, weight.scale)  # a decode step's row: read in place
    if one_row is not None:
        return one_row
    n, d_in = weight.shape
    out = np.empty((rows.shape[0], n), dtype=np.result_type(rows, np.float32))
    for start, stop in tile_ranges(n, d_in):
        linear(rows, widen_rows(weight.data, weight.scale, start, stop), out=out[:, start:stop])
    return out
