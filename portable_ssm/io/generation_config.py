"""``generation_config.json`` (transformers' generation defaults) as :class:`~portable_ssm.Mamba2LM` options.

Only the fields generation understands are read, each type-checked (a wrong type is a
:class:`CheckpointError` naming the file and the key); ``null`` fields and every other key
(``transformers_version``, ``bos_token_id``, ...) are ignored. No file: no defaults.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import CheckpointError
from .strict_json import read_file

FILE_NAME = "generation_config.json"

_INTS = ("max_new_tokens", "max_length", "min_new_tokens", "top_k", "pad_token_id")
_NUMBERS = ("temperature", "top_p", "repetition_penalty")


def _field(key: str, value: Any, path: str) -> Any:
    """The checked value of one known field."""
    def bad(expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: key {key!r}: expected {expected}, got {value!r}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if key in _INTS:
        if not is_int(value) or value < 0:
            raise bad("an int >= 0")
        return value
    if key in _NUMBERS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise bad("a number >= 0")
        return float(value)
    if key == "do_sample":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if is_int(value) and value >= 0:  # eos_token_id: one id or a list of them
        return value
    if not isinstance(value, list) or not value or not all(is_int(v) and v >= 0 for v in value):
        raise bad("an int >= 0 or a non-empty list of them")
    return list(value)


def read_generation_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The generation defaults of a checkpoint directory (``{}`` without a generation_config.json):
    ``max_new_tokens, max_length, min_new_tokens, do_sample, temperature, top_k, top_p,
    repetition_penalty, eos_token_id, pad_token_id`` where set."""
    path = os.path.join(os.fspath(folder), FILE_NAME)
    if not os.path.isfile(path):
        return {}
    raw = read_file(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    known = (*_INTS, *_NUMBERS, "do_sample", "eos_token_id")
    return {key: _field(key, raw[key], path) for key in known if raw.get(key) is not None}
