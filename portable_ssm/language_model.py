"""A pretrained Mamba-2 language model on one backend: :class:`Mamba2LM`.

It holds ``config`` and ``params`` (core names) and runs :func:`portable_ssm.lm.logits` and
:mod:`portable_ssm.generation` on them; :func:`portable_ssm.load_pretrained` builds one from files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

from ._array import Array, Namespace, array_backend, device, dtype_name
from .backends import compiled
from .config import Mamba2Config
from .generation import generate, stream
from .generation_options import CHECKPOINT_EOS, Limits, call_options, check_generation_config, check_id_list, is_int
from .io.checkpoint import save_params
from .lm import check_prompt, prefill
from .params import Params, check_params
from .prompts import prompt_arrays
from .quantized import QuantizedWeight, quantize

#: The checkpoint layouts a :class:`Mamba2LM` names.
LAYOUTS = ("transformers", "state-spaces", "portable_ssm")


class Mamba2LM:
    """A Mamba-2 language model on one backend: ``config``, ``params`` (core names) and helpers.

    Attributes: ``vocab_size`` (the real vocabulary; generation never picks the padding rows
    above it), ``eos_token_id`` (the checkpoint's: an int, a tuple of ints, or None; generation
    stops there unless told otherwise), ``layout`` (``"transformers" | "state-spaces" |
    "portable_ssm"``), ``checkpoint_dtype`` (as stored), ``generation_config`` (defaults for
    :meth:`generate` and :meth:`stream`, e.g. read from the checkpoint's ``generation_config.json``;
    explicit arguments win).
    """

    def __init__(self, params: Params, config: Mamba2Config, *, vocab_size: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, layout: str = "portable_ssm",
                 checkpoint_dtype: str | None = None, generation_config: dict[str, Any] | None = None) -> None:
        check_params(params, config)
        if config.vocab_size is None:
            raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
        self.config, self.params = config, params
        vocab = config.vocab_size if vocab_size is None else vocab_size
        if not is_int(vocab) or not 0 < vocab <= config.padded_vocab_size:
            raise ValueError(f"vocab_size: expected an int in [1, {config.padded_vocab_size}] (the "
                             f"embedding rows), got {vocab_size!r}")
        self.vocab_size = int(vocab)
        eos = check_id_list("eos_token_id", eos_token_id, self.vocab_size)
        self.eos_token_id = None if not eos else eos[0] if is_int(eos_token_id) else eos
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self.checkpoint_dtype = checkpoint_dtype or self.dtype
        self.generation_config = check_generation_config(
            {} if generation_config is None else generation_config,
            Limits(vocab=self.vocab_size, rows=config.padded_vocab_size))

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

    def _batch(self, input_ids: Any, attention_mask: Any) -> tuple[Array, Array | None]:
        return prompt_arrays(input_ids, attention_mask, rows=self.config.padded_vocab_size,
                             like=self.params["embedding.weight"])

    def logits(self, input_ids: Any, attention_mask: Any = None) -> Array:
        """``input_ids [b, l]`` (array or nested list of ints; prompts of unequal length are
        left-padded) -> ``[b, l, rows]``, rows being the checkpoint's embedding rows
        (``config.padded_vocab_size``); ``attention_mask [b, l]`` marks left padding."""
        ids, mask = self._batch(input_ids, attention_mask)
        xp, pad = check_prompt(ids, mask, self.config.padded_vocab_size, self.params["embedding.weight"])
        return _all_logits(self.config, xp)(ids, pad, self.params)  # [b, l, rows]

    def _options(self, max_new_tokens: int | None, eos_token_id: Any, options: dict[str, Any]) -> dict[str, Any]:
        defaults = {"vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id, **self.generation_config}
        return call_options(defaults, max_new_tokens, eos_token_id, options)

    def generate(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
                 eos_token_id: int | Sequence[int] | None | str = CHECKPOINT_EOS,
                 **options: Any) -> Array | tuple[Array, Any]:
        """``input_ids [b, l]`` -> ``[b, l + new]`` ids, greedy at temperature 0; see
        :func:`portable_ssm.generation.generate` for the options (cached prefill + one step per token).

        A list of prompts of unequal length is left-padded with 0 (``[b, longest + new]``; row i's
        first ``longest - len(prompt i)`` ids are padding) and every row gets the tokens it gets
        alone. Unset options come from :attr:`generation_config`. ``eos_token_id``: ``"checkpoint"``
        (the default) stops at the model's own :attr:`eos_token_id`, as transformers' ``generate``
        does; an int or a sequence of ints stops at those instead; ``None`` never stops early."""
        ids, mask = self._batch(input_ids, attention_mask)
        return generate(ids, self.params, config=self.config, attention_mask=mask,
                        **self._options(max_new_tokens, eos_token_id, options))

    def stream(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
               eos_token_id: int | Sequence[int] | None | str = CHECKPOINT_EOS, **options: Any) -> Iterator[Any]:
        """The new tokens ``[b]`` one at a time (arguments as :meth:`generate`)."""
        ids, mask = self._batch(input_ids, attention_mask)
        return stream(ids, self.params, config=self.config, attention_mask=mask,
                      **self._options(max_new_tokens, eos_token_id, options))

    def quantize(self, kind: str) -> Mamba2LM:
        """This model with its projections, embedding and head stored as ``kind`` (``"int8"``,
        ``"bfloat16"``; ``"float32"``: this model itself), see :func:`portable_ssm.quantize`."""
        params = quantize(self.params, kind)
        if kind == "float32":
            return self
        return Mamba2LM(params, self.config, vocab_size=self.vocab_size, eos_token_id=self.eos_token_id,
                        layout=self.layout, checkpoint_dtype=self.checkpoint_dtype,
                        generation_config=self.generation_config)

    def save(self, path: str | os.PathLike) -> None:
        """Writes a :func:`portable_ssm.save_params` file that :func:`portable_ssm.load_pretrained` reads."""
        if any(isinstance(v, QuantizedWeight) for v in self.params.values()):
            raise TypeError("save: this model holds quantized weights; save the float32 model and pass "
                            "weights= to load_pretrained")

        meta = {"vocab_size": str(self.vocab_size)}
        if self.eos_token_id is not None:
            meta["eos_token_id"] = json.dumps(self.eos_token_id)
        save_params(path, self.params, self.config, metadata=meta)


@lru_cache(maxsize=8)
def _all_logits(config: Mamba2Config, xp: Namespace) -> Callable[[Array, Array | None, Params], Array]:
    """``(ids [b, l], pad [b] or None, params) -> logits [b, l, rows]`` on checked arguments,
    compiled where the backend compiles by default (JAX: ``jax.jit`` once per shape, traced as
    "logits"; op by op, every new length compiled each op again)."""

    def run(ids: Array, pad: Array | None, params: Params) -> Array:
        return prefill(ids, None, pad, params, config=config, xp=xp, last_only=False)[0]

    return compiled(run, xp, "logits")
