"""``generation_config.json`` (transformers' generation defaults) as :class:`~portable_ssm.Mamba2LM` options.

Only the fields generation understands are read (:data:`FIELDS`); ``null`` fields and every other
key (``transformers_version``, ``bos_token_id``, ...) are ignored, as transformers ignores what it
does not use. ``top_k: 0`` means no top-k, as in transformers. Every field read is checked at
load with the validator :func:`portable_ssm.generate` uses for that option
(:func:`portable_ssm.generation_options.check_generation_config`: types, ranges, token ids below
the vocabulary, ``do_sample`` with ``temperature``): a bad value is a :class:`CheckpointError`
naming the file and the key, never an error at the first generated token. No file: no defaults.
"""

from __future__ import annotations

import os
from typing import Any

from ..generation_options import Limits, check_generation_config, is_int
from .errors import CheckpointError
from .strict_json import read_file

FILE_NAME = "generation_config.json"

#: The fields of generation_config.json read as generation options.
FIELDS = ("max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
          "repetition_penalty", "eos_token_id", "pad_token_id")


def read_generation_config(folder: str | os.PathLike, *, vocab_size: int, rows: int) -> dict[str, Any]:
    """The checked generation defaults of a checkpoint directory (``{}`` without a
    generation_config.json): the :data:`FIELDS` that are set, for a model of ``vocab_size`` real
    tokens (eos ids below it) and ``rows`` embedding rows (pad_token_id below it)."""
    path = os.path.join(os.fspath(folder), FILE_NAME)
    if not os.path.isfile(path):
        return {}
    raw = read_file(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    fields = {key: raw[key] for key in FIELDS if raw.get(key) is not None
              and not (key == "top_k" and is_int(raw[key]) and raw[key] == 0)}
    try:
        return check_generation_config(fields, Limits(vocab=vocab_size, rows=rows), path,
                                       label=lambda key: f"{path}: key {key!r}")
    except (TypeError, ValueError) as err:
        raise CheckpointError(str(err)) from None
