"""A pool of decode states (continuous batching): a step reads and writes the rows named by ``state_batch_indices``.

A pool is a :class:`~portable_ssm.Mamba2State` (or one SSM state ``[pool, h, p, n]``) whose batch
axis holds slots, more than are decoding at once. ``state_batch_indices [b]`` (distinct integers
in ``[0, pool)``) names the slot of each of the step's b rows, as mamba_ssm's
``selective_state_update(state_batch_indices=...)``; unlike it the step is pure: it returns a new
pool with those rows replaced and every other slot as it was (a ``where`` over the pool).
"""

from __future__ import annotations

from typing import Any

from ._array import Array, Namespace, device, dtype_name, namespace
from ._checks import check_same_device
from .state import Mamba2State


def check_state_batch_indices(indices: Array, pool: int, batch: int, ref_name: str, ref: Array, *,
                              xp: Namespace) -> None:
    """TypeError/ValueError unless ``indices`` is ``[batch]`` distinct integers in ``[0, pool)`` on
    ``ref``'s backend and device (one host sync)."""
    namespace(state_batch_indices=indices, **{ref_name: ref})
    check_same_device("state_batch_indices", indices, ref_name, ref)
    if not xp.isdtype(indices.dtype, "integral"):
        raise TypeError(f"state_batch_indices: expected an integer dtype, got {dtype_name(indices.dtype)}")
    if tuple(indices.shape) != (batch,):
        raise ValueError(f"state_batch_indices: expected shape [b] = [{batch}] (one slot per row of "
                         f"{ref_name}), got {tuple(indices.shape)}")
    if batch == 0:
        return
    if bool(xp.any(indices < 0)) or bool(xp.any(indices >= pool)):
        raise ValueError(f"state_batch_indices: expected slots in [0, {pool}) (the pool's rows), got "
                         f"{int(xp.min(indices))} to {int(xp.max(indices))}")
    if bool(xp.any(xp.sum(xp.astype(_hits(indices, pool, xp=xp), xp.int32), axis=1) > 1)):
        raise ValueError("state_batch_indices: expected distinct slots, got a slot named twice")


def _hits(indices: Array, pool: int, *, xp: Namespace) -> Array:
    """``[pool, b]``: slot s is written by row i."""
    return xp.arange(pool, dtype=indices.dtype, device=device(indices))[:, None] == indices[None, :]


def gather_rows(pool: Array, indices: Array, *, xp: Namespace) -> Array:
    """The slots ``indices [b]`` of ``pool [pool, ...]``: ``[b, ...]``."""
    return xp.take(pool, indices, axis=0)


def scatter_rows(pool: Array, indices: Array, rows: Array, *, xp: Namespace) -> Array:
    """A new ``pool [pool, ...]`` with slot ``indices[i]`` replaced by ``rows[i]`` (distinct indices)."""
    if indices.shape[0] == 0:
        return pool
    hits = _hits(indices, pool.shape[0], xp=xp)  # [pool, b]
    written = xp.reshape(xp.any(hits, axis=1), (pool.shape[0],) + (1,) * (pool.ndim - 1))  # [pool, 1, ...]
    source = xp.argmax(xp.astype(hits, xp.int32), axis=1)  # the row writing each slot (0 where none), [pool]
    return xp.where(written, xp.take(rows, source, axis=0), pool)


def gather_state(pool: Any, indices: Array, *, xp: Namespace) -> Any:
    """Every layer's slots ``indices [b]`` of a state pool (a Mamba2State)."""
    return pool._replace(conv=tuple(gather_rows(a, indices, xp=xp) for a in pool.conv),
                         ssm=tuple(gather_rows(a, indices, xp=xp) for a in pool.ssm))


def scatter_state(pool: Any, indices: Array, rows: Any, *, xp: Namespace) -> Any:
    """A new state pool with every layer's slots ``indices`` replaced by ``rows`` (Mamba2States)."""
    return pool._replace(conv=tuple(scatter_rows(a, indices, r, xp=xp) for a, r in zip(pool.conv, rows.conv)),
                         ssm=tuple(scatter_rows(a, indices, r, xp=xp) for a, r in zip(pool.ssm, rows.ssm)))


def _layers(name: str, state: Any) -> list[tuple[str, Array]]:
    """``(label, array)`` for every layer of a Mamba2State, checked to be one (at least one layer)."""
    if not isinstance(state, Mamba2State):
        raise TypeError(f"{name}: expected a Mamba2State (from empty_state or lm.logits(..., return_state=True)), "
                        f"got {type(state).__name__}")
    if not isinstance(state.conv, tuple) or not isinstance(state.ssm, tuple) or not state.ssm:
        raise TypeError(f"{name}: expected tuples of per-layer arrays in .conv and .ssm, got "
                        f"{type(state.conv).__name__} and {type(state.ssm).__name__}")
    return [(f"{name}.{kind}[{i}]", a) for kind in ("conv", "ssm") for i, a in enumerate(getattr(state, kind))]


def check_state_fits(pool: Any, state: Any) -> Namespace:
    """The namespace, after checking that ``state`` (batch b) can be written into ``pool``: both
    Mamba2States of one backend and device, with the same layer count, and every layer of
    ``state`` the pool's dtype and shape beyond the batch axis (d_conv, d_state, heads...);
    every pool layer has the pool's slot count. TypeError/ValueError naming the layer."""
    pool_layers, state_layers = _layers("pool", pool), _layers("state", state)
    xp = namespace(**dict(pool_layers), **dict(state_layers))
    for kind in ("conv", "ssm"):
        if len(getattr(state, kind)) != len(getattr(pool, kind)):
            raise ValueError(f"state.{kind}: expected {len(getattr(pool, kind))} layers (the pool's), "
                             f"got {len(getattr(state, kind))}")
    slots, batch = pool.ssm[0].shape[0], state.ssm[0].shape[0]
    for (pool_label, p), (label, a) in zip(pool_layers, state_layers):
        if p.shape[0] != slots:
            raise ValueError(f"{pool_label}: expected {slots} slots like pool.ssm[0], got shape {tuple(p.shape)}")
        if a.ndim != p.ndim or a.shape[0] != batch or tuple(a.shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(f"{label}: expected shape {(batch, *p.shape[1:])} ({pool_label} is "
                             f"{tuple(p.shape)}, the state's batch {batch} from state.ssm[0]), got {tuple(a.shape)}")
        if a.dtype != p.dtype:
            raise TypeError(f"{label} is {dtype_name(a.dtype)} but {pool_label} is {dtype_name(p.dtype)}; "
                            f"cast one of them explicitly")
        check_same_device(label, a, pool_label, p)
    return xp


def write_state(pool: Any, slots: Array, state: Any) -> Any:
    """Public form of :func:`scatter_state`: ``state`` (batch b, e.g. a prefill's) written into the
    pool's ``slots [b]`` (distinct integers in ``[0, pool)``); a new pool, the old one untouched.
    TypeError/ValueError naming the argument for a state of another layer count, dtype, backend,
    device or layer shape than the pool's (:func:`check_state_fits`), or bad slots."""
    xp = check_state_fits(pool, state)
    check_state_batch_indices(slots, pool.ssm[0].shape[0], state.ssm[0].shape[0], "state", state.ssm[0], xp=xp)
    return scatter_state(pool, slots, state, xp=xp)
