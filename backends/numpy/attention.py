"""NumPy's attention over many queries (a prefill's), blocked: the ``attend`` fast op of
:func:`portable_ssm.blocks.attention.attend`; and ``write_slots``, a prompt's keys and values put
into the cache by assignment (the reference gathers each slot's token with one take per row).

The reference builds every score ``[b, kv, rep, l, m]`` at once and passes over it half a dozen
times (mask, max, exp, sum, divide, product): for a 2048-token prompt with 12 heads that is
200 MB a layer, read and written from memory each pass. Here each (row, KV head, tile of queries)
is one work item over the thread pool: its scores ``[rep, tile, last]`` stay within about 8 MiB,
where ``last`` is one past the last slot any of the tile's queries sees (the causal triangle's
columns beyond it are never computed), one matrix product gives the scores of all the KV head's
query heads, the mask is applied only from the first slot some query of the tile does not see (a
causal tile's diagonal block), and one product reads the values. The softmax runs in place: with the
compiled kernels, as their numerators in two passes (``kernels.masked_softmax``; the outputs are
divided by the sums after the values' product), else in NumPy's six. Each query's weights and
output are the reference's up to float32 rounding, a NaN or inf value included: it reaches the
queries that weigh its slot and no other (the values are multiplied finite, the few others added
one slot at a time).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels
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
    finite = np.isfinite(v)  # [b, kv, m, hd]
    values = np.where(seen[:, None, :, None] & finite, v, np.float32(0))  # [b, kv, m, hd]: multiplied as they are
    stray = [[np.flatnonzero(seen[i] & ~finite[i, j].all(axis=-1)) for j in range(kv)] for i in range(b)]
    tile = max(8, SCORE_BYTES // (4 * rep * m))
    items = [(i, j, start, min(l, start + tile)) for start in reversed(range(0, l, tile)) for i in range(b)
             for j in range(kv)]  # the last queries' tiles first: a causal tile's cost grows with its start

    def work(item: tuple[int, int, int, int]) -> None:
        i, j, start, stop = item
        t = stop - start
        mask = visible[i, start:stop]  # [t, m]
        seen_here, hidden_here = mask.any(axis=0), ~mask.all(axis=0)  # [m] each
        last = int(np.flatnonzero(seen_here)[-1]) + 1
        first = int(np.argmax(hidden_here[:last])) if hidden_here[:last].any() else last  # masking starts there
        queries = np.ascontiguousarray(grouped[i, j, :, start:stop]).reshape(rep * t, hd)  # [rep, t, hd] -> [rep·t, hd]
        scores = queries @ k[i, j, :last].T  # [rep·t, last]: one product for the group's heads
        inv = kernels.masked_softmax(scores, scale, mask[:, first:last], first)  # scores -> exp, in place
        if inv is None:
            tiled = scores.reshape(rep, t, last)  # [rep·t, last] -> [rep, t, last] (a view)
            tiled *= np.float32(scale)
            np.putmask(tiled[:, :, first:], ~np.broadcast_to(mask[None, :, first:last], tiled[:, :, first:].shape),
                       -np.inf)  # a causal tile: only its diagonal block
            tiled -= tiled.max(axis=-1, keepdims=True)
            np.exp(tiled, out=tiled)
            tiled /= tiled.sum(axis=-1, keepdims=True)
        weighted = scores @ values[i, j, :last]  # [rep·t, hd]
        for slot in stray[i][j][stray[i][j] < last]:  # a NaN or inf value: to the queries that weigh its slot only
            odd = np.where(finite[i, j, slot], np.float32(0), v[i, j, slot])  # [hd]: the values left out
            weight = scores[:, slot:slot + 1]  # [rep·t, 1]
            with np.errstate(invalid="ignore"):  # 0·inf, dropped by the where
                weighted += np.where(weight != 0, weight * odd, np.float32(0))
        weighted = weighted.reshape(rep, t, hd)  # [rep·t, hd] -> [rep, t, hd]
        if inv is None:
            out[i, j, :, start:stop] = weighted
        else:
            np.multiply(weighted, inv.reshape(rep, t, 1), out=out[i, j, :, start:stop])

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
