"""Generation options, checked at the door, and the logits processors they stand for (transformers' semantics).

Per step the scores ``[b, vocab]`` go, in transformers' order, through: ``repetition_penalty``
(positive scores of tokens seen in the prompt or generated so far are divided by it, negative ones
multiplied; masked padding is not "seen"), ``min_new_tokens`` (the eos ids score -inf until that
many tokens are out), the user's ``logits_processor(ids_so_far, scores) -> scores``, then the
sampling (temperature, top-k, top-p; :mod:`portable_ssm.generation`).

A row finishes when it emits an eos id or when its generated tokens end with one of the ``stop``
sequences (only this call's generated tokens are matched, not the prompt); after that it emits
``pad_token_id`` (default: the first eos id), as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._array import Array, Namespace, constant, device
from ._checks import check_positive_int

#: Prompt positions compared against the vocabulary at a time when the seen tokens are collected.
_SEEN_BLOCK = 64


@dataclass(frozen=True)
class Options:
    """Checked options of one generation call."""

    new: int  # tokens to add
    min_new: int
    temperature: float  # 0: greedy
    top_k: int | None
    top_p: float | None
    penalty: float | None
    eos: tuple[int, ...]
    fill: int | None  # what finished rows emit
    stop: tuple[tuple[int, ...], ...]
    processor: Callable[[Array, Array], Array] | None
    vocab: int
    seed: int | None
    compile: bool | None  # the decode step compiled: None as the backend does by default


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> float:
    """The temperature as a float after checking the three sampling arguments."""
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0
            or not math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a number >= 0 (0 is greedy), finite, got {temperature!r}")
    check_positive_int("top_k", top_k, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a number in (0, 1] or None, got {top_p!r}")
    return float(temperature)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_id(name: str, v: Any, limit: int) -> int:
    if not _is_int(v) or not 0 <= v < limit:
        raise ValueError(f"{name}: expected a token id in [0, {limit}), got {v!r}")
    return v


def check_id_list(name: str, value: Any, limit: int) -> tuple[int, ...]:
    """None, one id or a sequence of ids -> a tuple of ids."""
    if value is None:
        return ()
    values = [value] if _is_int(value) else value
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"{name}: expected None, an int or a list of ints, got {type(value).__name__}")
    if not values or any(not _is_int(v) or not 0 <= v < limit for v in values):
        raise ValueError(f"{name}: expected None or an int in [0, {limit}) (or a non-empty list of them), "
                         f"got {value!r}")
    return tuple(values)


def _check_stop(stop: Any, vocab: int) -> tuple[tuple[int, ...], ...]:
    if stop is None:
        return ()
    if not isinstance(stop, Sequence) or not all(isinstance(s, Sequence) and not isinstance(s, str) for s in stop):
        raise TypeError(f"stop: expected a list of token id sequences (e.g. [[13, 13]]), got {stop!r}")
    out = tuple(tuple(_check_id(f"stop[{i}][{j}]", v, vocab) for j, v in enumerate(s)) for i, s in enumerate(stop))
    if any(len(s) == 0 for s in out):
        raise ValueError("stop: expected non-empty token id sequences, got an empty one")
    return out


def _check_count(name: str, value: Any) -> int | None:
    if value is not None and (not _is_int(value) or value < 0):
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return value


def _new_tokens(max_new_tokens: Any, max_length: Any, length: int) -> int:
    """max_new_tokens wins over max_length (the prompt's padded length plus the new tokens)."""
    max_new_tokens, max_length = _check_count("max_new_tokens", max_new_tokens), _check_count("max_length", max_length)
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is None:
        raise ValueError("max_new_tokens: expected max_new_tokens or max_length, got neither")
    if max_length < length:
        raise ValueError(f"max_length: expected at least the prompt's length {length}, got {max_length}")
    return max_length - length


def _temperature(do_sample: Any, temperature: Any, top_k: Any, top_p: Any) -> float:
    """do_sample=False: greedy; True: sample at ``temperature`` (default 1); None: sample iff temperature > 0."""
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"do_sample: expected a bool or None, got {type(do_sample).__name__}")
    t = check_sampling(1.0 if temperature is None and do_sample else temperature or 0.0, top_k, top_p)
    if do_sample and t == 0:
        raise ValueError("temperature: do_sample=True needs a temperature > 0, got 0")
    return 0.0 if do_sample is False else t


