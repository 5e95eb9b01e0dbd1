"""Generation options, checked at the door, and the logits processors they stand for (transformers' semantics).

Per step the scores ``[b, vocab]`` go, in transformers' order, through: ``repetition_penalty``
(positive scores of tokens seen in the prompt or generated so far are divided by it, negative ones
multiplied; masked padding is not "seen"), ``min_new_tokens`` (the eos ids score -inf until that
many tokens are out), the user's ``logits_processor(ids_so_far, scores) -> scores``, then the
sampling (temperature, top-k, top-p; :mod:`portable_ssm.generation`).

A row finishes when it emits an eos id or when its generated tokens end with one of the ``stop``
sequences (only this call's generated tokens are matched, not the prompt); after that it emits
``pad_token_id`` (default: the first eos id), as transformers does.

Every option is checked before any compute by one validator per option (:data:`VALIDATORS`),
the same that checks a ``generation_config`` (:func:`check_generation_config`, used by
:class:`portable_ssm.Mamba2LM` and by the ``generation_config.json`` reader): a value of the wrong
type is a TypeError, one out of range a ValueError, each naming the option, what it expects and
what it got. An int is a Python or NumPy integer, never a bool; a number is a real int or float,
never a bool or a str; nothing is converted silently.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._array import Array, Namespace, constant, device

#: The default ``eos_token_id`` of the models' ``generate`` and ``stream``: the checkpoint's own.
CHECKPOINT_EOS = "checkpoint"

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


def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _wrong_type(name: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"{name}: expected {expected}, got {type(value).__name__} {_shown(value)}")


def _out_of_range(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {_shown(value)}")


def _int(name: str, value: Any, expected: str, ok: Callable[[int], bool]) -> int:
    """``value`` as an int: TypeError unless it is one, ValueError unless ``ok``."""
    if not is_int(value):
        raise _wrong_type(name, expected, value)
    if not ok(int(value)):
        raise _out_of_range(name, expected, value)
    return int(value)


def _number(name: str, value: Any, expected: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float: TypeError unless it is a real number, ValueError unless ``ok`` (NaN never is)."""
    if not _is_number(value):
        raise _wrong_type(name, expected, value)
    if math.isnan(value) or not ok(float(value)):
        raise _out_of_range(name, expected, value)
    return float(value)


def check_count(name: str, value: Any) -> int | None:
    """None or an int >= 0 (max_new_tokens, max_length, min_new_tokens)."""
    return None if value is None else _int(name, value, "an int >= 0", lambda v: v >= 0)


def check_temperature(name: str, value: Any) -> float | None:
    """None or a finite number >= 0 (0 is greedy)."""
    return None if value is None else _number(name, value, "a number >= 0 (0 is greedy), finite",
                                              lambda v: 0 <= v < math.inf)


def check_top_k(name: str, value: Any) -> int | None:
    """None or an int >= 1."""
    return None if value is None else _int(name, value, "a positive int", lambda v: v >= 1)


def check_top_p(name: str, value: Any) -> float | None:
    """None or a number in (0, 1]."""
    return None if value is None else _number(name, value, "a number in (0, 1] or None", lambda v: 0 < v <= 1)


def check_penalty(name: str, value: Any) -> float | None:
    """None or a finite number > 0 (1: no penalty)."""
    return None if value is None else _number(name, value, "a number > 0, finite, or None",
                                              lambda v: 0 < v < math.inf)


def check_seed(name: str, value: Any) -> int | None:
    """None or an int >= 0 (NumPy's generator takes no negative seed)."""
    if value is not None and not is_int(value):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__} {_shown(value)}")
    return None if value is None else _int(name, value, "an int >= 0 or None", lambda v: v >= 0)


