"""``HybridLM``: a hybrid model's parameters and :class:`~portable_ssm.stack.HybridConfig` with
the language-model calls: logits, continued prefill and greedy generation with the KV cache.

Ragged prompts arrive left-padded with ``attention_mask [b, l]`` (1 token, 0 padding); each row
then gives what it gives alone: the Mamba layers skip its padding (:mod:`portable_ssm.padding`),
the attention layers never see a padding slot, and RoPE counts the row's own tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

from ._array import Array, Namespace, array_backend, device, dtype_name, namespace
from ._checks import Shapes, check_bool, check_int
from .backends import compiled, fast_op
from .blocks.attention import advance
from .generation import TokenChooser, check_id_dtype
from .generation_options import CHECKPOINT_EOS, Limits, Options, call_options, check_generation_config, check_options
from .lm import check_prompt, check_token_ids
from .prompts import prompt_arrays
from .quantized import QUANTIZED_LEAVES, quantize
from .stack import (
    HybridConfig,
    HybridState,
    check_attention_convs,
    check_room,
    embed_tokens,
    empty_hybrid_state,
    gather_hybrid,
    head,
    run_layers,
    scale_logits,
    scatter_hybrid,
)
from .state_pool import check_state_batch_indices

#: The hybrid weights (their last two name parts) :meth:`HybridLM.quantize` stores in low precision.
QUANTIZED = QUANTIZED_LEAVES + ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "up.weight",
                                "down.weight", "linear.weight")


class HybridLM:
    """A hybrid language model (loaded by :func:`portable_ssm.load_pretrained` from a Granite-4.0-H,
    Bamba, ... folder). ``params``: core names (:mod:`portable_ssm.stack`), one backend and dtype;
    ``generation_config``: defaults for :meth:`generate` and :meth:`stream` (the folder's
    ``generation_config.json``), checked as the Mamba-2 model's; ``vocab_size``: the real
    vocabulary when the head's ``config.vocab_size`` rows are padded (mamba_ssm), else None."""

    def __init__(self, params: dict[str, Array], config: HybridConfig, *, eos_token_id: Any = None,
                 notes: tuple[str, ...] = (), generation_config: dict[str, Any] | None = None,
                 vocab_size: int | None = None) -> None:
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config: expected a HybridConfig, got {type(config).__name__}")
        vocab = config.vocab_size if vocab_size is None else vocab_size
        if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= config.vocab_size:
            raise ValueError(f"vocab_size: expected None or an int in [1, {config.vocab_size}] (the head's rows), "
                             f"got {vocab_size!r}")
        self.params, self.config, self.eos_token_id, self.notes = params, config, eos_token_id, notes
        self._vocab = vocab
        self.generation_config = check_generation_config({} if generation_config is None else generation_config,
                                                         Limits(vocab=vocab, rows=config.vocab_size))
        first = params["embedding.weight"]
        self._xp: Namespace = namespace(**{"params['embedding.weight']": first})

    @property
    def dtype(self) -> str:
        """The parameters' dtype by name (as :attr:`portable_ssm.Mamba2LM.dtype`)."""
        return dtype_name(self.params["embedding.weight"].dtype)

    @property
    def backend(self) -> str:
        return array_backend(self.params["embedding.weight"])

    @property
    def vocab_size(self) -> int:
        """Token ids generation may choose: the real vocabulary (the head's rows but padding)."""
        return self._vocab

    @property
    def num_parameters(self) -> int:
        """Parameters in all (each hybrid layer's copy of a shared block counted)."""
        return sum(math.prod(v.shape) for v in self.params.values())

    def describe(self) -> list[tuple[str, Any]]:
        """``(key, value)`` rows for ``portable_ssm info``: family, sizes, layer kinds, and the
        loader's notes (e.g. which gated-norm semantics it applies)."""
        c = self.config
        kinds: dict[str, int] = {}
        for mix, ffn in c.layers:
            label = "+".join(k for k in (mix, ffn) if k is not None)
            kinds[label] = kinds.get(label, 0) + 1
        vocab = self.vocab_size if self.vocab_size == c.vocab_size else f"{self.vocab_size} (rows {c.vocab_size})"
        rows: list[tuple[str, Any]] = [("family", c.family), ("parameters", f"{self.num_parameters:,}"),
                                       ("eos_token_id", self.eos_token_id), ("vocab", vocab),
                                       ("d_model", c.d_model), ("layers", f"{c.n_layer}: " + ", ".join(
                                           f"{n} {k}" for k, n in kinds.items()))]
        if c.mamba is not None:
            m = c.mamba
            rows.append(("mamba", f"heads {m.nheads} x {m.headdim}, state {m.d_state}, groups {m.ngroups}, "
                                  f"conv {m.d_conv}"))
        if c.attention is not None and c.indices("attention"):
            a = c.attention
            conv = (f", conv {a.conv}" if a.conv else "") + (f", mlp {a.mlp}" if a.mlp else "")
            rows.append(("attention", f"heads {a.n_heads}, kv heads {a.n_kv_heads}, head_dim {a.head_dim}, "
                                      f"rotary {a.rotary_dim or 'none (nope)'}{conv}"))
        return rows + [("note", note) for note in self.notes]

    def quantize(self, kind: str) -> HybridLM:
        """This model with every projection stored as ``kind`` (``"int8"``, ``"bfloat16"``;
        ``"float32"``: this model itself), through :func:`portable_ssm.quantize` and the Mamba-2
        model's matmul: attention q/k/v/o, the MLPs, the Mamba in/out projections, Zamba2's
        linear, the embedding, the head (:data:`QUANTIZED`) and the MoE experts ``[E, out, in]``
        (int8: a scale per output row of each expert). The MoE routers stay float32, as do norms,
        convs, biases and the SSM scalars."""
        names = [k for k in self.params if ".".join(k.split(".")[-2:]) in QUANTIZED]
        params = quantize(self.params, kind, names=names)
        if kind == "float32":
            return self
        return HybridLM(params, self.config, eos_token_id=self.eos_token_id, notes=self.notes,
                        generation_config=self.generation_config, vocab_size=self.vocab_size)

    def empty_state(self, batch: int, max_len: int) -> HybridState:
        """A zero state for ``batch`` rows with KV caches of ``max_len`` tokens."""
        check_int("batch", batch, minimum=1)
        check_int("max_len", max_len, minimum=1)
        return empty_hybrid_state(self.config, batch, max_len, self.params["embedding.weight"], xp=self._xp)

    def _tokens(self, input_ids: Array, attention_mask: Array | None) -> tuple[Array, Array | None]:
        """``(tokens [b, l] bool, pad [b] or None)`` after checking ids and mask at the door."""
        xp = self._xp
        _, pad = check_prompt(input_ids, attention_mask, self.config.vocab_size, self.params["embedding.weight"])
        b, l = input_ids.shape
        slot = xp.arange(l, dtype=xp.int64, device=device(input_ids))
        tokens = (slot[None, :] >= (xp.zeros((b,), dtype=xp.int64, device=device(input_ids)) if pad is None
                                    else pad)[:, None])  # [b, l]
        return tokens, pad

    def prefill(self, input_ids: Array, *, attention_mask: Array | None = None, state: HybridState | None = None,
                max_len: int | None = None, logits_to_keep: int = 0) -> tuple[Array, HybridState]:
        """``input_ids [b, l]`` through the stack: ``(logits [b, l, V], state)``. Without ``state``
        a fresh one of ``max_len`` (default l) slots; with it, these tokens continue it.
        ``logits_to_keep`` k > 0: the head runs on the last k positions only, ``logits [b, min(k, l),
        V]`` (transformers' argument; a long prompt's head over every position costs more than
        its layers when the vocabulary is large)."""
        check_int("logits_to_keep", logits_to_keep, minimum=0)
        tokens, pad = self._tokens(input_ids, attention_mask)
        b, l = input_ids.shape
        if state is None:
            state = self.empty_state(b, l if max_len is None else max_len)
        elif not isinstance(state, HybridState):
            raise TypeError(f"state: expected a HybridState, got {type(state).__name__}")
        check_attention_convs(self.config, state)
        check_room(state, l, xp=self._xp)
        x = embed_tokens(input_ids, self.params, self.config, xp=self._xp)
        keep = logits_to_keep if logits_to_keep < l else 0  # keeping l or more is keeping every position
        run = _layers_and_head(self.config, self._xp, keep, False)
        return run(x, state, tokens, pad, self.params)  # ([b, keep or l, V], state)

    def logits(self, input_ids: Array, *, attention_mask: Array | None = None) -> Array:
        """``input_ids [b, l]`` -> ``logits [b, l, V]`` (transformers' ``model(ids).logits``)."""
        return self.prefill(input_ids, attention_mask=attention_mask)[0]

    def step(self, token: Array, state: HybridState, *,
             state_batch_indices: Array | None = None) -> tuple[Array, HybridState]:
        """One token per row ``token [b]`` after ``state``: ``(logits [b, V], new state)``.

        With ``state_batch_indices [b]`` (distinct ints, :mod:`portable_ssm.state_pool`) ``state``
        is a pool of slots (:meth:`empty_state` of the pool's size, requests put in with
        :meth:`pool_put`): row i reads and updates slot ``state_batch_indices[i]``, every other slot
        is returned as it was. Each slot keeps its own KV write position, so a request's tokens
        fill only its own slot's KV caches, whoever else steps: ``max_len`` bounds each request's
        tokens (prompt and new), never the pool's steps, and a slot freed and reused starts over
        from the state put into it. A row with no KV slot left is a ValueError naming it."""
        xp = self._xp
        if not isinstance(state, HybridState):
            raise TypeError(f"state: expected a HybridState, got {type(state).__name__}")
        namespace(token=token, **{"params['embedding.weight']": self.params["embedding.weight"]})
        check_attention_convs(self.config, state)
        if state_batch_indices is None:
            return self._step_rows(token, state, None)
        Shapes().check("token", token, ("b",))
        check_state_batch_indices(state_batch_indices, state.positions.valid.shape[0], token.shape[0],
                                  "token", token, xp=xp)
        logits, rows = self._step_rows(token, gather_hybrid(state, state_batch_indices, xp=xp), state_batch_indices)
        return logits, scatter_hybrid(state, state_batch_indices, rows, xp=xp)

    def _step_rows(self, token: Array, state: HybridState, slots: Array | None) -> tuple[Array, HybridState]:
        """:meth:`step` of ``token [b]`` on the rows ``state`` (the pool's ``slots``, or None)."""
        xp = self._xp
        Shapes(b=state.positions.valid.shape[0]).check("token", token, ("b",))
        check_token_ids("token", token, self.config.vocab_size, xp=xp)
        check_room(state, 1, slots=slots, xp=xp)
        tokens = xp.ones((token.shape[0], 1), dtype=xp.bool, device=device(token))
        x = embed_tokens(token, self.params, self.config, xp=xp)
        native = fast_op(xp, "decode_hybrid")
        fused = None if native is None else native(x, state, advance(state.positions, tokens, xp=xp)[0], self.params,
                                                   self.config)
        if fused is not None:  # the whole stack in one native step (the reference below: its twin)
            return scale_logits(fused[0], self.config), fused[1]
        return _layers_and_head(self.config, xp, 0, True)(x, state, tokens, None, self.params)

    def pool_put(self, pool: HybridState, state_batch_indices: Array, rows: HybridState) -> HybridState:
        """A new pool with the slots ``state_batch_indices [b]`` holding ``rows`` (e.g. a request's
        :meth:`prefill` state of the pool's ``max_len``)."""
        for name, value in (("pool", pool), ("rows", rows)):
            if not isinstance(value, HybridState):
                raise TypeError(f"{name}: expected a HybridState, got {type(value).__name__}")
        check_attention_convs(self.config, pool, "pool")
        check_attention_convs(self.config, rows, "rows")
        if rows.max_len != pool.max_len:
            raise ValueError(f"rows: expected KV caches of the pool's max_len {pool.max_len}, got {rows.max_len}")
        check_state_batch_indices(state_batch_indices, pool.positions.valid.shape[0], rows.positions.valid.shape[0],
                                  "rows.positions.valid", rows.positions.valid, xp=self._xp)
        return scatter_hybrid(pool, state_batch_indices, rows, xp=self._xp)

    def _prepared(self, input_ids: Any, attention_mask: Any, max_new_tokens: int | None, eos_token_id: Any,
                  options: dict[str, Any]) -> tuple[Array, Array | None, Options]:
        """The call's ids and mask as arrays (lists left-padded) and its options checked
        (:mod:`portable_ssm.generation_options`, the Mamba-2 model's own rules and defaults)."""
        ids, mask = prompt_arrays(input_ids, attention_mask, rows=self.config.vocab_size,
                                  like=self.params["embedding.weight"])
        if getattr(ids, "ndim", 0) != 2:
            raise ValueError(f"input_ids: expected shape [b, l], got {tuple(ids.shape)}")
        if options.get("compile") is not None:
            raise ValueError(f"compile: a hybrid model's prefill and steps run as its backend runs them by default "
                             f"(JAX: jax.jit, others: eagerly), got {options['compile']!r}")
        defaults = {"vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id, **self.generation_config}
        o = check_options(ids.shape[1], self.config.vocab_size,
                          **call_options(defaults, max_new_tokens, eos_token_id, options))
        check_id_dtype(ids, o, xp=self._xp)
        return ids, mask, o

    def _start(self, ids: Array, mask: Array | None, o: Options,
               state: HybridState | None) -> tuple[Array, HybridState]:
        """The prompt prefilled (into ``state``, else a fresh one with room for the new tokens):
        ``(last logits [b, V], state)``."""
        if state is None:
            state = self.empty_state(ids.shape[0], ids.shape[1] + o.new)
        logits, state = self.prefill(ids, attention_mask=mask, state=state, logits_to_keep=1)
        return logits[:, -1, :], state

    def _decode(self, ids: Array, mask: Array | None, o: Options, last: Array,
                state: HybridState) -> Iterator[tuple[Array, HybridState]]:
        """``(token [b], state before it)`` per new token, from the prompt's last logits on."""
        chooser = TokenChooser(o, ids, mask, xp=self._xp)
        for _ in range(o.new):
            token, _, done = chooser.next(last)
            yield token, state
            if done:
                return
            last, state = self.step(token, state)

    def stream(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
               state: HybridState | None = None, eos_token_id: Any = CHECKPOINT_EOS,
               **options: Any) -> Iterator[tuple[Array, HybridState]]:
        """New tokens one step at a time: yields ``(token [b], state after the tokens so far)``.
        ``input_ids [b, l]`` (an array, or a list of prompts: unequal ones are left-padded; left-padded
        array rows take ``attention_mask``) is prefilled once, then one-token steps run on the KV
        cache; with ``state`` (a returned one) the prompt continues it.

        Options, defaults and checks are the Mamba-2 model's (:func:`portable_ssm.generation.generate`):
        ``max_new_tokens`` / ``max_length``, ``min_new_tokens``, ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``seed``, ``repetition_penalty``, ``eos_token_id`` (default: the
        checkpoint's; None: never stop), ``pad_token_id``, ``stop``, ``logits_processor``, unset ones
        from :attr:`generation_config`; the tokens are chosen by the same
        :class:`~portable_ssm.generation.TokenChooser`. A finished row emits the filler from then on
        (its state keeps taking it) and the stream ends once every row has finished."""
        ids, mask, o = self._prepared(input_ids, attention_mask, max_new_tokens, eos_token_id, options)
        last, state = self._start(ids, mask, o, state)
        yield from self._decode(ids, mask, o, last, state)

    def generate(self, input_ids: Any, max_new_tokens: int | None = None, *, attention_mask: Any = None,
                 state: HybridState | None = None, return_state: bool = False, eos_token_id: Any = CHECKPOINT_EOS,
                 **options: Any) -> Array | tuple[Array, HybridState]:
        """The prompt followed by its continuation: ``input_ids [b, l] -> [b, l + new]``, as
        :meth:`portable_ssm.Mamba2LM.generate` and transformers' ``generate`` return (a list of
        unequal prompts left-padded with 0; :meth:`stream`'s tokens after it, ``new <=
        max_new_tokens``, rows that finished early filled with ``pad_token_id``; arguments as
        there). With ``return_state`` also the state after the prompt and every new token but the
        last (feed that one to :meth:`step` or a next prompt)."""
        check_bool("return_state", return_state)
        xp = self._xp
        ids, mask, o = self._prepared(input_ids, attention_mask, max_new_tokens, eos_token_id, options)
        last, state = self._start(ids, mask, o, state)
        steps = list(self._decode(ids, mask, o, last, state))
        if steps:
            ids, state = xp.concat([ids, xp.stack([token for token, _ in steps], axis=1)], axis=1), steps[-1][1]
        return (ids, state) if return_state else ids  # [b, l + new]


@lru_cache(maxsize=16)
def _layers_and_head(config: HybridConfig, xp: Namespace, keep: int,
                     one_token: bool) -> Callable[..., tuple[Array, HybridState]]:
    """``(x, state, tokens, pad, params) -> (logits, new state)``: :func:`~portable_ssm.stack.run_layers`
    (``keep``, ``one_token`` as there) then the head, compiled where the backend compiles by default
    (JAX: ``jax.jit``, once per shape, counted in ``portable_ssm.backends.jax.TRACES`` as "hybrid
    prefill" and "hybrid step"; op by op, every new prompt length compiled each of the stack's ops
    again); as it is elsewhere. The checks stay in the eager caller."""

    def run(x: Array, state: HybridState, tokens: Array, pad: Array | None,
            params: dict[str, Array]) -> tuple[Array, HybridState]:
        hidden, new = run_layers(x, params, config, state, tokens, pad, xp=xp, one_token=one_token, keep=keep)
        return head(hidden, params, config, xp=xp), new

    return compiled(run, xp, "hybrid step" if one_token else "hybrid prefill")
