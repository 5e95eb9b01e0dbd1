"""The sequential recurrence: the in-house oracle (``selective_scan``) and the one-token step.

Per head, with state ``H [p, n]`` (MAMBA2_SPEC.md step 7)::

    H_t = exp(Δ_t·A) · H_{t-1} + Δ_t · outer(x_t, B_t)
    y_t = H_t @ C_t + D · x_t

The state is multiplied by C on its right (``[p, n] @ [n]``); A is one scalar per head. With
``seq_idx`` the state restarts from zero at the first step of every new sequence.
"""

from __future__ import annotations

import math

from ._array import Array, Namespace, device, namespace
from .ssm_inputs import check_chunk_size, check_scan_inputs, heads_from_groups, skip_and_gate, within
from .state_pool import check_state_batch_indices, gather_rows, scatter_rows


def recurrence_step(state: Array, x: Array, dt: Array, A: Array, B: Array, C: Array, *,
                    xp: Namespace) -> tuple[Array, Array]:
    """One step on compute-dtype inputs: state ``[b, h, p, n]``, x ``[b, h, p]``, Δ ``[b, h]``,
    A ``[h]``, B and C ``[b, h, n]`` (already per head). Returns ``(y [b, h, p], new_state)``."""
    decay = xp.exp(dt * A)[..., None, None]  # Ā = exp(Δ·A), [b, h, 1, 1]
    feed = (dt[..., None] * x)[..., None] * B[:, :, None, :]  # Δ·outer(x, B), [b, h, p, n]
    state = decay * state + feed  # [b, h, p, n]
    y = xp.matmul(state, C[..., None])[..., 0]  # H @ C, [b, h, p]
    return y, state


def selective_scan(x: Array, dt: Array, A: Array, B: Array, C: Array, *, chunk_size: int | None = None,
                   D: Array | None = None, z: Array | None = None, dt_bias: Array | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
                   initial_states: Array | None = None, return_final_states: bool = False,
                   seq_idx: Array | None = None) -> Array | tuple[Array, Array]:
    """The plain sequential recurrence, one step at a time: the reference ``ssd_scan`` must equal.

    Takes exactly :func:`portable_ssm.ssd_scan`'s arguments (``chunk_size`` is validated and
    otherwise ignored) and returns ``y [b, l, h, p]`` or ``(y, final_states [b, h, p, n])``.
    With ``seq_idx [b, l]`` the state is zeroed wherever the id changes: ``initial_states`` feeds
    each row's first sequence and the final state is that of its last one.
    """
    check_chunk_size(chunk_size, return_final_states)
    s = check_scan_inputs(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, states=initial_states, states_name="initial_states",
                          step=False, seq_idx=seq_idx)
    xp = s.xp
    b, l, h, p = s.x.shape
    Bh = heads_from_groups(s.B, h, xp=xp)  # [b, l, h, n]
    Ch = heads_from_groups(s.C, h, xp=xp)  # [b, l, h, n]
    state = s.states
    if state is None:
        state = xp.zeros((b, h, p, Bh.shape[-1]), dtype=s.x.dtype, device=device(s.x))
    ys = []
    for t in range(l):
        if s.seq_idx is not None and t > 0:
            same = s.seq_idx[:, t] == s.seq_idx[:, t - 1]  # [b]
            state = within(state, same[:, None, None, None], xp=xp)  # a new sequence starts at 0
        y_t, state = recurrence_step(state, s.x[:, t, ...], s.dt[:, t, ...], s.A, Bh[:, t, ...],
                                     Ch[:, t, ...], xp=xp)
        ys.append(y_t)
    y = xp.stack(ys, axis=1) if ys else xp.zeros_like(s.x)  # [b, l, h, p]
    y = xp.astype(skip_and_gate(y, s.x, s.D, s.z, xp=xp), s.out_dtype, copy=False)
    return (y, state) if return_final_states else y


def ssd_step(state: Array, x: Array, dt: Array, A: Array, B: Array, C: Array, *, D: Array | None = None,
             z: Array | None = None, dt_bias: Array | None = None, dt_softplus: bool = False,
             dt_limit: tuple[float, float] = (0.0, math.inf),
             state_batch_indices: Array | None = None) -> tuple[Array, Array]:
    """One token of the recurrence, mamba_ssm's ``selective_state_update`` without mutation.

    Args:
        state: ``[b, h, p, n]`` in the compute dtype (float32, or float64 for float64 x).
        x: ``[b, h, p]``; dt: ``[b, h]``; A: ``[h]``; B, C: ``[b, g, n]``; D: ``[h]`` or ``[h, p]``;
        z: like x. dt_bias, dt_softplus, dt_limit as in :func:`portable_ssm.discretize`.
        state_batch_indices: optional ``[b]`` distinct integers: ``state`` is then a pool
            ``[pool, h, p, n]`` and row i reads and updates slot ``state_batch_indices[i]``
            (mamba_ssm's argument, :mod:`portable_ssm.state_pool`).

    Returns:
        ``(y [b, h, p] in x's dtype, new_state [b, h, p, n])`` (with ``state_batch_indices``: the
        whole new pool); ``state`` is left untouched.
    """
    if state is None:
        raise TypeError("state: expected a [b, h, p, n] array, got None")
    pool = state
    if state_batch_indices is not None:
        xp = namespace(state=state, x=x)
        if state.ndim != 4:
            raise ValueError(f"state: expected a pool [pool, h, p, n], got shape {tuple(state.shape)}")
        check_state_batch_indices(state_batch_indices, state.shape[0], x.shape[0], "x", x, xp=xp)
        state = gather_rows(pool, state_batch_indices, xp=xp)  # [b, h, p, n]
    s = check_scan_inputs(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=dt_limit, states=state, states_name="state", step=True)
    xp = s.xp
    h = s.x.shape[1]
    y, new_state = recurrence_step(s.states, s.x, s.dt, s.A, heads_from_groups(s.B, h, xp=xp),
                                   heads_from_groups(s.C, h, xp=xp), xp=xp)
    if state_batch_indices is not None:
        new_state = scatter_rows(pool, state_batch_indices, new_state, xp=xp)
    return xp.astype(skip_and_gate(y, s.x, s.D, s.z, xp=xp), s.out_dtype, copy=False), new_state