def check_options(length: int, rows: int, *, max_new_tokens: Any = None, max_length: Any = None,
                  min_new_tokens: Any = None, do_sample: Any = None, temperature: Any = None, top_k: Any = None,
                  top_p: Any = None, repetition_penalty: Any = None, seed: Any = None, eos_token_id: Any = None,
                  pad_token_id: Any = None, stop: Any = None, logits_processor: Any = None,
                  vocab_size: Any = None, compile: Any = None) -> Options:
    """Every option of :func:`portable_ssm.generation.generate` checked, for a prompt of ``length``
    columns and a head of ``rows`` logits."""
    vocab = rows if vocab_size is None else vocab_size
    if not _is_int(vocab) or not 0 < vocab <= rows:
        raise ValueError(f"vocab_size: expected an int in [1, {rows}] (the logits' rows), got {vocab_size!r}")
    if repetition_penalty is not None and (isinstance(repetition_penalty, bool) or not isinstance(
            repetition_penalty, (int, float)) or not repetition_penalty > 0):
        raise ValueError(f"repetition_penalty: expected a number > 0 or None, got {repetition_penalty!r}")
    if seed is not None and not _is_int(seed):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    if logits_processor is not None and not callable(logits_processor):
        raise TypeError(f"logits_processor: expected a callable (ids_so_far, scores) -> scores, got "
                        f"{type(logits_processor).__name__}")
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile: expected True, False or None (the backend's default), got {type(compile).__name__}")
    eos = check_id_list("eos_token_id", eos_token_id, vocab)
    fill = eos[0] if pad_token_id is None and eos else pad_token_id
    if fill is not None:
        _check_id("pad_token_id", fill, rows)
    stops = _check_stop(stop, vocab)
    if stops and fill is None:
        raise ValueError("stop: finished rows need a filler, pass pad_token_id or eos_token_id")
    return Options(new=_new_tokens(max_new_tokens, max_length, length),
                   min_new=_check_count("min_new_tokens", min_new_tokens) or 0,
                   temperature=_temperature(do_sample, temperature, top_k, top_p), top_k=top_k, top_p=top_p,
                   penalty=None if repetition_penalty in (None, 1, 1.0) else float(repetition_penalty), eos=eos,
                   fill=fill, stop=stops, processor=logits_processor, vocab=vocab, seed=seed,
                   compile=compile)


def seen_tokens(ids: Array, valid: Array | None, vocab: int, *, xp: Namespace) -> Array:
    """``[b, vocab]`` bool: the token occurs in ``ids [b, l]`` at a position where ``valid [b, l]``
    (None: everywhere)."""
    b, l = ids.shape
    cols = xp.arange(vocab, dtype=ids.dtype, device=device(ids))
    seen = xp.zeros((b, vocab), dtype=xp.bool, device=device(ids))
    for start in range(0, l, _SEEN_BLOCK):
        hit = ids[:, start:start + _SEEN_BLOCK, None] == cols  # [b, t, vocab]
        if valid is not None:
            hit = hit & valid[:, start:start + _SEEN_BLOCK, None]
        seen = seen | xp.any(hit, axis=1)
    return seen


def add_seen(seen: Array, token: Array, *, xp: Namespace) -> Array:
    """``seen [b, vocab]`` with each row's ``token [b]`` added."""
    return seen | (token[:, None] == xp.arange(seen.shape[1], dtype=token.dtype, device=device(token)))


def penalize(scores: Array, seen: Array, penalty: float, *, xp: Namespace) -> Array:
    """transformers' RepetitionPenaltyLogitsProcessor on ``scores [b, vocab]``."""
    return xp.where(seen, xp.where(scores < 0, scores * penalty, scores / penalty), scores)


def ban(scores: Array, ids: tuple[int, ...], *, xp: Namespace) -> Array:
    """``scores [b, vocab]`` with the columns ``ids`` set to -inf."""
    cols = xp.arange(scores.shape[1], device=device(scores))
    banned = cols == ids[0]
    for i in ids[1:]:
        banned = banned | (cols == i)
    return xp.where(banned, constant(-math.inf, scores, xp=xp), scores)


def finishing(token: Array, generated: list[Array], options: Options, *, xp: Namespace) -> Array | None:
    """``[b]`` bool: the row's newest ``token`` is an eos id or ends a stop sequence of its
    ``generated`` tokens (the newest last); None when there is neither eos nor stop."""
    hits = [token == e for e in options.eos]
    for seq in options.stop:
        if len(seq) <= len(generated):
            match = generated[-len(seq)] == seq[0]
            for back, want in zip(generated[len(generated) - len(seq) + 1:], seq[1:]):
                match = match & (back == want)
            hits.append(match)
    if not hits:
        return None if not (options.eos or options.stop) else xp.zeros(token.shape, dtype=xp.bool,
                                                                        device=device(token))
    out = hits[0]
    for h in hits[1:]:
        out = out | h
    return out
