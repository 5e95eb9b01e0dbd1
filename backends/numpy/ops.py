"""NumPy's native paths, each behind a core hook and tested against the core function it replaces.

They do what the array-API core cannot: update buffers in place and work tile by tile (or chunk
by chunk), so that every pass over an intermediate reads it from cache rather than memory.

- :func:`causal_conv1d`, :func:`causal_conv1d_silu`: the conv in tiles of about TILE_ELEMENTS
  elements, SiLU applied to each tile while it is in cache (in float32 with SiLU, the compiled
  kernel of :mod:`.kernels` where it is usable: one pass);
- :func:`gated_rms_norm`: the gated (or plain) RMSNorm in tiles of about TILE_ELEMENTS elements (in
  float32, :mod:`.kernels`' one pass where it is usable);
- :func:`gated_activation`: a gated MLP's ``silu(gate) · up`` in one pass (float32: :mod:`.kernels`;
  else the core's reference);
- :func:`silu_gate`: the Mamba-2 mixer's ``y · silu(z)`` without a norm (Falcon-H1's), one pass
  (float32: :mod:`.kernels`; else None and the core's reference);
- :func:`ssd_chunked`: the chunked scan as a loop over groups of SCAN_GROUP_CHUNKS chunks, heads in
  blocks of SCAN_HEAD_BLOCK (in float32, :mod:`.kernels`' compiled scan where it is usable: one C++
  pass per block of heads);
- :func:`pass_states`: the reference scan's state passing in place (used with ``seq_idx``, which
  the native scan hands to the reference).
"""

from __future__ import annotations

import math

import array_api_compat.numpy as xp
import numpy as np

from portable_ssm import ssd
from portable_ssm._array import compute_dtype
from portable_ssm.blocks.mlp import gated_activation_ref

from . import kernels
from .kernels import SCAN_HEAD_BLOCK  # read at each call: the loop and the compiled scan take it
from .threads import row_ranges, run_all, workers

#: Elements per tile of the native conv (``[b, steps, d]``) and gated RMSNorm (``[rows, d]``), at
#: least one step or row: 1 MiB of float32, so a tile's passes run in cache and each of its dozen
#: NumPy calls has work enough that the call's own cost stays small (a 130m layer's conv and norm at
#: l=2048 on 2 threads took 16% and 20% less time than in tiles of 32 steps or rows).
TILE_ELEMENTS = 1 << 18
#: Chunks the native scan takes through each NumPy call (but the state passing's, one per chunk).
SCAN_GROUP_CHUNKS = 4
#: Floats a new projection output's rows are widened by where they would be a multiple of 4 KiB.
ROW_PAD = 16
#: Rows of a projection or norm a worker takes at least.
PARALLEL_MIN_ROWS = 64


