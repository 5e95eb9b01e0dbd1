"""JSON from files a hostile user may have written: one parse that only ever fails with CheckpointError.

``json.loads`` accepts duplicate keys (the last silently wins), ``NaN``/``Infinity``, and escapes
deep nesting as RecursionError and 5000-digit integers as ValueError. :func:`loads` refuses the
first two and turns the rest into :class:`~portable_ssm.io.CheckpointError` naming ``where``.
:func:`read_file` reads a checkpoint's JSON files, bounded in size and failing only with
CheckpointError.
"""

from __future__ import annotations

import json
import os
import reprlib
from typing import Any

from .errors import CheckpointError
from .paths import check_inside, read_regular

#: Bounded ``repr`` for values quoted in error messages (a hostile value may be megabytes long).
SHORT = reprlib.Repr()
SHORT.maxstring, SHORT.maxother, SHORT.maxlist, SHORT.maxdict, SHORT.maxlevel = 120, 60, 6, 4, 3
_JSON_LIMIT = 64 << 20  # config.json and shard indexes are kilobytes; a bigger one is not read


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; ValueError naming the first key that appears twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {SHORT.repr(key)} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str | bytes, where: str) -> Any:
    """The JSON value of ``text``; CheckpointError ``"{where} is not valid JSON (...)"`` for malformed
    JSON, duplicate keys, NaN/Infinity, integers past Python's digit limit and nesting past the
    recursion limit."""
    try:
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
    except RecursionError:
        raise CheckpointError(f"{where} is not valid JSON (nested too deeply)") from None
    except (ValueError, TypeError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{where} is not valid JSON ({err})") from None


def read_file(path: str) -> Any:
    """The JSON document in the file at ``path`` (config.json, shard indexes, generation_config.json):
    Python's JSON, NaN and Infinity included (transformers writes ``[0.0, Infinity]``); CheckpointError
    naming the file when it is not one (a FIFO, device or directory, a symlink out of its directory,
    too big, not UTF-8, malformed, a key twice in one object, or nested too deep). Messages never
    quote the file's bytes beyond a repeated key's name."""
    check_inside(path, os.path.dirname(path) or ".")
    data = read_regular(path, _JSON_LIMIT)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON (not UTF-8 at byte {err.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deep)") from None
    except ValueError as err:  # JSONDecodeError and a repeated key are ValueErrors
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