def check_flag(name: str, value: Any) -> bool | None:
    """None, True or False (no 0/1, no strings)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}: expected True, False or None, got {type(value).__name__} {_shown(value)}")
    return value


def check_id(name: str, value: Any, limit: int | None) -> int:
    """A token id: an int in ``[0, limit)`` (``limit`` None: any int >= 0)."""
    expected = "a token id >= 0" if limit is None else f"a token id in [0, {limit})"
    return _int(name, value, expected, lambda v: 0 <= v and (limit is None or v < limit))


def check_id_list(name: str, value: Any, limit: int) -> tuple[int, ...]:
    """None, one id or a non-empty sequence of ids (ints in ``[0, limit)``) -> a tuple of ids."""
    if value is None:
        return ()
    expected = f"None or an int in [0, {limit}) (or a non-empty list of them)"
    if is_int(value):
        return (_int(name, value, expected, lambda v: 0 <= v < limit),)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected None, an int or a list of ints, got {type(value).__name__}")
    if not value or any(not is_int(v) or not 0 <= v < limit for v in value):
        raise _out_of_range(name, expected, value)
    return tuple(int(v) for v in value)


def check_stop(name: str, value: Any, limit: int) -> tuple[tuple[int, ...], ...]:
    """None or a list of non-empty token id sequences (ids in ``[0, limit)``)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in value):
        raise TypeError(f"{name}: expected a list of token id sequences (e.g. [[13, 13]]), got {_shown(value)}")
    for i, seq in enumerate(value):
        if not seq:
            raise ValueError(f"{name}[{i}]: expected a non-empty token id sequence, got an empty one")
    return tuple(tuple(check_id(f"{name}[{i}][{j}]", v, limit) for j, v in enumerate(s)) for i, s in enumerate(value))


def check_processor(name: str, value: Any) -> Callable[[Array, Array], Array] | None:
    """None or a callable ``(ids_so_far, scores) -> scores``."""
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable (ids_so_far, scores) -> scores, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Limits:
    """The id ranges options are checked against: ``vocab`` (ids generation may choose: eos and
    stop ids) and ``rows`` (the head's logits: pad_token_id may name a padding row)."""

    vocab: int
    rows: int


#: One validator per option: ``(name, value, limits) -> checked value``; ``name`` is what errors say.
VALIDATORS: dict[str, Callable[[str, Any, Limits], Any]] = {
    "max_new_tokens": lambda n, v, lim: check_count(n, v),
    "max_length": lambda n, v, lim: check_count(n, v),
    "min_new_tokens": lambda n, v, lim: check_count(n, v),
    "do_sample": lambda n, v, lim: check_flag(n, v),
    "temperature": lambda n, v, lim: check_temperature(n, v),
    "top_k": lambda n, v, lim: check_top_k(n, v),
    "top_p": lambda n, v, lim: check_top_p(n, v),
    "repetition_penalty": lambda n, v, lim: check_penalty(n, v),
    "seed": lambda n, v, lim: check_seed(n, v),
    "eos_token_id": lambda n, v, lim: check_id_list(n, v, lim.vocab),
    "pad_token_id": lambda n, v, lim: None if v is None else check_id(n, v, lim.rows),
    "stop": lambda n, v, lim: check_stop(n, v, lim.vocab),
    "logits_processor": lambda n, v, lim: check_processor(n, v),
    "vocab_size": lambda n, v, lim: None if v is None else _int(n, v, f"an int in [1, {lim.rows}] (the logits' rows)",
                                                             lambda x: 1 <= x <= lim.rows),
    "compile": lambda n, v, lim: check_flag(n, v),
}


def _unknown(names: Sequence[str], label: Callable[[str], str]) -> None:
    for name in names:
        if name not in VALIDATORS:
            raise TypeError(f"{label(name)}: unknown generation option; expected one of {', '.join(VALIDATORS)}")


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> float:
    """The temperature as a float after checking the three sampling arguments."""
    t = check_temperature("temperature", temperature)
    if t is None:
        raise TypeError("temperature: expected a number >= 0 (0 is greedy), finite, got None")
    check_top_k("top_k", top_k)
    check_top_p("top_p", top_p)
    return t


def _temperature(do_sample: bool | None, temperature: float | None, name: str = "temperature") -> float:
    """do_sample=False: greedy; True: sample at ``temperature`` (default 1); None: sample iff temperature > 0.
    Both already checked."""
    if do_sample is False:
        return 0.0
    t = (1.0 if do_sample else 0.0) if temperature is None else temperature
    if do_sample and t == 0:
        raise ValueError(f"{name}: do_sample=True needs a temperature > 0, got 0")
    return t