def linear(rows: np.ndarray, weight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``rows [m, in] @ weight.T -> [m, out]`` for ``portable_ssm.mixer._linear``'s 16 and more rows
    (a prefill's): the rows split over the thread pool, each worker's share through a one-thread
    BLAS. The scan, conv and norm then share the cores with no BLAS thread left spinning from the
    projection (OpenBLAS's idle threads spin for about 0.1 s after a call, and would take a core
    from every worker). ``out``: an ``[m, out]`` array (a column slice of a wider one too) written
    and returned instead of a new one; a new one whose rows would be a multiple of 4 KiB apart is a
    view of rows :data:`ROW_PAD` floats wider (OpenBLAS's stores to rows 4 KiB apart alias in the
    caches: a granite-shaped MLP's up projection, 2048 rows of 4096, ran about 8% faster so)."""
    m, n = rows.shape[0], weight.shape[0]
    if out is None:
        pad = ROW_PAD if n * 4 % 4096 == 0 else 0
        out = np.empty((m, n + pad), dtype=np.result_type(rows, weight))[:, :n]  # [m, n]: the first n of each row
    run_all(lambda part: np.matmul(rows[part[0]:part[1]], weight.T, out=out[part[0]:part[1]]),
            row_ranges(m, PARALLEL_MIN_ROWS), blas=True)
    return out


def _silu_(v: np.ndarray, scratch: np.ndarray, source: np.ndarray) -> np.ndarray:
    """SiLU of ``source`` into ``v`` (which may be ``source``), returned: ``source / (1 + exp(-source))``,
    which NumPy computes in about half the time of the core's ``h + h·tanh(h)`` (its float32 exp is
    faster than its tanh). Where ``exp(-source)`` overflows to inf the quotient is -0, SiLU's limit."""
    with np.errstate(over="ignore"):
        np.exp(np.negative(source, out=scratch), out=scratch)
    scratch += 1
    return np.divide(source, scratch, out=v)


def _conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, state: np.ndarray | None,
          activate: bool) -> tuple[np.ndarray, np.ndarray]:
    """The tiled conv, then SiLU on each tile while it is still in cache when ``activate``."""
    b, l, d = x.shape
    k = weight.shape[-1]
    dtype = np.result_type(x, weight, *(() if bias is None else (bias,)))
    if state is None:
        history = np.zeros((b, k - 1, d), dtype=x.dtype)
    else:
        history = np.swapaxes(state[:, :, 1:], 1, 2).astype(x.dtype, copy=False)  # [b, k-1, d]
    taps = np.ascontiguousarray(weight.T)  # [k, d]
    last = np.concatenate([history, x[:, max(l - k, 0):]], axis=1)[:, -k:]  # the last k inputs, [b, k, d]
    fused = kernels.conv_silu(x, taps, bias, history) if activate else None
    if fused is not None:
        return fused, np.swapaxes(last, 1, 2)  # [b, d, k]
    y = np.empty((b, l, d), dtype=dtype)
    steps_per_tile = max(1, TILE_ELEMENTS // (b * d))

    def tiles(steps: tuple[int, int]) -> None:  # the tiles from steps[0] to steps[1], one worker
        scratch = np.empty((b, min(steps_per_tile, l), d), dtype=dtype)
        for start in range(steps[0], steps[1], steps_per_tile):
            stop = min(start + steps_per_tile, steps[1])
            # the inputs k-1 steps before the tile through its end, [b, k-1+stop-start, d]: read in
            # place, but the first k-1 steps of the sequence need the history in front of them
            window = (x[:, start - (k - 1):stop] if start >= k - 1 else
                      np.concatenate([history[:, start:], x[:, :stop]], axis=1))
            out, term = y[:, start:stop], scratch[:, :stop - start]
            np.multiply(window[:, :stop - start], taps[0], out=out)
            for j in range(1, k):
                np.multiply(window[:, j:j + stop - start], taps[j], out=term)
                out += term
            if bias is not None:
                out += bias
            if activate:
                _silu_(out, term, out)

    tile_count = -(-l // steps_per_tile)
    run_all(tiles, ((start * steps_per_tile, min(stop * steps_per_tile, l))
                    for start, stop in row_ranges(tile_count, 1)))
    return y, np.swapaxes(last, 1, 2)  # [b, d, k]


def causal_conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                  state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Tiled version of ``portable_ssm.conv.causal_conv1d_ref``: the same sum of k shifted slices,
    accumulated in place tile by tile (TILE_ELEMENTS), so a tile's taps are read from
    cache rather than memory (about 2x on a 1024-step block of a 130m layer).
    ``x [b, l, d]``, weight ``[d, k]``, state ``[b, d, k]`` or None -> ``(y [b, l, d], state [b, d, k])``."""
    return _conv(x, weight, bias, state, activate=False)


def causal_conv1d_silu(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                       state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`causal_conv1d` with SiLU applied to each tile in cache, for
    ``portable_ssm.conv.causal_conv1d_silu`` (saves the four passes of a separate SiLU)."""
    return _conv(x, weight, bias, state, activate=True)


def gated_rms_norm(y: np.ndarray, z: np.ndarray | None, weight: np.ndarray, groups: int,
                   eps: float) -> np.ndarray:
    """Tiled version of ``portable_ssm.norm.gated_rms_norm_ref``: ``rmsnorm(y · silu(z))`` per group,
    a tile of about TILE_ELEMENTS elements at a time in place, so the gate, the mean square and
    the scaling of a tile all run in cache (about 1.5x). ``y, z [..., d]``, weight ``[d]`` -> weight's dtype."""
    *lead, d = y.shape
    cdtype = compute_dtype(xp, weight.dtype)
    rows_y = y.reshape(-1, d)  # [rows, d]
    rows_z = None if z is None else z.reshape(-1, d)  # [rows, d]
    fused = kernels.gated_rms_norm(rows_y, rows_z, weight, groups, eps)
    if fused is not None:
        return fused.reshape(*lead, d)  # [rows, d] -> [..., d]
    out = np.empty(rows_y.shape, dtype=cdtype)
    w = weight.astype(cdtype, copy=False)
    rows_per_tile = max(1, TILE_ELEMENTS // d)

    def tiles(rows: tuple[int, int]) -> None:  # the tiles of rows[0] to rows[1], one worker
        scratch = np.empty((min(rows_per_tile, rows[1] - rows[0]), d), dtype=cdtype)
        scale = np.empty((len(scratch), groups, 1), dtype=cdtype)
        for start in range(rows[0], rows[1], rows_per_tile):
            stop = min(start + rows_per_tile, rows[1])
            tile, tmp, s = out[start:stop], scratch[:stop - start], scale[:stop - start]
            if rows_z is not None:
                v = _silu_(tile, tmp, rows_z[start:stop])
                v *= rows_y[start:stop]
            elif rows_y.dtype == cdtype:
                v = rows_y[start:stop]  # read in place
            else:  # norms are taken in the compute dtype
                v = tile
                v[...] = rows_y[start:stop]
            v = v.reshape(stop - start, groups, d // groups)  # [t, g, d/g]
            # np.vecdot(v, v) as [t, g, 1, d/g] @ [t, g, d/g, 1]: as fast, and vecdot is NumPy >= 2 only
            np.matmul(v[..., None, :], v[..., :, None], out=s[..., None])
            s /= d // groups
            s += eps
            np.sqrt(s, out=s)
            np.reciprocal(s, out=s)
            np.multiply(v, s, out=_view(tile, v.shape))
            tile *= w

    run_all(tiles, row_ranges(len(rows_y), PARALLEL_MIN_ROWS), blas=True)
    return out.reshape(*lead, d).astype(weight.dtype, copy=False)


def gated_activation(u: np.ndarray, act: str) -> np.ndarray:
    """``portable_ssm.blocks.mlp.gated_activation_ref``: ``act(gate) · up`` of ``u [..., 2f]`` ->
    ``[..., f]``, SiLU in float32 through :func:`.kernels.gated_silu` (one pass, both workers;
    NumPy's five passes took about 5% of a granite-350m-shaped prefill), anything else the reference."""
    *lead, two_f = u.shape
    fused = kernels.gated_silu(u.reshape(-1, two_f)) if act == "silu" else None  # [rows, 2f] -> [rows, f]
    if fused is None:
        return gated_activation_ref(u, act, xp=xp)
    return fused.reshape(*lead, two_f // 2)  # [rows, f] -> [..., f]


def silu_gate(y: np.ndarray, z: np.ndarray) -> np.ndarray | None:
    """The ``silu_gate`` fast op of ``portable_ssm.mixer``: ``y · silu(z)`` of float32 ``y, z [..., d]``
    through :func:`.kernels.silu_gate` (the rows flattened, as views where the strides allow); None,
    and the reference runs, for other dtypes or shapes or where the kernels are off."""
    if y.shape != z.shape or y.ndim == 0 or y.dtype != np.float32 or z.dtype != np.float32:
        return None
    d = y.shape[-1]
    fused = kernels.silu_gate(y.reshape(-1, d), z.reshape(-1, d))  # [..., d] -> [rows, d] each
    return None if fused is None else fused.reshape(y.shape)  # [rows, d] -> [..., d]


def pass_states(state: np.ndarray, chunk_decay: np.ndarray, Bt: np.ndarray, X: np.ndarray,
                C: np.ndarray, inject: np.ndarray | None = None,
                carried: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """In-place version of ``portable_ssm.ssd.pass_states_ref``: each chunk's ``C_c S_in[c]`` is
    written straight into one output array and the state is updated in place (in a copy: the
    caller's state is never modified), so no per-chunk temporaries or final stack are allocated
    (about 10% of a 130m layer's forward at l=2048). Shapes as the reference: state
    ``[b, g, n, r, p]``, chunk_decay ``[b, c, g, 1, r, 1]``, Bt ``[b, c, g, n, Q]``, X ``[b, c, g, Q, r·p]``,
    C ``[b, c, g, Q, n]`` -> ``(outputs [b, c, g, Q, r·p], final state [b, g, n, r, p])``; with
    ``inject [b, c, g, n, r, p]`` added to each leaving state, the stack of them instead of the last;
    where ``carried [b, c, 1, 1, 1, 1]`` is False the state is set to 0 (not scaled by a 0 decay:
    0·nan is nan) before the chunk's own part is added."""
    b, g, n, r, p = state.shape
    c, Q = C.shape[1], C.shape[3]
    dtype = np.result_type(state, chunk_decay, Bt, X, C, *(() if inject is None else (inject,)))
    outputs = np.empty((b, c, g, Q, r * p), dtype=dtype)
    leaving = None if inject is None else np.empty((b, c, g, n, r, p), dtype=dtype)
    final = np.array(state, dtype=dtype, order="C")  # [b, g, n, r, p], updated in place
    flat = _view(final, (b, g, n, r * p))
    added = np.empty((b, g, n, r * p), dtype=dtype)
    for i in range(c):
        np.matmul(C[:, i], flat, out=outputs[:, i])  # the state entering chunk i, read by its C
        np.matmul(Bt[:, i], X[:, i], out=added)  # what chunk i adds
        final *= chunk_decay[:, i]
        if carried is not None:  # the entering sequence ended inside chunk i
            np.copyto(final, 0, where=np.logical_not(carried[:, i]))
        flat += added
        if leaving is not None:
            final += inject[:, i]
            leaving[:, i] = final
    return outputs, final if leaving is None else leaving


def _view(v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``v`` reshaped without a copy (ValueError if it would need one): a target of in-place updates."""
    out = np.reshape(v, shape)  # reshape's copy=False is NumPy >= 2.1
    if not np.may_share_memory(out, v):
        raise ValueError(f"cannot view an array of shape {v.shape} as {shape} without a copy")
    return out


def ssd_chunked(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
                chunk_size: int | None, initial_states: np.ndarray | None,
                seq_idx: np.ndarray | None = None, D: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``portable_ssm.ssd.ssd_chunked_ref`` as loops over groups of chunks whose intermediates stay
    in cache: the heads are scanned in blocks of at most SCAN_HEAD_BLOCK heads of one group
    (:func:`_scan_heads`), so a block's state and a group's ``[chunks, heads, Q, Q]`` decays fit in L2, and
    every block writes its heads of y in place into one output array: no segment concatenation, no
    padding (the last chunk is just shorter), Δ folded into the decays instead of a scaled copy of
    x, and a per-head skip D added to the diagonal of the decays. Packed rows (``seq_idx``) take
    the reference; float32 takes :func:`.kernels.ssd_chunked` (the same arithmetic in C++) where it
    is usable.

    One difference from the reference, far below rounding: inside a chunk, decay factors below
    ``exp(floor)`` (``floor`` as in ``portable_ssm.ssd.decay``, about 1e-19 in float32) are held at
    that value instead of flushed to 0 (a clamp costs one pass, a masked flush three), which keeps
    subnormals out of the matmuls just the same. A group of chunks whose output comes out non-finite
    is recomputed through masked products (:func:`_group_output` with ``safe``), so a non-finite input
    never reaches an earlier step; finite input pays one ``isfinite`` pass per group. Shapes as the
    reference: ``x [b, l, h, p]``, Δ ``[b, l, h]``, A ``[h]``, B, C ``[b, l, g, n]``, D ``[h]``, ``[h, p]`` or None,
    initial_states ``[b, h, p, n]`` or None -> ``(y [b, l, h, p], final_states [b, h, p, n])``."""
    if seq_idx is not None:
        return ssd.ssd_chunked_ref(x, dt, A, B, C, chunk_size=chunk_size, initial_states=initial_states,
                                   xp=xp, seq_idx=seq_idx, D=D)
    compiled = kernels.ssd_chunked(x, dt, A, B, C, chunk_size, initial_states, D, SCAN_HEAD_BLOCK)
    if compiled is not None:
        return compiled
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    Q = ssd.chunk_length(l, chunk_size)
    dtype = np.result_type(x, dt, A, B, C, *(() if D is None else (D,)))
    y = np.empty((b, l, h, p), dtype=dtype)
    final = np.empty((b, h, p, n), dtype=dtype)

    def scan(heads: slice) -> None:
        final[:, heads] = _scan_heads(
            x[:, :, heads], dt[:, :, heads], A[heads], B[:, :, heads.start // r], C[:, :, heads.start // r],
            None if D is None else D[heads], None if initial_states is None else initial_states[:, heads],
            Q, y[:, :, heads], dtype)

    block = min(SCAN_HEAD_BLOCK, -(-r // min(workers(), r)))  # every worker gets a block of a group
    run_all(scan, (slice(h0, min(h0 + block, (k + 1) * r)) for k in range(g)
                   for h0 in range(k * r, (k + 1) * r, block)), blas=True)  # blocks of heads inside group k
    return y, final


def _scan_heads(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
                D: np.ndarray | None, initial_states: np.ndarray | None, Q: int, y: np.ndarray,
                dtype: np.dtype) -> np.ndarray:
    """The scan of ``r`` heads reading one group, in groups of SCAN_GROUP_CHUNKS chunks: ``x [b, l, r, p]``,
    Δ ``[b, l, r]``, A ``[r]``, B, C ``[b, l, n]``, D ``[r]``, ``[r, p]`` or None, initial_states
    ``[b, r, p, n]`` or None; y ``[b, l, r, p]`` (a view of the output) is written in place. Returns
    the final state ``[b, r, p, n]``. The chunks of a group share every NumPy call but the three
    that pass the state on, so a chunk costs a few calls rather than twenty (a call's own cost, and
    on several threads its wait for the GIL, was about a third of the scan in chunks of one)."""
    b, l, r, p = x.shape
    n = B.shape[-1]
    floor = dtype.type(ssd.decay_floor(dtype, xp=xp))
    if initial_states is None:
        state = np.zeros((b, n, r, p), dtype=dtype)
    else:  # [b, r, p, n] -> [b, n, r, p], n-major like the reference; a copy, updated in place
        state = np.array(initial_states.transpose(0, 3, 1, 2), dtype=dtype, order="C")
    flat = _view(state, (b, n, r * p))
    above = np.triu(np.full((Q, Q), -np.inf, dtype=dtype), 1)  # -inf where j > i, else 0
    upper = np.triu(np.ones((Q, Q), dtype=bool), 1)  # j > i
    below = np.tril(np.ones((Q, Q), dtype=dtype), -1)  # 1 where k > j, else 0
    # the per-step decays of every chunk at once, Δ zero-padded to whole chunks (a padded step
    # neither decays nor feeds): [b, r, c, Q], and the factors laid out as each chunk reads them
    c = -(-l // Q)
    step = np.zeros((b, r, c * Q), dtype=dtype)
    step[..., :l] = dt.transpose(0, 2, 1)  # Δ [b, r, c·Q]
    a_all = (step * A[:, None]).reshape(b, r, c, Q)  # A·Δ <= 0 per chunk
    acs_all = np.cumsum(a_all, axis=-1)  # from the chunk's start
    # float32: the segsum as differences of float64 prefix sums, which keep the digits a float32
    # difference would lose (error ~1e-16·|Σ A·Δ|), at a tenth of the cost of the column sums float64 takes
    prefix = np.cumsum(a_all, axis=-1, dtype=np.float64) if dtype == np.float32 else a_all
    suffix = np.zeros_like(a_all)  # Σ_{k>s} A·Δ_k: a suffix sum, not acs[-1] - acs[s] (which loses its digits)
    np.cumsum(a_all[..., :0:-1], axis=-1, out=suffix[..., -2::-1])
    from_start = np.ascontiguousarray(ssd.decay(acs_all, xp=xp).transpose(0, 2, 3, 1))  # [b, c, Q, r]
    to_end = ssd.decay(suffix, xp=xp) * step.reshape(b, r, c, Q)  # Δ decayed to the chunk's end
    to_end = np.ascontiguousarray(to_end.transpose(0, 2, 3, 1))  # [b, c, Q, r]
    # each head's decay over a whole chunk, repeated over its p columns of the flat state: [b, c, r·p]
    chunk_decay = np.repeat(ssd.decay(acs_all[..., -1], xp=xp).transpose(0, 2, 1), p, axis=-1)
    a_chunks = prefix.transpose(0, 2, 1, 3)  # [b, r, c, Q] -> [b, c, r, Q], a view
    step_chunks = step.reshape(b, r, c, Q).transpose(0, 2, 1, 3)  # [b, r, c·Q] -> [b, c, r, Q], a view
    whole = l // Q  # whole chunks go in groups of G; a shorter last one makes a group of its own
    G = max(1, min(SCAN_GROUP_CHUNKS, whole))
    groups = [(i, min(i + G, whole), Q) for i in range(0, whole, G)]  # (first chunk, end, chunk length)
    if c > whole:
        groups.append((whole, c, l - whole * Q))
    # one flat buffer per intermediate, viewed as a contiguous array of each group's shape
    buffers = [np.empty(size, dtype=dtype) for size in (b * G * r * Q * Q, b * G * Q * r * p, b * G * n * r * p,
                                                        b * G * Q * r * p)]
    for i0, i1, q in groups:
        k, t0 = i1 - i0, i0 * Q
        t1 = t0 + k * q
        M, Xd, added, Y_off = (v[:math.prod(s)].reshape(s) for v, s in zip(
            buffers, ((b, k, r, q, q), (b, k, q, r, p), (b, k, n, r * p), (b, k, q, r, p))))
        Cc = C[:, t0:t1].reshape(b, k, q, n)  # [b, k·q, n] -> [b, k, q, n]
        Bt = np.swapaxes(B[:, t0:t1].reshape(b, k, q, n), 2, 3)  # [b, k·q, n] -> [b, k, n, q]
        xc = x[:, t0:t1].reshape(b, k, q, r, p)  # [b, k·q, r, p] -> [b, k, q, r, p]
        out = _view(y[:, t0:t1], (b, k, q, r, p))  # [b, k·q, r, p] -> [b, k, q, r, p], written in place
        # what each chunk adds to the state; then the state passed through the group, the state
        # entering each chunk read by that chunk's C (the outputs' off-diagonal part)
        np.multiply(xc, to_end[:, i0:i1, :q, :, None], out=Xd)
        np.matmul(Bt, _view(Xd, (b, k, q, r * p)), out=added)  # [b, k, n, r·p]
        off = _view(Y_off, (b, k, q, r * p))
        for j in range(k):
            np.matmul(Cc[:, j], flat, out=off[:, j])  # [b, q, r·p]
            flat *= chunk_decay[:, i0 + j, None, :]  # [b, n, r·p] by [b, 1, r·p]: one contiguous row per state row
            flat += added[:, j]
        Y_off *= from_start[:, i0:i1, :q, :, None]  # decayed to each step
        blocks = (a_chunks[:, i0:i1, :, :q], step_chunks[:, i0:i1, :, :q], Bt, Cc, xc, Y_off, D, above[:q, :q],
                  below[:q, :q], floor, M, out)
        _group_output(*blocks, safe=False)
        if not np.isfinite(out).all():  # a non-finite input: redo the group so it cannot reach earlier steps
            _group_output(*blocks, safe=upper[:q, :q])
    return state.transpose(0, 2, 3, 1)  # [b, n, r, p] -> [b, r, p, n]


def _group_output(a: np.ndarray, step: np.ndarray, Bt: np.ndarray, Cc: np.ndarray, xc: np.ndarray,
                  Y_off: np.ndarray, D: np.ndarray | None, above: np.ndarray, below: np.ndarray,
                  floor: np.floating, M: np.ndarray, out: np.ndarray, *, safe: np.ndarray | bool) -> None:
    """The outputs of ``k`` chunks of ``q`` steps into ``out [b, k, q, r, p]``: each chunk's diagonal
    block ``((C Bᵀ) ⊙ exp(segsum) · Δ_j) x`` plus ``Y_off [b, k, q, r, p]``, the entering states'
    part. ``a``, ``step`` ``[b, k, r, q]`` (A·Δ, or for float32 its float64 prefix sums; Δ),
    ``Bt [b, k, n, q]``, ``Cc [b, k, q, n]``, ``xc [b, k, q, r, p]``; ``M`` is scratch. ``safe``
    (the ``[q, q]`` mask of j > i) keeps non-finite inputs of step t out of every row before t
    (0·nan is nan in a matmul): the upper triangle of M is zeroed after its products, non-finite
    x·Δ enter the matmul as 0 and come back as nan for rows t and after (``portable_ssm.ssd.poison``)."""
    b, k, q, r, p = xc.shape
    if a.dtype == M.dtype:  # segsum as a cumulative sum down each column (ssd.stable_segsum)
        np.multiply(a[..., :, None], below, out=M)  # a non-finite a[s] spills only into rows s and after
        np.add.accumulate(M, axis=-2, out=M)  # [b, k, r, q, q]
    else:  # float32 M from float64 prefix sums (a non-finite one reaches rows before it only above
        np.subtract(a[..., :, None], a[..., None, :], out=M, casting="same_kind")  # the diagonal: see safe)
    np.maximum(M, floor, out=M)
    M += above
    np.exp(M, out=M)
    M *= step[..., None, :]
    M *= np.matmul(Cc, Bt)[:, :, None]  # C Bᵀ once for all heads, [b, k, 1, q, q]
    if D is not None and D.ndim == 1:  # y_t += D·x_t through M's diagonal
        _view(M, (b, k, r, q * q))[..., ::q + 1] += D[:, None]
    xh = xc.transpose(0, 1, 3, 2, 4)  # [b, k, r, q, p]: a strided view, which the BLAS reads in place
    if safe is not False:
        np.copyto(M, 0, where=safe)
        X = xh * step[..., None]  # x·Δ, [b, k, r, q, p]
        xh = np.where(np.isfinite(X), xh, 0)
    np.matmul(M, xh, out=out.transpose(0, 1, 3, 2, 4))
    if safe is not False:
        out += ssd.poison(X, axis=-2, xp=xp).transpose(0, 1, 3, 2, 4)
    out += Y_off
    if D is not None and D.ndim == 2:
        out += xc * D
