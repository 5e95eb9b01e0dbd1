"""The chunked SSD scan (Mamba-2's state-space duality), matmul based and linear in length.

Shape legend: b batch, l length, h heads, p headdim, g groups, r = h/g heads per group,
n state size, Q chunk size, c chunks. With ``X = x·Δ`` and ``a = A·Δ`` (MAMBA2_SPEC.md):

1. diagonal blocks:  ``Y_diag = ((C Bᵀ) ⊙ exp(segsum(a))) X``   (C Bᵀ once per group)
2. chunk states:     ``S_c = Σ_t exp(acs[-1] - acs[t]) · outer(X_t, B_t)``
3. state passing:    ``S_in[c+1] = exp(acs_c[-1]) · S_in[c] + S_c``
4. state -> output:  ``Y_off[t] = exp(acs[t]) · (S_in[c] @ C_t)``

Every exponent is a sum of ``A·Δ <= 0`` terms, clamped at 0, so no exp ever sees a positive
argument. Long sequences are processed in segments of whole chunks with the state carried across,
so the extra memory is bounded by the segment, not by l.
"""

from __future__ import annotations

import math

from ._array import Array, Namespace, device
from .ssm_inputs import check_chunk_size, check_scan_inputs, skip_and_gate

#: Longest chunk chosen automatically; shorter sequences use one chunk of their own length.
MAX_AUTO_CHUNK = 64
#: Tokens processed per segment (whole chunks), bounding the O(l·h·Q) intermediates.
SEGMENT_TOKENS = 4096


def choose_chunk_size(length: int, max_chunk: int = MAX_AUTO_CHUNK) -> int:
    """The chunk size for a sequence of ``length``: one chunk when it fits, else the fewest chunks
    of at most ``max_chunk`` with the least padding (l=300 -> 60, not 64 with 20 padded steps)."""
    if length <= max_chunk:
        return max(length, 1)
    chunks = math.ceil(length / max_chunk)
    return math.ceil(length / chunks)


def ssd_scan(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None = None,
             D: Array | None = None, z: Array | None = None, dt_bias: Array | None = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
             initial_states: Array | None = None,
             return_final_states: bool = False) -> Array | tuple[Array, Array]:
    """The chunked SSD scan, argument for argument like mamba_ssm's ``mamba_chunk_scan_combined``.

    Args:
        x: ``[b, l, h, p]`` inputs.
        dt: ``[b, l, h]`` raw time steps (Δ = clamp(softplus(dt + dt_bias)) per head and step).
        A: ``[h]`` continuous decay (negative).
        B, C: ``[b, l, g, n]`` input and output projections; h must be a multiple of g.
        chunk_size: chunk length Q; ``None`` picks one for the shape (:func:`choose_chunk_size`).
            The result does not depend on it beyond rounding.
        D: optional skip ``[h]`` or ``[h, p]``; z: optional gate like x (``y * silu(z)``).
        dt_bias, dt_softplus, dt_limit: see :func:`portable_ssm.discretize`.
        initial_states: optional ``[b, h, p, n]`` in the compute dtype.
        return_final_states: also return the ``[b, h, p, n]`` state after the last step.

    Returns:
        ``y [b, l, h, p]`` in x's dtype, or ``(y, final_states)``.
    """
    check_chunk_size(chunk_size)
    s = check_scan_inputs(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, states=initial_states, states_name="initial_states",
                          step=False)
    xp = s.xp
    y, final = ssd_chunked(s.x, s.dt, s.A, s.B, s.C, chunk_size=chunk_size, initial_states=s.states,
                           xp=xp)
    y = xp.astype(skip_and_gate(y, s.x, s.D, s.z, xp=xp), s.out_dtype)
    return (y, final) if return_final_states else y


