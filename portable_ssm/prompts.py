"""Prompts and attention masks given as nested Python lists, checked entry by entry before they become arrays.

A list of prompts is a list (or tuple) of non-empty lists of token ids; a token id is a Python or
NumPy integer (never a bool, a float or a str) in ``[0, rows)``. A list mask holds one row per
prompt, as long as it, of 0/1 ints or bools. Anything else is a TypeError (wrong type) or
ValueError (wrong value or length) naming the entry, e.g. ``input_ids[1][3]``: nothing is
truncated (1.7 -> 1), parsed ("5" -> 5) or read as 0/1 (True -> 1) on the way to an array.
"""

from __future__ import annotations

from typing import Any

from ._array import Array, array_backend, device, namespace
from ._checks import check_given
from .backends import load, to_backend
from .generation_options import check_id, is_int


def _rows(name: str, value: Any, what: str) -> list[Any]:
    """``value`` as a non-empty list of rows, each a list or tuple."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected a list of {what} lists, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name}: expected at least one row of {what}, got an empty list")
    for i, row in enumerate(value):
        if not isinstance(row, (list, tuple)):
            raise TypeError(f"{name}[{i}]: expected a list of {what}, got {type(row).__name__}")
    return list(value)


def check_prompt(name: str, prompt: Any, rows: int | None) -> list[int]:
    """One prompt's ids as ints, checked: a non-empty list or tuple of ids in ``[0, rows)``
    (``rows`` None: any id >= 0)."""
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{name}: expected a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError(f"{name}: expected at least one token id, got an empty prompt")
    return [check_id(f"{name}[{j}]", v, rows) for j, v in enumerate(prompt)]


def check_prompts(name: str, prompts: Any, rows: int | None) -> list[list[int]]:
    """Each prompt's ids as ints, checked: ``prompts`` a non-empty list of prompts (:func:`check_prompt`)."""
    return [check_prompt(f"{name}[{i}]", p, rows) for i, p in enumerate(_rows(name, prompts, "token ids"))]


def _mask_entry(name: str, value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if not is_int(value):
        raise TypeError(f"{name}: expected 0, 1, True or False, got {type(value).__name__} {value!r}")
    if value not in (0, 1):
        raise ValueError(f"{name}: expected 0 (padding) or 1 (token), got {value!r}")
    return int(value)


def check_mask_lists(name: str, mask: Any, shape: tuple[int, int]) -> list[list[int]]:
    """A list mask of ``shape [b, l]`` (the ids') as 0/1 ints, checked entry by entry."""
    rows = _rows(name, mask, "0/1 entries")
    if len(rows) != shape[0] or any(len(r) != shape[1] for r in rows):
        got = [len(r) for r in rows]
        raise ValueError(f"{name}: expected {shape[0]} rows of {shape[1]} entries (the shape [b, l] of "
                         f"input_ids), got {len(rows)} rows of {got if len(set(got)) > 1 else got[0]}")
    return [[_mask_entry(f"{name}[{i}][{j}]", v) for j, v in enumerate(r)] for i, r in enumerate(rows)]


def left_pad(prompts: Any, pad_token_id: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of unequal length as one left-padded batch: ``(ids, attention_mask)``, nested lists
    ``[b, longest]`` (mask 0 on the padding, 1 on the tokens). ``prompts``: a non-empty list of
    non-empty lists of token ids (ints >= 0), checked entry by entry; ``pad_token_id`` an int >= 0."""
    checked = check_prompts("prompts", prompts, None)
    pad = check_id("pad_token_id", pad_token_id, None)
    width = max(len(p) for p in checked)
    ids = [[pad] * (width - len(p)) + p for p in checked]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in checked]
    return ids, mask


def prompt_arrays(input_ids: Any, attention_mask: Any, *, rows: int, like: Array) -> tuple[Array, Array | None]:
    """``(ids, mask)`` on ``like``'s backend and device for a model with ``rows`` embedding rows.
    Lists are checked entry by entry: prompts of unequal length are left-padded with 0 (and
    masked, :func:`left_pad`), so they take no mask of their own; arrays must already be on
    ``like``'s backend."""
    host, backend, where = load("numpy"), array_backend(like), device(like)
    if isinstance(input_ids, (list, tuple)):
        prompts = check_prompts("input_ids", input_ids, rows)
        if len({len(p) for p in prompts}) > 1:
            if attention_mask is not None:
                raise ValueError("attention_mask: prompts of unequal length are left-padded and masked "
                                 "here; pass them without attention_mask, or pass equal-length "
                                 f"(padded) prompts with it (got lengths {[len(p) for p in prompts]})")
            prompts, attention_mask = left_pad(prompts)
        input_ids = to_backend(host.asarray(prompts, "int64", None), backend, device=where)
    check_given(input_ids=input_ids)
    namespace(input_ids=input_ids, params=like)
    if isinstance(attention_mask, (list, tuple)):
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids: expected shape [b, l], got {tuple(input_ids.shape)}")
        mask = check_mask_lists("attention_mask", attention_mask, tuple(input_ids.shape))
        attention_mask = to_backend(host.asarray(mask, "int64", None), backend, device=where)
    return input_ids, attention_mask
