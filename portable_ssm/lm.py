"""The language-model ends of the stack: token embedding in front, (tied) vocabulary head behind.

``logits`` maps token ids ``[b, l]`` to ``[b, l, padded_vocab]`` through ``embedding.weight``,
the backbone and ``lm_head.weight`` (``embedding.weight`` itself when ``tie_embeddings``);
``seq_idx`` packs several token sequences into one row, as in :func:`portable_ssm.forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._array import Array, Namespace, namespace
from ._checks import Shapes
from .config import Mamba2Config
from .mixer import _linear, mixer_step
from .model import Mamba2State, _blocks, _check_state, _sequence_mixer, run_sequence
from .params import Params, check_params
from .quantized import QuantizedWeight, take_rows


def _check_ids(ids: Array, config: Mamba2Config, spec: tuple[str, ...], *, xp: Namespace) -> Shapes:
    if config.vocab_size is None:
        raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"input_ids: expected an integer dtype, got {ids.dtype}")
    shapes = Shapes()
    shapes.check("input_ids", ids, spec)
    return shapes


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
           seq_idx: Array | None = None, layer: Callable[..., Any] | None = None
           ) -> Array | tuple[Array, Mamba2State]:
    """Next-token logits ``[b, l, padded_vocab]`` for ``input_ids [b, l]`` (integers).

    With ``initial_state`` the ids continue an earlier sequence; ``return_state`` also returns the
    state after the last token, for :func:`logits_step`. ``seq_idx [b, l]`` (integer ids,
    non-decreasing along l) marks packed sequences: state and conv window reset wherever it
    changes; initial_state feeds each row's first sequence, the returned state is its last one's.
    ``layer`` stands in for each layer's mixer, as in :func:`portable_ssm.forward`.
    """
    xp = check_params(params, config)
    namespace(input_ids=input_ids, params=params["embedding.weight"])
    shapes = _check_ids(input_ids, config, ("b", "l"), xp=xp)
    run = _sequence_mixer(seq_idx, shapes, "input_ids", input_ids, xp=xp, layer=layer)
    x = embed(input_ids, params, xp=xp)  # [b, l, d_model]
    if initial_state is not None:
        _check_state(initial_state, config, x, shapes, "initial_state", xp=xp)
    hidden, state = run_sequence(x, params, config, initial_state, run, xp=xp)
    out = _linear(hidden, head_weight(params, config), None, xp=xp)  # [b, l, vocab]
    return (out, state) if return_state else out


def logits_step(token: Array, state: Mamba2State, params: Params, *,
                config: Mamba2Config) -> tuple[Array, Any]:
    """One decode step: ``token [b]`` (integers) -> ``(logits [b, padded_vocab], new_state)``."""
    xp = check_params(params, config)
    namespace(token=token, params=params["embedding.weight"])
    shapes = _check_ids(token, config, ("b",), xp=xp)
    x = embed(token, params, xp=xp)  # [b, d_model]
    _check_state(state, config, x, shapes, "state", xp=xp)
    hidden, state = _blocks(x, params, config, state, mixer_step, xp=xp)
    return _linear(hidden, head_weight(params, config), None, xp=xp), state