def ssd_chunked(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None,
                initial_states: Array | None, xp: Namespace) -> tuple[Array, Array]:
    """The scan without D/z on validated compute-dtype inputs (``dt`` is Δ): ``(y, final_states)``."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    Q = choose_chunk_size(l) if chunk_size is None else chunk_size
    state = initial_states
    if state is None:
        state = xp.zeros((b, h, p, n), dtype=x.dtype, device=device(x))
    step = max(Q, (SEGMENT_TOKENS // Q) * Q)
    outputs = []
    for start in range(0, l, step):
        stop = min(start + step, l)
        y, state = _segment(x[:, start:stop, ...], dt[:, start:stop, ...], A, B[:, start:stop, ...],
                            C[:, start:stop, ...], Q, state, xp=xp)
        outputs.append(y)
    y = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=1)  # [b, l, h, p]
    return y, state


def _pad_time(v: Array, pad: int, *, xp: Namespace) -> Array:
    """Zero-pads axis 1 (time) by ``pad`` steps: Δ=0 there, so padding neither decays nor feeds."""
    if pad == 0:
        return v
    zeros = xp.zeros((v.shape[0], pad, *v.shape[2:]), dtype=v.dtype, device=device(v))
    return xp.concat([v, zeros], axis=1)


def _segment(x: Array, dt: Array, A: Array, B: Array, C: Array, Q: int, state: Array, *,
             xp: Namespace) -> tuple[Array, Array]:
    """One segment of whole chunks, starting from ``state [b, h, p, n]``."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    c = math.ceil(l / Q)
    pad = c * Q - l
    x, dt, B, C = (_pad_time(v, pad, xp=xp) for v in (x, dt, B, C))

    X = xp.reshape(x * dt[..., None], (b, c, Q, h, p))  # X = x·Δ, [b, c, Q, h, p]
    a = xp.reshape(dt * A, (b, c, Q, h))  # a = A·Δ <= 0, [b, c, Q, h]
    acs = xp.cumulative_sum(xp.permute_dims(a, (0, 1, 3, 2)), axis=-1)  # [b, c, h, Q]
    Bg = xp.permute_dims(xp.reshape(B, (b, c, Q, g, n)), (0, 1, 3, 2, 4))  # [b, c, g, Q, n]
    Cg = xp.permute_dims(xp.reshape(C, (b, c, Q, g, n)), (0, 1, 3, 2, 4))  # [b, c, g, Q, n]
    Xh = xp.permute_dims(X, (0, 1, 3, 2, 4))  # [b, c, h, Q, p]

    # 1. diagonal blocks: causal "attention" C Bᵀ ⊙ L inside each chunk
    CB = xp.matmul(Cg, xp.matrix_transpose(Bg))  # [b, c, g, Q, Q]
    idx = xp.arange(Q, device=device(x))
    causal = idx[:, None] >= idx[None, :]  # [Q, Q]
    segsum = xp.minimum(acs[..., :, None] - acs[..., None, :], 0.0)  # [b, c, h, Q, Q]
    L = xp.exp(xp.where(causal, segsum, -math.inf))  # [b, c, h, Q, Q]
    M = xp.reshape(CB[:, :, :, None, ...] * xp.reshape(L, (b, c, g, r, Q, Q)), (b, c, h, Q, Q))
    Y_diag = xp.permute_dims(xp.matmul(M, Xh), (0, 1, 3, 2, 4))  # [b, c, Q, h, p]

    # 2. chunk states: what each chunk adds to the state, decayed to its end
    decay_states = xp.exp(xp.minimum(acs[..., -1:] - acs, 0.0))  # [b, c, h, Q]
    Xd = X * xp.permute_dims(decay_states, (0, 1, 3, 2))[..., None]  # [b, c, Q, h, p]
    Xd = xp.permute_dims(xp.reshape(Xd, (b, c, Q, g, r * p)), (0, 1, 3, 2, 4))  # [b, c, g, Q, r·p]
    S = xp.reshape(xp.matmul(xp.matrix_transpose(Xd), Bg), (b, c, h, p, n))  # [b, c, h, p, n]

    # 3. state passing: the state entering each chunk, and the one leaving the segment
    decay_chunk = xp.exp(acs[..., -1])  # [b, c, h]
    entering = []
    for i in range(c):
        entering.append(state)
        state = decay_chunk[:, i, :, None, None] * state + S[:, i, ...]  # [b, h, p, n]
    S_in = xp.stack(entering, axis=1)  # [b, c, h, p, n]

    # 4. state -> output: the entering state read by C, decayed to each position
    S_in = xp.reshape(S_in, (b, c, g, r * p, n))  # [b, c, g, r·p, n]
    Y_off = xp.matmul(Cg, xp.matrix_transpose(S_in))  # [b, c, g, Q, r·p]
    Y_off = xp.reshape(xp.permute_dims(Y_off, (0, 1, 3, 2, 4)), (b, c, Q, h, p))  # [b, c, Q, h, p]
    Y_off = Y_off * xp.permute_dims(xp.exp(acs), (0, 1, 3, 2))[..., None]

    y = xp.reshape(Y_diag + Y_off, (b, c * Q, h, p))[:, :l, ...]  # [b, l, h, p]
    return y, state
