"""The language-model ends of the stack: token embedding in front, (tied) vocabulary head behind.

``logits`` maps token ids ``[b, l]`` to ``[b, l, padded_vocab]`` through ``embedding.weight``,
the backbone and ``lm_head.weight`` (``embedding.weight`` itself when ``tie_embeddings``);
``seq_idx`` packs several token sequences into one row, as in :func:`portable_ssm.forward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from ._array import Array, Namespace, dtype_name, is_traced, namespace
from ._checks import Shapes, check_bool, check_given
from .backends import fast_op
from .config import Mamba2Config
from .mixer import _linear, mixer, mixer_step
from .model import Mamba2State, _blocks, _check_state, _sequence_mixer, check_backends, pool_blocks, run_sequence
from .padding import check_attention_mask, padded_layer
from .params import Params, check_params
from .quantized import QuantizedWeight, take_rows


def check_token_ids(name: str, ids: Array, rows: int, *, xp: Namespace) -> None:
    """TypeError unless ``ids`` has an integer dtype (float ids are never truncated, bool ids never
    read as 0/1); ValueError unless every id lies in ``[0, rows)`` (one host sync; traced ids, whose
    values are not known yet, are checked when they are concrete)."""
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{name}: expected an integer dtype, got {dtype_name(ids.dtype)}")
    if math.prod(ids.shape) and not is_traced(ids) and (bool(xp.any(ids < 0)) or bool(xp.any(ids >= rows))):
        raise ValueError(f"{name}: expected token ids in [0, {rows}), got ids from {int(xp.min(ids))} "
                         f"to {int(xp.max(ids))}")


def check_prompt(input_ids: Array, attention_mask: Array | None, rows: int,
                 embedding: Array) -> tuple[Namespace, Array | None]:
    """A language model's prompt at the door: ``input_ids [b, l]`` token ids in ``[0, rows)`` on
    the backend of ``embedding`` (the model's ``params['embedding.weight']``) and ``attention_mask
    [b, l]`` (left padding) or None. Returns ``(xp, pad)``: the namespace and each row's padding
    length ``[b]`` (None when nothing is masked)."""
    xp = namespace(input_ids=input_ids, **{"params['embedding.weight']": embedding})
    shapes = Shapes()
    shapes.check("input_ids", input_ids, ("b", "l"))
    check_token_ids("input_ids", input_ids, rows, xp=xp)
    pad = None if attention_mask is None else check_attention_mask(attention_mask, shapes, "input_ids", input_ids,
                                                                   xp=xp)
    return xp, pad


def _check_ids(ids: Array, config: Mamba2Config, spec: tuple[str, ...], *, xp: Namespace,
               name: str = "input_ids") -> Shapes:
    shapes = Shapes()
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{name}: expected an integer dtype, got {dtype_name(ids.dtype)}")
    shapes.check(name, ids, spec)
    check_token_ids(name, ids, config.padded_vocab_size, xp=xp)
    return shapes


def _check_lm(params: Params, config: Mamba2Config) -> Namespace:
    """``check_params`` for a language model: ValueError unless ``config.vocab_size`` is set."""
    xp = check_params(params, config)
    if config.vocab_size is None:
        raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
    return xp


def head_weight(params: Params, config: Mamba2Config) -> Array:
    """The ``[padded_vocab, d_model]`` output projection (the embedding when tied)."""
    return params["embedding.weight"] if config.tie_embeddings else params["lm_head.weight"]


def embed(ids: Array, params: Params, *, xp: Namespace) -> Array:
    """``ids [...]`` -> ``[..., d_model]`` rows of ``embedding.weight`` (widened to float32 when quantized)."""
    table = params["embedding.weight"]
    flat_ids = xp.reshape(ids, (-1,))  # [prod(ids.shape)]
    if isinstance(table, QuantizedWeight):
        flat = take_rows(table, flat_ids, xp=xp)  # [prod(ids.shape), d_model]
    else:
        flat = xp.take(table, flat_ids, axis=0)  # [prod(ids.shape), d_model]
    return xp.reshape(flat, (*ids.shape, table.shape[1]))  # [..., d_model]


def logits(input_ids: Array, params: Params, *, config: Mamba2Config,
           initial_state: Mamba2State | None = None, return_state: bool = False,
           seq_idx: Array | None = None, layer: Callable[..., Any] | None = None,
           attention_mask: Array | None = None, cu_seqlens: Array | None = None) -> Array | tuple[Array, Mamba2State]:
    """Next-token logits ``[b, l, padded_vocab]`` for ``input_ids [b, l]`` (integers).

    With ``initial_state`` the ids continue an earlier sequence; ``return_state`` also returns the
    state after the last token, for :func:`logits_step`. ``seq_idx [b, l]`` (integer ids,
    non-decreasing along l) marks packed sequences: state and conv window reset wherever it
    changes; initial_state feeds each row's first sequence, the returned state is its last one's.
    ``layer`` stands in for each layer's mixer, as in :func:`portable_ssm.forward`.
    ``attention_mask [b, l]`` (1/True tokens, 0/False left padding): each row gives what it gives
    alone without its padding, as in :func:`portable_ssm.forward`.
    ``cu_seqlens [n_seq + 1]`` packs n_seq sequences into a batch-1 row with one state each, in
    (initial_state of batch n_seq) and out, as in :func:`portable_ssm.forward`.
    """
    xp = _check_lm(params, config)
    check_given(input_ids=input_ids)
    check_bool("return_state", return_state)
    check_backends("input_ids", input_ids, params, initial_state, "initial_state")
    shapes = _check_ids(input_ids, config, ("b", "l"), xp=xp)
    run = _sequence_mixer(seq_idx, shapes, "input_ids", input_ids, xp=xp, layer=layer, cu_seqlens=cu_seqlens)
    run = padded_layer(run, attention_mask, seq_idx, shapes, "input_ids", input_ids, xp=xp, cu_seqlens=cu_seqlens)
    x = embed(input_ids, params, xp=xp)  # [b, l, d_model]
    if initial_state is not None:
        _check_state(initial_state, config, x, shapes, "initial_state", xp=xp,
                     batch="b" if cu_seqlens is None else "s")
    hidden, state = run_sequence(x, params, config, initial_state, run, xp=xp)
    out = _linear(hidden, head_weight(params, config), None, xp=xp)  # [b, l, vocab]
    return (out, state) if return_state else out


def logits_step(token: Array, state: Mamba2State, params: Params, *, config: Mamba2Config,
                state_batch_indices: Array | None = None) -> tuple[Array, Any]:
    """One decode step: ``token [b]`` (integers) -> ``(logits [b, padded_vocab], new_state)``.

    With ``state_batch_indices [b]`` (distinct integers) ``state`` is a pool of ``[pool, ...]``
    states: row i reads and updates slot ``state_batch_indices[i]`` and the new pool is returned
    (:mod:`portable_ssm.state_pool`)."""
    xp = _check_lm(params, config)
    check_given(token=token)
    check_backends("token", token, params, state)
    shapes = _check_ids(token, config, ("b",), xp=xp, name="token")
    if state_batch_indices is not None:
        x = embed(token, params, xp=xp)  # [b, d_model]
        hidden, state = pool_blocks(x, state, state_batch_indices, params, config, "token", token, xp=xp)
        return _linear(hidden, head_weight(params, config), None, xp=xp), state
    _check_state(state, config, params["embedding.weight"], shapes, "state", xp=xp)  # x's dtype and device
    return decode(token, state, params, config=config, xp=xp)


def prefill(input_ids: Array, state: Mamba2State | None, pad: Array | None, params: Params, *,
            config: Mamba2Config, xp: Namespace, last_only: bool = True) -> tuple[Array, Mamba2State]:
    """:func:`logits` on checked arguments for the last position only: ``(logits [b, padded_vocab]
    after the last token, state)``; ``pad [b]``: left-padding lengths or None (what generation runs,
    compiled on JAX). ``last_only=False``: every position's, ``[b, l, padded_vocab]``."""
    run = mixer if pad is None else partial(mixer, pad=pad)
    hidden, state = run_sequence(embed(input_ids, params, xp=xp), params, config, state, run, xp=xp,
                                 last_only=last_only)  # [b, 1 or l, d_model]
    return _linear(hidden[:, -1, :] if last_only else hidden, head_weight(params, config), None, xp=xp), state


def decode(token: Array, state: Mamba2State, params: Params, *, config: Mamba2Config,
           xp: Namespace) -> tuple[Array, Mamba2State]:
    """:func:`logits_step` on checked arguments (what generation runs, compiled on JAX). A backend
    may take the whole step after the embedding in one native call (``fast_op(xp, "decode_model")``
    with ``(x [b, d_model], state, params, config)``, returning ``(logits, state)``, or None for
    inputs it does not take); the array-API stack below is the reference it is tested against."""
    x = embed(token, params, xp=xp)  # [b, d_model]
    native = fast_op(xp, "decode_model")
    fused = None if native is None else native(x, state, params, config)
    if fused is not None:
        return fused
    hidden, state = _blocks(x, params, config, state, mixer_step, xp=xp)
    return _linear(hidden, head_weight(params, config), None, xp=xp), state
