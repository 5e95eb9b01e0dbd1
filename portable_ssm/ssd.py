"""The chunked SSD scan (Mamba-2's state-space duality), matmul based and linear in length.

Shape legend: b batch, l length, h heads, p headdim, g groups, r = h/g heads per group,
n state size, Q chunk size, c chunks. With ``X = x·Δ`` and ``a = A·Δ`` (MAMBA2_SPEC.md):

1. diagonal blocks:  ``Y_diag = ((C Bᵀ) ⊙ exp(segsum(a))) X``   (C Bᵀ once per group)
2. chunk states:     ``S_c = Σ_t exp(a[t+1] + ... + a[-1]) · outer(X_t, B_t)``
3. state passing:    ``S_in[c+1] = exp(acs_c[-1]) · S_in[c] + S_c``
4. state -> output:  ``Y_off[t] = exp(acs[t]) · (S_in[c] @ C_t)``

Steps 2 to 4 run chunk by chunk (:func:`pass_states`), so one state is alive at a time; long
sequences are processed in segments of whole chunks with the state carried across, so the extra
memory is bounded by the segment, not by l, and a segment's intermediates stay in cache.

Packed sequences (``seq_idx``) reset the state at every boundary through masks, never through
data-dependent shapes (mamba_ssm's rule): L keeps pairs inside one sequence, a chunk state only
the chunk's last sequence, the entering state only reaches positions of the sequence that was
running when the chunk began, and it is carried past the chunk only if that sequence still runs
at the chunk's end.

``segsum[i, j] = a[j+1] + ... + a[i]`` is summed step by step (:func:`stable_segsum`), never taken as
``acs[i] - acs[j]``: the difference loses the digits of one huge ``|A·Δ|`` for every later pair.

Non-finite input stays causal: a NaN or inf in x, Δ, B or C at step t reaches no output before t.
The diagonal block's mask is applied with ``where`` after the products (0·nan is nan), non-finite
``X`` enter its matmul as 0 and come back as nan from t on (:func:`poison`), so the outputs that
turn non-finite are those the recurrence turns non-finite. It also stays inside its sequence: in
packed rows every boundary mask selects with ``where`` rather than multiplying by a 0 (a state or
term of an ended sequence is dropped, not scaled), and the poison restarts at each sequence's
first step (:func:`poison_runs`), so each sequence gives, bit for bit, what it gives when another
sequence of its row turns non-finite.

Δ is clamped at 0 and A is negative, so every exponent is a sum of ``A·Δ <= 0`` terms: no exp
sees a positive argument (the upper triangle is set to -inf before its exp, never exp'd and
masked). Decay factors below the square root of the dtype's smallest normal number (about 1e-19
in float32) are flushed to exactly 0 (:func:`decay`): a term decayed that far is far below the
rounding of any output it joins, while subnormal floats would slow every later multiply (a matmul
with 1% subnormal operands runs ~10x slower on x86); GPU kernels flush subnormals in exp too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ._array import Array, Namespace, constant, device, row_major
from ._checks import check_bool, check_int
from .backends import fast_op
from .ssm_inputs import check_chunk_size, check_scan_inputs, heads_from_groups, skip_and_gate, within
from .varlen import Varlen, windows

#: Longest chunk chosen automatically; shorter sequences use one chunk of their own length.
MAX_AUTO_CHUNK = 64
#: Tokens processed per segment (whole chunks), bounding the O(l·h·Q) intermediates.
SEGMENT_TOKENS = 256


def choose_chunk_size(length: int, max_chunk: int = MAX_AUTO_CHUNK) -> int:
    """The chunk size for a sequence of ``length``: one chunk when it fits, else the fewest chunks
    of at most ``max_chunk`` with the least padding (l=300 -> 60, not 64 with 20 padded steps).
    A ``max_chunk`` beyond the length gives the length itself (an l=0 sequence gets 1): a chunk is
    never longer than the sequence, so a huge ``max_chunk`` never allocates for itself."""
    check_int("length", length, minimum=0)
    check_int("max_chunk", max_chunk, minimum=1)
    if length <= max_chunk:
        return max(length, 1)
    chunks = math.ceil(length / max_chunk)
    return math.ceil(length / chunks)


def chunk_length(length: int, chunk_size: int | None) -> int:
    """The chunk length a scan of ``length`` steps uses for ``chunk_size``: :func:`choose_chunk_size`
    for None, else ``chunk_size`` capped at the length (at least 1)."""
    return choose_chunk_size(length) if chunk_size is None else min(chunk_size, max(length, 1))


def ssd_scan(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None = None,
             D: Array | None = None, z: Array | None = None, dt_bias: Array | None = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
             initial_states: Array | None = None, return_final_states: bool = False,
             seq_idx: Array | None = None, cu_seqlens: Array | None = None,
             return_varlen_states: bool = False) -> Array | tuple[Array, ...]:
    """The chunked SSD scan, argument for argument like mamba_ssm's ``mamba_chunk_scan_combined``.

    Args:
        x: ``[b, l, h, p]`` inputs.
        dt: ``[b, l, h]`` raw time steps (Δ = clamp(softplus(dt + dt_bias)) per head and step).
        A: ``[h]`` continuous decay (negative).
        B: ``[b, l, g, n]`` input projection; h must be a multiple of g.
        C: ``[b, l, g, n]`` output projection.
        chunk_size: chunk length Q; ``None`` picks one for the shape (:func:`choose_chunk_size`).
            The result does not depend on it beyond rounding.
        D: optional skip ``[h]`` or ``[h, p]``.
        z: optional gate like x (``y * silu(z)``).
        dt_bias: optional ``[h]`` added to dt before the softplus (:func:`portable_ssm.discretize`).
        dt_softplus: apply softplus to ``dt + dt_bias`` (:func:`portable_ssm.discretize`).
        dt_limit: the clamp of Δ (:func:`portable_ssm.discretize`).
        initial_states: optional ``[b, h, p, n]`` in the compute dtype (with ``seq_idx``: the
            state of each row's first sequence only).
        return_final_states: also return the ``[b, h, p, n]`` state after the last step (with
            ``seq_idx``: the state of each row's last sequence).
        seq_idx: optional ``[b, l]`` integer sequence ids, non-decreasing along l (mamba_ssm's
            packed rows): the state resets wherever the id changes, so each sequence of a row
            gives what it gives alone.
        cu_seqlens: optional ``[n_seq + 1]`` integer cumulative lengths of the sequences packed in a
            batch-1 row (mamba_ssm's and vLLM's varlen layout, :mod:`portable_ssm.varlen`): 0 first,
            l last, strictly increasing; not with ``seq_idx``. Then ``initial_states`` is
            ``[n_seq, h, p, n]``, one state per sequence, and the final states are per sequence too.
        return_varlen_states: also return the ``[n_seq, h, p, n]`` state after each sequence's
            last step (needs cu_seqlens).

    Returns:
        ``y [b, l, h, p]`` in x's dtype, then ``final_states`` if return_final_states (with
        cu_seqlens: the last sequence's, ``[1, h, p, n]``), then ``varlen_states`` if
        return_varlen_states (mamba_ssm's order); y alone when neither is asked for.
    """
    check_chunk_size(chunk_size, return_final_states)
    check_bool("return_varlen_states", return_varlen_states)
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states: needs cu_seqlens (the per-sequence states of a packed row)")
    s = check_scan_inputs(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, states=initial_states, states_name="initial_states",
                          step=False, seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    xp = s.xp
    y, final = ssd_chunked(s.x, s.dt, s.A, s.B, s.C, chunk_size=chunk_size, initial_states=s.states,
                           seq_idx=s.seq_idx, D=s.D, xp=xp, varlen=s.varlen)
    y = xp.astype(skip_and_gate(y, s.x, None, s.z, xp=xp), s.out_dtype, copy=False)
    if s.varlen is None:
        return (y, final) if return_final_states else y
    out = (y, *((final[-1:, ...],) if return_final_states else ()), *((final,) if return_varlen_states else ()))
    return out if len(out) > 1 else y


def ssd_chunked(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None,
                initial_states: Array | None, xp: Namespace, seq_idx: Array | None = None,
                D: Array | None = None, varlen: Varlen | None = None) -> tuple[Array, Array]:
    """The scan on validated compute-dtype inputs (``dt`` is Δ), with the skip ``y + D·x`` when
    ``D`` (``[h]`` or ``[h, p]``) is given but no gate: ``(y, final_states)``.

    ``seq_idx [b, l]``: ids where equal means one contiguous sequence (run ids), or None.
    A backend may provide a native version (``fast_op(xp, "ssd_chunked")``, e.g. the CuPy kernels
    or NumPy's in-cache chunk loop); :func:`ssd_chunked_ref` is the reference both are tested against.
    With ``varlen`` (one packed row, :mod:`portable_ssm.varlen`) :func:`ssd_varlen_ref` runs instead:
    ``initial_states`` and the returned states are ``[n_seq, h, p, n]``, one per sequence."""
    if varlen is not None:
        return ssd_varlen_ref(x, dt, A, B, C, chunk_size=chunk_size, initial_states=initial_states,
                              varlen=varlen, xp=xp, D=D)
    native = fast_op(xp, "ssd_chunked")
    if native is not None:
        return native(x, dt, A, B, C, chunk_size, initial_states, seq_idx=seq_idx, D=D)
    return ssd_chunked_ref(x, dt, A, B, C, chunk_size=chunk_size, initial_states=initial_states, xp=xp,
                           seq_idx=seq_idx, D=D)


def ssd_chunked_ref(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None,
                    initial_states: Array | None, xp: Namespace, seq_idx: Array | None = None,
                    D: Array | None = None) -> tuple[Array, Array]:
    """The standard-functions scan, segment by segment (:func:`ssd_chunked`'s arguments)."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    Q = chunk_length(l, chunk_size)
    if initial_states is None:
        state = xp.zeros((b, g, n, r, p), dtype=x.dtype, device=device(x))
    else:
        state = _n_major(initial_states, g, xp=xp)  # [b, g, n, r, p]
    step = max(Q, (SEGMENT_TOKENS // Q) * Q)
    outputs = []
    for start in range(0, l, step):
        stop = min(start + step, l)
        # the state entering the segment belongs to the sequence at start-1 (initial: the first)
        seq = None if seq_idx is None else (seq_idx[:, start:stop], seq_idx[:, max(start - 1, 0)])
        y, state = _segment(x[:, start:stop, ...], dt[:, start:stop, ...], A, B[:, start:stop, ...],
                            C[:, start:stop, ...], Q, state, seq=seq, xp=xp)
        outputs.append(y)
    final = _h_major(state, xp=xp)
    if not outputs:  # l == 0: nothing to scan, the state passes through
        return xp.zeros((b, 0, h, p), dtype=x.dtype, device=device(x)), final
    y = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=1)  # [b, l, h, p]
    return skip_and_gate(y, x, D, None, xp=xp), final


def ssd_last(x: Array, dt: Array, A: Array, B: Array, C: Array, *, initial_states: Array | None,
             xp: Namespace, D: Array | None = None) -> tuple[Array, Array]:
    """The scan's last output and final state only, for a prompt pass that needs no other output:
    ``(y [b, h, p] at step l-1, final_states [b, h, p, n])``, equal to ``y[:, -1]`` and the final
    state of :func:`ssd_chunked` (same arguments, no ``seq_idx``) up to rounding, in two matmuls:

    ``S = exp(Σ a) · S_0 + Σ_t exp(a[t+1] + ... + a[l-1]) · outer(X_t, B_t)`` and ``y = S C_{l-1} + D·x_{l-1}``.

    The exponents are suffix sums of ``a = A·Δ <= 0``, summed from the end (the terms that weigh
    most are summed first and exactly) and decayed like the chunks' (:func:`decay`)."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    after, to_last = _sums_to_last(dt * A, xp=xp)  # a[t..l-1], a[t+1..l-1]: [b, l, h]
    X = x * (decay(to_last, xp=xp) * dt)[..., None]  # x·Δ decayed to the last step, [b, l, h, p]
    X = xp.permute_dims(xp.reshape(X, (b, l, g, r * p)), (0, 2, 3, 1))  # [b, l, h, p] -> [b, g, r·p, l]
    S = xp.reshape(_matmul(X, xp.permute_dims(B, (0, 2, 1, 3)), xp=xp), (b, h, p, n))  # [b, g, r·p, n] -> [b, h, p, n]
    if initial_states is not None:
        S = S + decay(after[:, 0, :], xp=xp)[..., None, None] * initial_states
    C_last = heads_from_groups(C[:, l - 1, ...], h, xp=xp)  # [b, h, n]
    y = _matmul(S, C_last[..., None], xp=xp)[..., 0]  # [b, h, p]
    return skip_and_gate(y, x[:, l - 1, ...], D, None, xp=xp), S


def _sums_to_last(a: Array, *, xp: Namespace) -> tuple[Array, Array]:
    """Suffix sums of ``a [n, L, h]`` along its steps, summed from the last: ``(a[t] + ... + a[L-1],
    a[t+1] + ... + a[L-1])``, the second 0 at the last step (no difference of sums is taken)."""
    after = xp.flip(xp.cumulative_sum(xp.flip(a, axis=1), axis=1), axis=1)  # [n, L, h]
    return after, xp.concat([after[:, 1:, :], xp.zeros_like(after[:, :1, :])], axis=1)  # [n, L, h]


def _n_major(states: Array, g: int, *, xp: Namespace) -> Array:
    """``[b, h, p, n] -> [b, g, n, r, p]``: the scan keeps states n-major so that every matmul reads
    row-major operands."""
    b, h, p, n = states.shape
    return xp.permute_dims(xp.reshape(states, (b, g, h // g, p, n)), (0, 1, 4, 2, 3))  # [b, g, n, r, p]


def _h_major(state: Array, *, xp: Namespace) -> Array:
    """``[b, g, n, r, p] -> [b, h, p, n]``, laid out row-major: a strided view would make every later
    step's elementwise update walk n with a stride of r·p floats (4x slower decode on NumPy)."""
    b, g, n, r, p = state.shape
    return row_major(xp.reshape(xp.permute_dims(state, (0, 1, 3, 4, 2)), (b, g * r, p, n)), xp=xp)


def ssd_varlen_ref(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None,
                   initial_states: Array | None, varlen: Varlen, xp: Namespace,
                   D: Array | None = None) -> tuple[Array, Array]:
    """The scan of one packed row ``x [1, l, h, p]`` (:func:`ssd_chunked`'s other arguments) whose
    sequences each start from their own state, ``initial_states [n_seq, h, p, n]`` (None: zeros):
    ``(y [1, l, h, p], the state after each sequence [n_seq, h, p, n])``.

    The packed-row masks of :func:`ssd_chunked_ref` run with no state entering the row; a sequence's
    initial state reaches the outputs of its first chunk through one gathered chunk per sequence
    (:func:`_initial_outputs`) and later chunks through the state leaving the first one (the
    ``inject`` of :func:`pass_states`). Final states are read from the chunk holding each
    sequence's last step (:func:`_final_states`)."""
    _, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    Q = chunk_length(l, chunk_size)
    if initial_states is None:
        inits = xp.zeros((varlen.n_seq, g, n, r, p), dtype=x.dtype, device=device(x))
    else:
        inits = _n_major(initial_states, g, xp=xp)  # [n_seq, g, n, r, p]
    seq_idx = varlen.seq[None, :]  # [1, l]
    state = xp.zeros((1, g, n, r, p), dtype=x.dtype, device=device(x))
    no_sequence = xp.full((1,), -1, dtype=seq_idx.dtype, device=device(x))  # nothing enters the row
    outputs, leaving = [], []
    step = max(Q, (SEGMENT_TOKENS // Q) * Q)
    for start in range(0, l, step):
        stop = min(start + step, l)
        before = no_sequence if start == 0 else seq_idx[:, start - 1]
        y, kept = _segment(x[:, start:stop, ...], dt[:, start:stop, ...], A, B[:, start:stop, ...],
                           C[:, start:stop, ...], Q, state, seq=(seq_idx[:, start:stop], before), inits=inits, xp=xp)
        state = kept[:, -1, ...]
        outputs.append(y)
        leaving.append(kept)
    y = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=1)  # [1, l, h, p]
    a = dt[0, ...] * A  # A·Δ, [l, h]
    y = y + _initial_outputs(C[0, ...], a, inits, varlen, Q, xp=xp)[None, ...]
    chunks = leaving[0] if len(leaving) == 1 else xp.concat(leaving, axis=1)  # [1, c, g, n, r, p]
    final = _final_states(x[0, ...] * dt[0, ...][..., None], B[0, ...], a, inits, chunks[0, ...], varlen, Q, xp=xp)
    return skip_and_gate(y, x, D, None, xp=xp), _h_major(final, xp=xp)


def _own_window(v: Array, varlen: Varlen, at: Array, Q: int, *, xp: Namespace) -> tuple[Array, Array, Array]:
    """The chunk of ``Q`` steps from ``at [n_seq]`` for each sequence: ``(v there [n_seq, Q, ...],
    the steps [n_seq, Q], True where a step belongs to that sequence [n_seq, Q])``."""
    taken, steps = windows(v, at, Q, xp=xp)
    seq, _ = windows(varlen.seq, at, Q, xp=xp)  # [n_seq, Q]
    ids = xp.arange(varlen.n_seq, dtype=seq.dtype, device=device(seq))
    own = (seq == ids[:, None]) & (steps < v.shape[0])  # steps past l read step l-1: not its own
    return taken, steps, own


def _initial_outputs(C: Array, a: Array, inits: Array, varlen: Varlen, Q: int, *, xp: Namespace) -> Array:
    """What each sequence's initial state ``inits [n_seq, g, n, r, p]`` adds to the outputs of its
    first chunk, ``exp(a[first..t]) · C_t S_0`` for ``C [l, g, n]``, ``a = A·Δ [l, h]``: ``[l, h, p]``
    (0 past the first chunk, where the state leaving it carries the initial state on)."""
    l, h = a.shape
    s, g, n, r, p = inits.shape
    chunk_start = (varlen.first // Q) * Q  # [n_seq]
    Cw, steps, own = _own_window(C, varlen, chunk_start, Q, xp=xp)  # [n_seq, Q, g, n]
    aw, _ = windows(a, chunk_start, Q, xp=xp)  # [n_seq, Q, h]
    own = (own & (steps >= varlen.first[:, None]))[..., None]  # [n_seq, Q, 1]
    grown = decay(xp.cumulative_sum(within(aw, own, xp=xp), axis=1), keep=own, xp=xp)  # a[first..t], [n_seq, Q, h]
    read = _matmul(xp.permute_dims(Cw, (0, 2, 1, 3)), xp.reshape(inits, (s, g, n, r * p)), xp=xp)  # [n_seq, g, Q, r·p]
    read = xp.reshape(xp.permute_dims(read, (0, 2, 1, 3)), (s * Q, h, p))  # [n_seq·Q, h, p]
    read = read * xp.reshape(grown, (s * Q, h))[..., None]
    offset = xp.arange(l, dtype=varlen.seq.dtype, device=device(a)) - xp.take(chunk_start, varlen.seq)  # [l]
    taken = xp.take(read, varlen.seq * Q + xp.clip(offset, 0, Q - 1), axis=0)  # [l, h, p]
    return within(taken, (offset < Q)[:, None, None], xp=xp)


def _final_states(X: Array, B: Array, a: Array, inits: Array, chunks: Array, varlen: Varlen, Q: int, *,
                  xp: Namespace) -> Array:
    """The state after each sequence's last step, ``[n_seq, g, n, r, p]``, from the chunk holding it:
    ``exp(a[chunk start..last]) · S_0 + Σ_j exp(a[j+1..last]) · outer(B_j, X_j)`` over the sequence's
    steps j there, where ``S_0`` is the state leaving the chunk before (``chunks [c, g, n, r, p]``)
    when the sequence began earlier, else its initial state (``inits``). ``X = x·Δ [l, h, p]``,
    ``B [l, g, n]``, ``a = A·Δ [l, h]``."""
    l, h = a.shape
    s, g, n, r, p = inits.shape
    chunk = varlen.last // Q  # [n_seq]
    Xw, steps, own = _own_window(X, varlen, chunk * Q, Q, xp=xp)  # [n_seq, Q, h, p]
    Bw, _ = windows(B, chunk * Q, Q, xp=xp)  # [n_seq, Q, g, n]
    aw, _ = windows(a, chunk * Q, Q, xp=xp)  # [n_seq, Q, h]
    own = (own & (steps <= varlen.last[:, None]))[..., None]  # [n_seq, Q, 1]
    kept = within(aw, own, xp=xp)
    after, to_last = _sums_to_last(kept, xp=xp)  # a[j..last], a[j+1..last]: [n_seq, Q, h]
    Xd = within(Xw * decay(to_last, keep=own, xp=xp)[..., None], own[..., None], xp=xp)  # [n_seq, Q, h, p]
    Xd = xp.permute_dims(xp.reshape(Xd, (s, Q, g, r * p)), (0, 2, 1, 3))  # [n_seq, g, Q, r·p]
    Bw = within(Bw, own[..., None], xp=xp)  # other sequences' steps selected out, not multiplied by 0
    inside = xp.reshape(_matmul(xp.permute_dims(Bw, (0, 2, 3, 1)), Xd, xp=xp), (s, g, n, r, p))
    ids = xp.arange(s, dtype=chunk.dtype, device=device(chunk))
    entered = (xp.take(varlen.seq, xp.clip(chunk * Q - 1, 0, l - 1)) == ids) & (chunk > 0)  # [n_seq]
    before = xp.take(chunks, xp.clip(chunk - 1, 0, chunks.shape[0] - 1), axis=0)  # [n_seq, g, n, r, p]
    start = xp.where(xp.reshape(entered, (s, 1, 1, 1, 1)), before, inits)
    whole = xp.reshape(decay(after[:, 0, :], xp=xp), (s, g, 1, r, 1))  # a over the chunk's own steps
    return whole * start + inside


def pass_states(state: Array, chunk_decay: Array, Bt: Array, X: Array, C: Array, *,
                xp: Namespace, inject: Array | None = None, carried: Array | None = None) -> tuple[Array, Array]:
    """Steps 2 to 4 chunk by chunk from ``state [b, g, n, r, p]``: the entering state is read by
    the chunk's C (``C_c S_in[c]``), then the chunk's own contribution is added,
    ``S_in[c+1] = chunk_decay[c] · S_in[c] + B_cᵀ X_c``. Only one state is alive at a time, never the
    ``[b, c, g, n, r·p]`` stack of them.

    ``chunk_decay [b, c, g, 1, r, 1]``, ``Bt [b, c, g, n, Q]``, ``X [b, c, g, Q, r·p]``
    (already decayed to the chunk's end), ``C [b, c, g, Q, n]``. Returns ``(C_c S_in[c]`` for every
    chunk ``[b, c, g, Q, r·p]``, the state leaving the last chunk). A backend may provide a native
    version (``fast_op(xp, "pass_states")``: ``jax.lax.scan`` compiles once, not per chunk).

    ``inject [b, c, g, n, r, p]`` (packed rows with per-sequence initial states,
    :func:`ssd_varlen_ref`) is added to the state leaving each chunk, and the second result is then
    the stack of the states leaving every chunk, ``[b, c, g, n, r, p]``.

    ``carried [b, c, 1, 1, 1, 1]`` (bool, packed rows): False where the sequence entering chunk c
    ends inside it; its state is then dropped (``where``) before the chunk's own part is added,
    not multiplied by a 0 decay, which would keep a non-finite state of one sequence in the next."""
    native = fast_op(xp, "pass_states")
    if native is not None:
        extra = {} if carried is None else {"carried": carried}
        return native(state, chunk_decay, Bt, X, C, **extra) if inject is None else \
            native(state, chunk_decay, Bt, X, C, inject, **extra)
    return pass_states_ref(state, chunk_decay, Bt, X, C, xp=xp, inject=inject, carried=carried)


def pass_states_ref(state: Array, chunk_decay: Array, Bt: Array, X: Array, C: Array, *,
                    xp: Namespace, inject: Array | None = None, carried: Array | None = None) -> tuple[Array, Array]:
    """The Python loop over chunks (unstacked, not indexed: autograd then adds one gradient per
    chunk, not a full-size zero fill)."""
    b, g, n, r, p = state.shape
    c = C.shape[1]
    outputs, leaving = [], []
    injected = [None] * c if inject is None else xp.unstack(inject, axis=1)
    kept = [None] * c if carried is None else xp.unstack(carried, axis=1)
    for decay_i, Bt_i, X_i, C_i, inject_i, kept_i in zip(*(xp.unstack(v, axis=1) for v in (chunk_decay, Bt, X, C)),
                                                         injected, kept):
        outputs.append(_matmul(C_i, xp.reshape(state, (b, g, n, r * p)), xp=xp))  # [b, g, Q, r·p]
        added = xp.reshape(_matmul(Bt_i, X_i, xp=xp), state.shape)  # [b, g, n, r·p] -> [b, g, n, r, p]
        state = within(decay_i * state, kept_i, xp=xp) + added
        if inject_i is not None:
            state = state + inject_i
            leaving.append(state)
    return xp.stack(outputs, axis=1), state if inject is None else xp.stack(leaving, axis=1)


def decay_floor(dtype: Any, *, xp: Namespace) -> float:
    """The smallest exponent :func:`decay` keeps: ``log(sqrt(smallest normal))`` of ``dtype``
    (-43.7 in float32, -354 in float64)."""
    return math.log(xp.finfo(dtype).smallest_normal) / 2


def decay(exponent: Array, *, xp: Namespace, keep: Array | None = None) -> Array:
    """``exp(exponent)`` for sums of ``A·Δ <= 0``: 0 where ``keep`` (a mask broadcasting against
    exponent) is False, and flushed to 0 where the factor would fall below ``sqrt(smallest
    normal)`` of the dtype, so no subnormal reaches a later product. Masked entries are never exp'd."""
    kept = exponent >= decay_floor(exponent.dtype, xp=xp)
    return xp.exp(xp.where(kept if keep is None else kept & keep, exponent, constant(-math.inf, exponent, xp=xp)))


def stable_segsum(a: Array, *, xp: Namespace) -> Array:
    """``segsum[..., i, j] = a[j+1] + ... + a[i]`` (0 for ``j >= i``) over the last axis of ``a [..., Q]``,
    as a cumulative sum down each column of the masked, repeated exponents (mamba_ssm's
    ``ssd_minimal`` "stable segsum"), never as a difference ``acs[i] - acs[j]`` of one cumulative sum:
    that difference loses the digits of a large ``|A·Δ|`` earlier in the chunk (relative error up to
    8e-2 in float32 for one Δ of 1e5), and a non-finite ``a[t]`` reaches only pairs with ``j < t <= i``.
    Row ``Q-1`` is the exclusive suffix sum, the exponent from each step to the chunk's end."""
    Q = a.shape[-1]
    idx = xp.arange(Q, device=device(a))
    below = idx[:, None] > idx[None, :]  # k > j, [Q, Q]
    terms = xp.where(below, a[..., :, None], constant(0.0, a, xp=xp))  # a[k] at [k, j] for k > j, [..., Q, Q]
    return xp.cumulative_sum(terms, axis=-2)  # [..., Q, Q]


def finite_or_zero(v: Array, *, xp: Namespace) -> Array:
    """``v`` with its non-finite entries replaced by 0, for the sums that also reach earlier steps."""
    return xp.where(xp.isfinite(v), v, constant(0.0, v, xp=xp))


def poison(v: Array, *, axis: int, xp: Namespace) -> Array:
    """0 up to the first non-finite entry of ``v`` along ``axis`` and nan from it on: what a
    non-finite step does to every later output of the recurrence, added back after
    :func:`finite_or_zero` kept it out of the earlier ones (``v - v`` is exactly 0 where finite)."""
    return xp.cumulative_sum(v - v, axis=axis)


def poison_runs(v: Array, first: Array, *, xp: Namespace) -> Array:
    """:func:`poison` of ``v [b, c, Q, ...]`` along its steps (axis 2) restarting at every sequence of
    a packed chunk: nan at step t where a non-finite entry lies between the first step of t's sequence
    in the chunk, ``first [b, c, Q]``, and t; else 0. A plain cumulative poison would carry one
    sequence's non-finite step into the later sequences of the chunk."""
    b, c, Q = first.shape
    bad = xp.astype(xp.logical_not(xp.isfinite(v)), xp.int32)  # [b, c, Q, ...]
    through = xp.cumulative_sum(bad, axis=2)  # non-finite entries up to t, [b, c, Q, ...]
    rows = xp.arange(b * c, dtype=first.dtype, device=device(first))[:, None] * Q + xp.reshape(first, (b * c, Q))
    flat = xp.reshape(through - bad, (b * c * Q, *v.shape[3:]))  # before each step, [b·c·Q, ...]
    before_run = xp.reshape(xp.take(flat, xp.reshape(rows, (-1,)), axis=0), v.shape)  # [b, c, Q, ...]
    return xp.where(through > before_run, constant(math.nan, v, xp=xp), constant(0.0, v, xp=xp))


def _pad_time(v: Array, pad: int, *, xp: Namespace) -> Array:
    """Zero-pads axis 1 (time) by ``pad`` steps: Δ=0 there, so padding neither decays nor feeds."""
    if pad == 0:
        return v
    zeros = xp.zeros((v.shape[0], pad, *v.shape[2:]), dtype=v.dtype, device=device(v))
    return xp.concat([v, zeros], axis=1)


def _matmul(a: Array, b: Array, *, xp: Namespace) -> Array:
    """``a [..., m, k] @ b [..., k, n]`` (equal leading axes) as one batch axis: NumPy runs stacks of
    rank > 3 through a slow non-BLAS loop for some strides, a 3-d batch always through BLAS."""
    out = xp.matmul(xp.reshape(a, (-1, *a.shape[-2:])), xp.reshape(b, (-1, *b.shape[-2:])))  # [B, m, n]
    return xp.reshape(out, (*a.shape[:-2], *out.shape[-2:]))  # [..., m, n]


class _Boundaries(NamedTuple):
    """Masks keeping each chunk's terms inside one sequence (all None: one sequence per row)."""

    same: Array | None = None  # i and j in one sequence, [b, c, 1, Q, Q]
    in_last: Array | None = None  # t in the chunk's last sequence, [b, c, 1, Q]
    carried: Array | None = None  # the entering sequence still runs at the chunk's end, [b, c, 1]
    in_entering: Array | None = None  # t in the sequence running when the chunk began, [b, c, 1, Q]
    last: Array | None = None  # the chunk's last sequence, [b, c]
    first: Array | None = None  # the first step in the chunk of t's sequence, [b, c, Q]


def _boundaries(seq: Array, before: Array, c: int, Q: int, *, xp: Namespace) -> _Boundaries:
    """The masks for ids ``seq [b, l]`` (``l <= c·Q``) and ``before [b]``, the id of the state
    entering the segment. The tail is padded with the last id: padded steps join the last sequence."""
    b, l = seq.shape
    seq = xp.concat([seq, xp.broadcast_to(seq[:, -1:], (b, c * Q - l))], axis=1)  # [b, c·Q]
    s = xp.reshape(seq, (b, c, Q))  # [b, c, Q]
    entering = xp.concat([before[:, None], s[:, :-1, -1]], axis=1)  # id entering each chunk, [b, c]
    last = s[:, :, -1]  # [b, c]
    earlier = xp.astype(s[:, :, None, :] < s[:, :, :, None], xp.int32)  # step j's run before t's, [b, c, Q, Q]
    return _Boundaries(same=(s[:, :, :, None] == s[:, :, None, :])[:, :, None, ...],
                       in_last=(s == last[..., None])[:, :, None, :],
                       carried=(last == entering)[..., None],
                       in_entering=(s == entering[..., None])[:, :, None, :], last=last,
                       first=xp.sum(earlier, axis=-1, dtype=xp.int32))  # runs ascend: earlier steps precede t's run


def _segment(x: Array, dt: Array, A: Array, B: Array, C: Array, Q: int, state: Array, *,
             seq: tuple[Array, Array] | None, xp: Namespace, inits: Array | None = None) -> tuple[Array, Array]:
    """One segment of whole chunks, starting from ``state [b, g, n, r, p]``; ``seq`` is None or
    ``(ids [b, l], id of the entering state [b])``. With ``inits [n_seq, g, n, r, p]`` (ids are
    sequence indices, :func:`ssd_varlen_ref`) the state leaving a chunk whose last sequence began in
    it starts from that sequence's initial state, and the second result is the stack of the states
    leaving every chunk (:func:`pass_states`)."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    c = math.ceil(l / Q)
    pad = c * Q - l
    m = _Boundaries() if seq is None else _boundaries(*seq, c, Q, xp=xp)
    x, dt, B, C = (_pad_time(v, pad, xp=xp) for v in (x, dt, B, C))

    X = xp.reshape(x * dt[..., None], (b, c, Q, h, p))  # X = x·Δ, [b, c, Q, h, p]
    a = xp.permute_dims(xp.reshape(dt * A, (b, c, Q, h)), (0, 1, 3, 2))  # a = A·Δ <= 0, [b, c, h, Q]
    acs = xp.cumulative_sum(row_major(a, xp=xp), axis=-1)  # [b, c, h, Q]
    Bg = xp.permute_dims(xp.reshape(B, (b, c, Q, g, n)), (0, 1, 3, 2, 4))  # [b, c, g, Q, n]
    Cg = xp.permute_dims(xp.reshape(C, (b, c, Q, g, n)), (0, 1, 3, 2, 4))  # [b, c, g, Q, n]
    Xh = xp.permute_dims(X, (0, 1, 3, 2, 4))  # [b, c, h, Q, p]

    # 1. diagonal blocks: causal "attention" C Bᵀ ⊙ L inside each chunk
    Bt = row_major(xp.matrix_transpose(Bg), xp=xp)  # [b, c, g, n, Q]
    CB = _matmul(Cg, Bt, xp=xp)  # [b, c, g, Q, Q]
    segsum = stable_segsum(a, xp=xp)  # [b, c, h, Q, Q]
    idx = xp.arange(Q, device=device(x))
    causal = idx[:, None] >= idx[None, :]  # [Q, Q]
    keep = causal if m.same is None else causal & m.same
    L = decay(segsum, keep=keep, xp=xp)  # [b, c, h, Q, Q]
    M = xp.reshape(CB[:, :, :, None, ...] * xp.reshape(L, (b, c, g, r, Q, Q)), (b, c, h, Q, Q))
    M = xp.where(keep, M, constant(0.0, M, xp=xp))  # a non-finite B_j must not reach rows i < j (0·nan)
    if m.first is None:
        Y_diag = _matmul(M, finite_or_zero(Xh, xp=xp), xp=xp) + poison(Xh, axis=-2, xp=xp)  # [b, c, h, Q, p]
        Y_diag = xp.permute_dims(Y_diag, (0, 1, 3, 2, 4))  # [b, c, Q, h, p]
    else:  # the poison restarts at each sequence
        Y_diag = xp.permute_dims(_matmul(M, finite_or_zero(Xh, xp=xp), xp=xp), (0, 1, 3, 2, 4))  # [b, c, Q, h, p]
        Y_diag = Y_diag + poison_runs(X, m.first, xp=xp)

    # 2.-4. chunk by chunk: the entering state is read by C, then the chunk's own states are added
    decay_states = decay(segsum[..., -1, :], keep=m.in_last, xp=xp)  # to the chunk's end, [b, c, h, Q]
    Xd = X * xp.permute_dims(decay_states, (0, 1, 3, 2))[..., None]  # X decayed to its chunk's end, [b, c, Q, h, p]
    Bt_fed = Bt
    if m.in_last is not None:  # only the chunk's last sequence feeds its state: earlier ones selected out
        Xd = within(Xd, xp.permute_dims(m.in_last, (0, 1, 3, 2))[..., None], xp=xp)  # [b, c, Q, 1, 1]
        Bt_fed = within(Bt, m.in_last[:, :, :, None, :], xp=xp)  # [b, c, 1, 1, Q]
    Xd = xp.permute_dims(xp.reshape(Xd, (b, c, Q, g, r * p)), (0, 1, 3, 2, 4))  # [b, c, g, Q, r·p]
    decay_chunk = decay(acs[..., -1], keep=m.carried, xp=xp)  # [b, c, h]
    decay_chunk = xp.reshape(decay_chunk, (b, c, g, 1, r, 1))  # [b, c, h] -> [b, c, g, 1, r, 1]
    inject = None
    if inits is not None:  # the initial state of a sequence begun in the chunk, grown to its end
        grown = decay(xp.sum(within(a, m.in_last, xp=xp), axis=-1), keep=xp.logical_not(m.carried), xp=xp)
        started = xp.reshape(xp.take(inits, xp.reshape(m.last, (-1,)), axis=0), (b, c, g, n, r, p))
        inject = xp.reshape(grown, (b, c, g, 1, r, 1)) * started  # [b, c, h] -> [b, c, g, 1, r, 1]
    carried = None if m.carried is None else xp.reshape(m.carried, (b, c, 1, 1, 1, 1))  # [b, c, 1] -> [b, c, 1, ...]
    Y_off, state = pass_states(state, decay_chunk, Bt_fed, Xd, Cg, xp=xp, inject=inject,
                               carried=carried)  # [b, c, g, Q, r·p], state
    Y_off = xp.reshape(xp.permute_dims(Y_off, (0, 1, 3, 2, 4)), (b, c, Q, h, p))  # [b, c, Q, h, p]
    decay_out = decay(acs, keep=m.in_entering, xp=xp)  # [b, c, h, Q]
    Y_off = Y_off * xp.permute_dims(decay_out, (0, 1, 3, 2))[..., None]
    if m.in_entering is not None:  # the entering state reaches its own sequence's steps only (0·nan is nan)
        Y_off = within(Y_off, xp.permute_dims(m.in_entering, (0, 1, 3, 2))[..., None], xp=xp)  # [b, c, Q, 1, 1]

    y = xp.reshape(Y_diag + Y_off, (b, c * Q, h, p))[:, :l, ...]  # [b, l, h, p]
    return y, state
