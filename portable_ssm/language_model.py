"""A pretrained Mamba-2 language model on one backend: :class:`Mamba2LM`.

It holds ``config`` and ``params`` (core names) and runs :func:`portable_ssm.lm.logits` and
:mod:`portable_ssm.generation` on them; :func:`portable_ssm.load_pretrained` builds one from files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ._array import Array, array_backend, device, dtype_name, namespace
from .backends import load, to_backend
from .config import Mamba2Config
from .generation import check_eos_ids, check_token_ids, generate, stream
from .io.checkpoint import save_params
from .lm import logits as lm_logits
from .params import Params, check_params

#: The default ``eos_token_id`` of :meth:`Mamba2LM.generate` and :meth:`Mamba2LM.stream`: the model's own.
CHECKPOINT_EOS = "checkpoint"


class Mamba2LM:
    """A Mamba-2 language model on one backend: ``config``, ``params`` (core names) and helpers.

    Attributes: ``vocab_size`` (the real vocabulary; generation never picks the padding rows
    above it), ``eos_token_id`` (the checkpoint's: an int, a tuple of ints, or None; generation
    stops there unless told otherwise), ``layout`` (``"transformers" | "state-spaces" |
    "portable_ssm"``), ``checkpoint_dtype`` (as stored).
    """

    def __init__(self, params: Params, config: Mamba2Config, *, vocab_size: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, layout: str = "portable_ssm",
                 checkpoint_dtype: str | None = None) -> None:
        check_params(params, config)
        if config.vocab_size is None:
            raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
        self.config, self.params = config, params
        self.vocab_size = config.vocab_size if vocab_size is None else vocab_size
        if not 0 < self.vocab_size <= config.padded_vocab_size:
            raise ValueError(f"vocab_size: expected an int in [1, {config.padded_vocab_size}] (the "
                             f"embedding rows), got {vocab_size!r}")
        eos = check_eos_ids(eos_token_id, self.vocab_size)
        self.eos_token_id = eos_token_id if eos_token_id is None or isinstance(eos_token_id, int) else eos
        self.layout = layout
        self.checkpoint_dtype = checkpoint_dtype or self.dtype

    @property
    def backend(self) -> str:
        return array_backend(self.params["embedding.weight"])

    @property
    def device(self) -> Any:
        return device(self.params["embedding.weight"])

    @property
    def dtype(self) -> str:
        return dtype_name(self.params["embedding.weight"].dtype)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.params.values())

    def _ids(self, input_ids: Any) -> Array:
        """Lists of ints become arrays on the model's backend; arrays must already be there."""
        if isinstance(input_ids, (list, tuple)):
            host = load("numpy").asarray(input_ids, "int64", None)
            input_ids = to_backend(host, self.backend, device=self.device)
        namespace(input_ids=input_ids, params=self.params["embedding.weight"])
        return input_ids

    def logits(self, input_ids: Any) -> Array:
        """``input_ids [b, l]`` (array or nested list of ints) -> ``[b, l, rows]``, rows being the
        checkpoint's embedding rows (``config.padded_vocab_size``)."""
        ids = self._ids(input_ids)
        xp = namespace(input_ids=ids)
        check_token_ids("input_ids", ids, self.config.padded_vocab_size, xp=xp)
        return lm_logits(ids, self.params, config=self.config)

    def _eos(self, eos_token_id: int | Sequence[int] | None | str) -> int | Sequence[int] | None:
        """``"checkpoint"`` is the model's own ``eos_token_id``; anything else is taken as given."""
        return self.eos_token_id if isinstance(eos_token_id, str) and eos_token_id == CHECKPOINT_EOS else eos_token_id

    def generate(self, input_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None | str = CHECKPOINT_EOS) -> Array:
        """``input_ids [b, l]`` -> ``[b, l + new]`` ids, greedy at temperature 0; see
        :func:`portable_ssm.generation.generate` (cached prefill + one step per token).

        ``eos_token_id``: ``"checkpoint"`` (the default) stops at the model's own
        :attr:`eos_token_id`, as transformers' ``generate`` does; an int or a sequence of ints stops
        at those instead; ``None`` never stops early.
        """
        return generate(self._ids(input_ids), self.params, config=self.config, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_token_id=self._eos(eos_token_id), vocab_size=self.vocab_size)

    def stream(self, input_ids: Any, max_new_tokens: int, *,
               eos_token_id: int | Sequence[int] | None | str = CHECKPOINT_EOS, **sampling: Any) -> Iterator[Array]:
        """The new tokens ``[b]`` one at a time (arguments as :meth:`generate`)."""
        return stream(self._ids(input_ids), self.params, config=self.config, max_new_tokens=max_new_tokens,
                      vocab_size=self.vocab_size, eos_token_id=self._eos(eos_token_id), **sampling)

    def save(self, path: str | os.PathLike) -> None:
        """Writes a :func:`portable_ssm.save_params` file that :func:`portable_ssm.load_pretrained` reads."""

        meta = {"vocab_size": str(self.vocab_size)}
        if self.eos_token_id is not None:
            meta["eos_token_id"] = json.dumps(self.eos_token_id)
        save_params(path, self.params, self.config, metadata=meta)
