"""A pretrained Mamba-2 language model on one backend: :class:`Mamba2LM`.

It holds ``config`` and ``params`` (core names) and runs :func:`portable_ssm.lm.logits` and
:mod:`portable_ssm.generation` on them; :func:`portable_ssm.load_pretrained` builds one from files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

from ._array import Array, array_backend, device, dtype_name, namespace
from .backends import load, to_backend
from .config import Mamba2Config
from .generation import check_token_ids, generate, stream
from .io.checkpoint import save_params
from .lm import logits as lm_logits
from .params import Params, check_params
from .quantized import QuantizedWeight, quantize


class Mamba2LM:
    """A Mamba-2 language model on one backend: ``config``, ``params`` (core names) and helpers.

    Attributes: ``vocab_size`` (the real vocabulary; generation never picks the padding rows
    above it), ``eos_token_id`` (from the checkpoint's config, or None), ``layout``
    (``"transformers" | "state-spaces" | "portable_ssm"``), ``checkpoint_dtype`` (as stored).
    """

    def __init__(self, params: Params, config: Mamba2Config, *, vocab_size: int | None = None,
                 eos_token_id: int | None = None, layout: str = "portable_ssm",
                 checkpoint_dtype: str | None = None) -> None:
        check_params(params, config)
        if config.vocab_size is None:
            raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
        self.config, self.params = config, params
        self.vocab_size = config.vocab_size if vocab_size is None else vocab_size
        if not 0 < self.vocab_size <= config.padded_vocab_size:
            raise ValueError(f"vocab_size: expected an int in [1, {config.padded_vocab_size}] (the "
                             f"embedding rows), got {vocab_size!r}")
        self.eos_token_id, self.layout = eos_token_id, layout
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

    def generate(self, input_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | None = None) -> Array:
        """``input_ids [b, l]`` -> ``[b, l + new]`` ids, greedy at temperature 0; see
        :func:`portable_ssm.generation.generate` (cached prefill + one step per token)."""
        return generate(self._ids(input_ids), self.params, config=self.config, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_token_id=eos_token_id, vocab_size=self.vocab_size)

    def stream(self, input_ids: Any, max_new_tokens: int, **sampling: Any) -> Iterator[Array]:
        """The new tokens ``[b]`` one at a time (arguments as :meth:`generate`)."""
        return stream(self._ids(input_ids), self.params, config=self.config, max_new_tokens=max_new_tokens,
                      vocab_size=self.vocab_size, **sampling)

    def quantize(self, kind: str) -> Mamba2LM:
        """This model with its projections, embedding and head stored as ``kind`` (``"int8"``,
        ``"bfloat16"``; ``"float32"``: this model itself), see :func:`portable_ssm.quantize`."""
        params = quantize(self.params, kind)
        if kind == "float32":
            return self
        return Mamba2LM(params, self.config, vocab_size=self.vocab_size, eos_token_id=self.eos_token_id,
                        layout=self.layout, checkpoint_dtype=self.checkpoint_dtype)

    def save(self, path: str | os.PathLike) -> None:
        """Writes a :func:`portable_ssm.save_params` file that :func:`portable_ssm.load_pretrained` reads."""
        if any(isinstance(v, QuantizedWeight) for v in self.params.values()):
            raise TypeError("save: this model holds quantized weights; save the float32 model and pass "
                            "weights= to load_pretrained")

        meta = {"vocab_size": str(self.vocab_size)}
        if self.eos_token_id is not None:
            meta["eos_token_id"] = str(self.eos_token_id)
        save_params(path, self.params, self.config, metadata=meta)
