"""NumPy's attention over many queries (a prefill's), blocked: the ``attend`` fast op of
:func:`portable_ssm.blocks.attention.attend`; and ``write_slots``, a prompt's keys and values put
into the cache by assignment (the reference gathers each slot's token with one take per row).

The reference builds every score ``[b, kv, rep, l, m]`` at once and passes over it half a dozen
times (mask, max, exp, sum, divide, product): for a 2048-token prompt with 12 heads that is
200 MB a layer, read and written from memory each pass. Here each (row, KV head, tile of queries)
is one work item over the thread pool: its scores ``[rep, tile, last]`` stay within about 8 MiB,
where ``last`` is one past the last slot any of the tile's queries sees (the causal triangle's
columns beyond it are never computed), the mask is applied only from the first slot some query of
the tile does not see (a causal tile's diagonal block), softmax runs in place, and one matrix
product per item reads the values. Each query's weights and output are the reference's up to
float32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .threads import run_all

#: Queries below which the reference runs (a decode step's, a short prompt's: nothing to block).
MIN_QUERIES = 64
#: Bytes of float32 scores one work item holds at most (its tile of queries sized to fit): few
#: enough items that NumPy's per-call cost stays small beside the work, small enough for the L3.
SCORE_BYTES = 8 << 20


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
        seen_here, hidden_here = mask.any(axis=0), ~mask.all(axis=0)  # [m] each
        last = int(np.flatnonzero(seen_here)[-1]) + 1
        first = int(np.argmax(hidden_here[:last])) if hidden_here[:last].any() else last  # masking starts there
        scores = np.matmul(grouped[i, j, :, start:stop], k[i, j, :last].T)  # [rep, t, last]
        scores *= np.float32(scale)
        np.putmask(scores[:, :, first:], ~np.broadcast_to(mask[None, :, first:last], scores[:, :, first:].shape),
                   -np.inf)  # a causal tile: only its diagonal block
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        np.matmul(scores, values[i, j, :last], out=out[i, j, :, start:stop])

    run_all(work, items, blas=True)
    return out.reshape(b, h, l, hd)  # [b, kv, rep, l, hd] -> [b, h, l, hd]


def write_slots(cache: Any, new: Any, start: Any) -> np.ndarray | None:
    """``cache [b, kv, m, hd]`` with row i's ``new [b, kv, l, hd]`` in its slots ``start[i] ..
    start[i]+l-1``, as a new array: the ``write_slots`` fast op of
    :func:`portable_ssm.blocks.attention._write` (a copy, then each row's slots assigned); None for
    other array types or where the dtypes differ."""
    if not (isinstance(cache, np.ndarray) and isinstance(new, np.ndarray) and isinstance(start, np.ndarray)
            and cache.dtype == new.dtype):
        return None
    out = cache.copy()
    l = new.shape[2]
    for i, first in enumerate(start.tolist()):
        out[i, :, first:first + l] = new[i]
    return out