def check_generation_config(fields: Any, limits: Limits, name: str = "generation_config",
                            label: Callable[[str], str] | None = None) -> dict[str, Any]:
    """Generation defaults (e.g. a ``generation_config.json``'s known fields) checked option by
    option with :data:`VALIDATORS`, and together (do_sample with temperature): a dict of the
    checked values. Errors name ``name`` for the whole and ``label(key)`` (default
    ``name[key]``) for one option."""
    label = label or (lambda key: f"{name}[{key!r}]")
    if not isinstance(fields, Mapping):
        raise TypeError(f"{name}: expected a dict of generation options, got {type(fields).__name__}")
    for key in fields:
        if not isinstance(key, str):
            raise TypeError(f"{name}: expected option names (str), got {type(key).__name__} {_shown(key)}")
    _unknown(list(fields), label)
    checked = {key: VALIDATORS[key](label(key), value, limits) for key, value in fields.items()}
    out = {key: None if value == () else value for key, value in checked.items()}  # no eos ids: None, as given
    _temperature(out.get("do_sample"), out.get("temperature"), label("temperature"))
    return out


def _new_tokens(max_new_tokens: int | None, max_length: int | None, length: int) -> int:
    """max_new_tokens wins over max_length (the prompt's padded length plus the new tokens); both checked."""
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is None:
        raise ValueError("max_new_tokens: expected max_new_tokens or max_length, got neither")
    if max_length < length:
        raise ValueError(f"max_length: expected at least the prompt's length {length}, got {max_length}")
    return max_length - length


def check_options(length: int, rows: int, **options: Any) -> Options:
    """Every option of :func:`portable_ssm.generation.generate` checked (:data:`VALIDATORS`), for a
    prompt of ``length`` columns and a head of ``rows`` logits; TypeError naming an unknown option."""
    _unknown(list(options), lambda key: key)
    vocab = VALIDATORS["vocab_size"]("vocab_size", options.get("vocab_size"), Limits(rows, rows)) or rows
    o = {key: VALIDATORS[key](key, value, Limits(vocab, rows)) for key, value in options.items()}
    eos = o.get("eos_token_id", ())
    pad = o.get("pad_token_id")
    fill = eos[0] if pad is None and eos else pad
    stops = o.get("stop", ())
    if stops and fill is None:
        raise ValueError("stop: finished rows need a filler, pass pad_token_id or eos_token_id")
    penalty = o.get("repetition_penalty")
    return Options(new=_new_tokens(o.get("max_new_tokens"), o.get("max_length"), length),
                   min_new=o.get("min_new_tokens") or 0,
                   temperature=_temperature(o.get("do_sample"), o.get("temperature")),
                   top_k=o.get("top_k"), top_p=o.get("top_p"),
                   penalty=None if penalty in (None, 1.0) else penalty, eos=eos, fill=fill, stop=stops,
                   processor=o.get("logits_processor"), vocab=vocab, seed=o.get("seed"),
                   compile=o.get("compile"))


def call_options(defaults: dict[str, Any], max_new_tokens: int | None, eos_token_id: Any,
                 options: dict[str, Any]) -> dict[str, Any]:
    """A model's ``defaults`` (its vocab_size, eos and generation_config) overridden by one call's
    explicit options, as in transformers (a default max_new_tokens still wins over an explicit
    max_length). ``eos_token_id``: :data:`CHECKPOINT_EOS` keeps the default; None never stops early."""
    explicit = {k: v for k, v in options.items() if v is not None}
    if max_new_tokens is not None:
        explicit["max_new_tokens"] = max_new_tokens
    if not (isinstance(eos_token_id, str) and eos_token_id == CHECKPOINT_EOS):
        explicit["eos_token_id"] = eos_token_id
    return {**defaults, **explicit}


def seen_tokens(ids: Array, valid: Array | None, vocab: int, *, xp: Namespace) -> Array:
    """``[b, vocab]`` bool: the token occurs in ``ids [b, l]`` at a position where ``valid [b, l]``
    (None: everywhere)."""
    b, l = ids.shape
    cols = xp.arange(vocab, dtype=ids.dtype, device=device(ids))
    seen = xp.zeros((b, vocab), dtype=xp.bool, device=device(ids))
    for start in range(0, l, _SEEN_BLOCK):
        stop = min(start + _SEEN_BLOCK, l)  # in bounds: the standard leaves a stop past the end unspecified
        hit = ids[:, start:stop, None] == cols  # [b, t, vocab]
        if valid is not None:
            hit = hit & valid[:, start:stop, None]
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
