"""Autoregressive generation with a real cache: one chunked-scan prefill, then one recurrent step per token.

The prompt ``[b, l]`` goes through :func:`portable_ssm.lm.logits` once with ``return_state=True``;
each new token then costs one :func:`portable_ssm.lm.logits_step` on the per-layer conv and SSM
states, so memory per token is constant whatever the length. The tokens equal those of recomputing
the full forward over the whole sequence at every step.

Choosing a token from ``logits [b, V]`` (:func:`next_token`):

* ``temperature == 0``: greedy, ``argmax`` (the first maximum on ties); top_k/top_p are ignored.
* ``temperature > 0``: scores ``logits / temperature`` in float32 (float64 stays float64), top-k
  keeps the k largest scores, top-p keeps the smallest set of most likely tokens whose probability
  reaches ``top_p``; then the Gumbel-max trick, ``argmax(scores + gumbel)``, which draws exactly
  from ``softmax(scores)``. The Gumbel noise ``[b, V]`` is drawn on the host from numpy's generator
  (``portable_ssm.backends.load("numpy").rng(seed)``) and moved to the logits' backend, so one seed
  gives the same tokens on every backend (up to rounding of near ties).

End of sequence: ``eos_token_id`` is one id or several; a row that emitted one of them keeps
emitting the first (transformers' padding when ``pad_token_id`` is unset); generation stops early
once every row has finished, so the result has ``new <= max_new_tokens`` columns.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from ._array import Array, Namespace, array_backend, compute_dtype, constant, device, dtype_name, namespace
from ._checks import check_positive_int
from .backends import load, to_backend
from .config import Mamba2Config
from .lm import logits as lm_logits
from .lm import logits_step
from .params import Params, check_params


def _check_sampling(temperature: Any, top_k: Any, top_p: Any) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature: expected a number >= 0 (0 is greedy), got {temperature!r}")
    check_positive_int("top_k", top_k, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a number in (0, 1] or None, got {top_p!r}")
    return float(temperature)


def check_eos_ids(eos_token_id: Any, vocab: int) -> tuple[int, ...]:
    """``eos_token_id`` (None, an int or a non-empty sequence of ints, each in ``[0, vocab)``) as a tuple."""
    ids = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (tuple, list)) or (eos_token_id is not None and not ids) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
        raise ValueError(f"eos_token_id: expected None or an int in [0, {vocab}) (or a non-empty sequence "
                         f"of them), got {eos_token_id!r}")
    return tuple(ids)


def check_token_ids(name: str, ids: Array, rows: int, *, xp: Namespace) -> None:
    """ValueError unless every id of the integer array ``ids`` lies in ``[0, rows)`` (one host sync)."""
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{name}: expected an integer dtype, got {dtype_name(ids.dtype)}")
    if ids.size and (bool(xp.any(ids < 0)) or bool(xp.any(ids >= rows))):
        raise ValueError(f"{name}: expected token ids in [0, {rows}), got ids from {int(xp.min(ids))} "
                         f"to {int(xp.max(ids))}")


def _mask_below(scores: Array, threshold: Array, *, xp: Namespace) -> Array:
    """``scores`` with every entry below its row's ``threshold [b, 1]`` set to -inf."""
    return xp.where(scores < threshold, constant(-math.inf, scores, xp=xp), scores)


def _top_k(scores: Array, k: int, *, xp: Namespace) -> Array:
    ranked = xp.sort(scores, axis=-1, descending=True)  # [b, V]
    return _mask_below(scores, ranked[:, k - 1:k], xp=xp)


def _top_p(scores: Array, p: float, *, xp: Namespace) -> Array:
    ranked = xp.sort(scores, axis=-1, descending=True)  # [b, V]
    probs = xp.exp(ranked - ranked[:, :1])
    probs = probs / xp.sum(probs, axis=-1, keepdims=True)
    before = xp.cumulative_sum(probs, axis=-1) - probs  # probability of the more likely tokens
    kept = xp.where(before < p, ranked, constant(math.inf, ranked, xp=xp))  # the first token is always kept
    return _mask_below(scores, xp.min(kept, axis=-1, keepdims=True), xp=xp)


def _choose(logits: Array, temperature: float, top_k: int | None, top_p: float | None, rng: Any, *,
            xp: Namespace) -> Array:
    """``logits [b, V]`` -> token ids ``[b]`` (see the module docstring)."""
    if temperature == 0:
        return xp.argmax(logits, axis=-1)
    cdtype = compute_dtype(xp, logits.dtype)
    scores = xp.astype(logits, cdtype) / temperature  # [b, V]
    if top_k is not None and top_k < scores.shape[-1]:
        scores = _top_k(scores, top_k, xp=xp)
    if top_p is not None and top_p < 1:
        scores = _top_p(scores, top_p, xp=xp)
    host = load("numpy").namespace()
    u = rng.uniform(host.finfo(host.float64).tiny, 1.0, size=tuple(scores.shape))
    gumbel = to_backend(-host.log(-host.log(u)), array_backend(scores), device=device(scores),
                        dtype=dtype_name(cdtype))  # [b, V]
    return xp.argmax(scores + gumbel, axis=-1)


