"""NumPy's attention over many queries (a prefill's), blocked: the ``attend`` fast op of
:func:`portable_ssm.blocks.attention.attend`.

The reference builds every score ``[b, kv, rep, l, m]`` at once and passes over it half a dozen
times (mask, max, exp, sum, divide, product): for a 2048-token prompt with 12 heads that is
200 MB a layer, read and written from memory each pass. Here each (row, KV head, tile of queries)
is one work item over the thread pool: its scores ``[rep, tile, last]`` stay within about 2 MiB,
where ``last`` is one past the last slot any of the tile's queries sees (the causal triangle's
columns beyond it are never computed), softmax runs in place, and one matrix product per item
reads the values. Each query's weights and output are the reference's up to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .threads import run_all

#: Queries below which the reference runs (a decode step's, a short prompt's: nothing to block).
MIN_QUERIES = 64
#: Bytes of float32 scores one work item holds at most (its tile of queries sized to fit).
SCORE_BYTES = 2 << 20


def attend(q: Any, k: Any, v: Any, visible: Any, scale: float) -> np.ndarray | None:
    """``softmax(scale·q·kᵀ where visible) · v`` for ``q [b, h, l, hd]``, ``k, v [b, kv, m, hd]``
    float32 and ``visible [b, l, m]`` bool -> ``[b, h, l, hd]``, blocked over tiles of queries;
    None (the reference runs) for fewer than :data:`MIN_QUERIES` queries, other dtypes, or a query
    that sees no slot (left padding: the reference spreads it evenly)."""
    arrays = (q, k, v)
    if not (all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in arrays)
            and isinstance(visible, np.ndarray) and visible.dtype == np.bool_):
        return None
    b, h, l, hd = q.shape
    kv, m = k.shape[1], k.shape[2]
    if l < MIN_QUERIES or not visible.any(axis=2).all():
        return None
    rep = h // kv
    grouped = q.reshape(b, kv, rep, l, hd)  # [b, h, l, hd] -> [b, kv, rep, l, hd]
    out = np.empty((b, kv, rep, l, hd), dtype=np.float32)
    seen = visible.any(axis=1)  # [b, m]: slots some query of the row sees
    values = np.where(seen[:, None, :, None], v, np.float32(0))  # an unseen slot weighs exactly 0
    tile = max(8, SCORE_BYTES // (4 * rep * m))
    items = [(i, j, start, min(l, start + tile)) for i in range(b) for j in range(kv) for start in range(0, l, tile)]

    def work(item: tuple[int, int, int, int]) -> None:
        i, j, start, stop = item
        mask = visible[i, start:stop]  # [t, m]
        last = int(np.flatnonzero(mask.any(axis=0))[-1]) + 1
        scores = np.matmul(grouped[i, j, :, start:stop], k[i, j, :last].T)  # [rep, t, last]
        scores *= np.float32(scale)
        np.putmask(scores, ~np.broadcast_to(mask[None, :, :last], scores.shape), -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        np.matmul(scores, values[i, j, :last], out=out[i, j, :, start:stop])

    run_all(work, items, blas=True)
    return out.reshape(b, h, l, hd)  # [b, kv, rep, l, hd] -> [b, h, l, hd]