def next_token(logits: Array, *, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, rng: Any = None) -> Array:
    """One token per row from ``logits [b, V]``: ids ``[b]`` on logits' backend.

    ``temperature == 0`` is greedy; otherwise ``rng`` (a ``numpy.random.Generator``, e.g.
    ``portable_ssm.backends.load("numpy").rng(seed)``) supplies the Gumbel noise.
    """
    xp = namespace(logits=logits)
    temperature = _check_sampling(temperature, top_k, top_p)
    if logits.ndim != 2:
        raise ValueError(f"logits: expected shape [b, V], got {tuple(logits.shape)}")
    if not xp.isdtype(logits.dtype, "real floating"):
        raise TypeError(f"logits: expected a real floating dtype, got {dtype_name(logits.dtype)}")
    if temperature > 0 and not hasattr(rng, "uniform"):
        raise TypeError(f"rng: temperature > 0 needs a numpy.random.Generator, got {type(rng).__name__}")
    return _choose(logits, temperature, top_k, top_p, rng, xp=xp)


def stream(input_ids: Array, params: Params, *, config: Mamba2Config, max_new_tokens: int,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
           vocab_size: int | None = None) -> Iterator[Array]:
    """The new tokens ``[b]`` (input_ids' dtype) one at a time, as they are chosen.

    Arguments as :func:`generate`; they are all checked before this returns.
    """
    xp = check_params(params, config)
    namespace(input_ids=input_ids, params=params["embedding.weight"])
    rows = config.padded_vocab_size
    if rows is None:
        raise ValueError("config.vocab_size: generation needs a language model, got None")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected shape [b, l] with l >= 1, got {tuple(input_ids.shape)}")
    check_token_ids("input_ids", input_ids, rows, xp=xp)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    temperature = _check_sampling(temperature, top_k, top_p)
    vocab = rows if vocab_size is None else vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= rows:
        raise ValueError(f"vocab_size: expected an int in [1, {rows}] (the logits' rows), got {vocab_size!r}")
    eos = check_eos_ids(eos_token_id, vocab)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    rng = load("numpy").rng(seed) if temperature > 0 else None
    return _tokens(input_ids, params, config, max_new_tokens, (temperature, top_k, top_p, rng),
                   eos, vocab, xp=xp)


def _tokens(input_ids: Array, params: Params, config: Mamba2Config, max_new_tokens: int, sampling: tuple,
            eos: tuple[int, ...], vocab: int, *, xp: Namespace) -> Iterator[Array]:
    if max_new_tokens == 0:
        return
    out, state = lm_logits(input_ids, params, config=config, return_state=True)  # [b, l, rows]
    last = out[:, -1, :]  # [b, rows]
    finished = None
    for i in range(max_new_tokens):
        token = xp.astype(_choose(last[:, :vocab], *sampling, xp=xp), input_ids.dtype)  # [b]
        if eos:
            token = token if finished is None else xp.where(finished, xp.full_like(token, eos[0]), token)
            finished = token == eos[0]
            for other in eos[1:]:
                finished = finished | (token == other)
        yield token
        if i + 1 == max_new_tokens or (finished is not None and bool(xp.all(finished))):
            return
        last, state = logits_step(token, state, params, config=config)  # [b, rows]


def generate(input_ids: Array, params: Params, *, config: Mamba2Config, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             vocab_size: int | None = None) -> Array:
    """The prompt followed by up to ``max_new_tokens`` new tokens: ``input_ids [b, l] -> [b, l + new]``.

    Args:
        input_ids: integer prompt ids ``[b, l]`` (``l >= 1``) on the params' backend.
        params, config: a language model (``config.vocab_size`` set).
        max_new_tokens: how many tokens to add (0 returns the prompt).
        temperature, top_k, top_p: sampling (module docstring); ``temperature=0`` is greedy.
        seed: seeds the host generator of the sampling noise (None: fresh entropy).
        eos_token_id: an id or several: a row that emitted one is finished and keeps emitting the
            first; all rows finished stops early.
        vocab_size: only ids below it are chosen (checkpoints pad the vocabulary rows); default
            all ``config.padded_vocab_size`` rows.
    """
    tokens = list(stream(input_ids, params, config=config, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         eos_token_id=eos_token_id, vocab_size=vocab_size))
    xp = namespace(input_ids=input_ids)
    if not tokens:
        return input_ids
    return xp.concat([input_ids, xp.stack(tokens, axis=1)], axis=1)  # [b, l + new]
