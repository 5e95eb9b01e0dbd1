"""Autoregressive generation with a real cache: one chunked-scan prefill, then one recurrent step per token.

The prompt ``[b, l]`` goes through the chunked scan once (:func:`portable_ssm.lm.prefill`, the
last position's logits and the state; the last layer computes its final state and last output
alone, :func:`portable_ssm.ssd.ssd_last`); each new token then costs one decode step
(:func:`portable_ssm.lm.decode`, as :func:`portable_ssm.lm.logits_step`) on the per-layer conv and SSM
states, so memory per token is constant whatever the length. The tokens equal those of recomputing
the full forward over the whole sequence at every step.

Choosing a token from ``logits [b, V]`` (:func:`next_token`):

* ``temperature == 0``: greedy, ``argmax`` (the first maximum on ties); top_k/top_p are ignored.
* ``temperature > 0``: scores ``logits / temperature`` in float32 (float64 stays float64), top-k
  keeps the k largest scores, top-p keeps the smallest set of most likely tokens whose probability
  reaches ``top_p``; then the Gumbel-max trick, ``argmax(scores + gumbel)``, which draws exactly
  from ``softmax(scores)``. The Gumbel noise ``[b, V]`` is drawn on the host from numpy's generator
  (``portable_ssm.backends.load("numpy").rng(seed)``) and moved to the logits' backend, so one seed
  gives the same tokens on every backend (up to rounding of near ties).

Options (transformers' names and semantics): ``max_new_tokens`` or ``max_length``,
``min_new_tokens``, ``do_sample``, ``repetition_penalty``, ``eos_token_id`` (one id or several),
``pad_token_id``, ``stop`` token sequences and a ``logits_processor`` hook
(:mod:`portable_ssm.generation_options`). A finished row emits ``pad_token_id`` (default: the
first eos id); generation stops early once every row has finished, so the result has
``new <= max_new_tokens`` columns.

Ragged batches: ``attention_mask [b, l]`` marks left padding (:mod:`portable_ssm.padding`); every
row then gets exactly the tokens it gets alone (:func:`left_pad` builds ids and mask from lists).
Continued generation: ``initial_state`` continues an earlier call; ``return_state=True`` also
returns the state after every returned token (a finished row's state stops at its eos or stop
sequence, its filler tokens are never fed), so a conversation continues from it with its next
turn's tokens.

On JAX the prefill (``lm.prefill``) and the decode step (``lm.decode`` plus the finished rows'
state merge) are ``jax.jit``-compiled once per shape and config and reused by later calls
(``portable_ssm.backends.jax.TRACES`` counts their traces); the token choice runs eagerly. On
torch, ``compile=True`` runs the decode step through ``torch.compile`` (per batch size; the
prefill stays eager, as it would compile once per prompt length).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

from ._array import (
    Array,
    Namespace,
    array_backend,
    backend_name,
    compute_dtype,
    constant,
    device,
    dtype_name,
    namespace,
)
from ._checks import Shapes, check_bool, check_given, check_same_device
from .backends import compiled, fast_op, load, to_backend
from .config import Mamba2Config
from .generation_options import (
    Options,
    add_seen,
    ban,
    check_options,
    check_sampling,
    finishing,
    penalize,
    seen_tokens,
)
from .lm import check_token_ids, decode, prefill
from .model import Mamba2State, _check_state
from .padding import check_attention_mask
from .params import Params, check_params
from .prompts import left_pad

__all__ = ["TokenChooser", "generate", "left_pad", "next_token", "stream"]


def _mask_below(scores: Array, threshold: Array, *, xp: Namespace) -> Array:
    """``scores`` with every entry below its row's ``threshold [b, 1]`` set to -inf."""
    return xp.where(scores < threshold, constant(-math.inf, scores, xp=xp), scores)


def _top_k(scores: Array, k: int, *, xp: Namespace) -> Array:
    ranked = xp.sort(scores, axis=-1, descending=True)  # [b, V]
    return _mask_below(scores, ranked[:, k - 1:k], xp=xp)


def _top_p(scores: Array, p: float, *, xp: Namespace) -> Array:
    ranked = xp.sort(scores, axis=-1, descending=True)  # [b, V]
    probs = xp.exp(ranked - ranked[:, :1])
    probs = probs / xp.sum(probs, axis=-1, keepdims=True)
    before = xp.cumulative_sum(probs, axis=-1) - probs  # probability of the more likely tokens
    kept = xp.where(before < p, ranked, constant(math.inf, ranked, xp=xp))  # the first token is always kept
    return _mask_below(scores, xp.min(kept, axis=-1, keepdims=True), xp=xp)


def _choose(logits: Array, temperature: float, top_k: int | None, top_p: float | None, rng: Any, *,
            xp: Namespace) -> Array:
    """``logits [b, V]`` -> token ids ``[b]`` (see the module docstring)."""
    if temperature == 0:
        return xp.argmax(logits, axis=-1)
    cdtype = compute_dtype(xp, logits.dtype)
    scores = xp.astype(logits, cdtype) / temperature  # [b, V]
    if top_k is not None and top_k < scores.shape[-1]:
        scores = _top_k(scores, top_k, xp=xp)
    if top_p is not None and top_p < 1:
        scores = _top_p(scores, top_p, xp=xp)
    host = load("numpy").namespace()
    u = rng.uniform(host.finfo(host.float64).tiny, 1.0, size=tuple(scores.shape))
    gumbel = to_backend(-host.log(-host.log(u)), array_backend(scores), device=device(scores),
                        dtype=dtype_name(cdtype))  # [b, V]
    return xp.argmax(scores + gumbel, axis=-1)


def next_token(logits: Array, *, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, rng: Any = None) -> Array:
    """One token per row from ``logits [b, V]``: ids ``[b]`` on logits' backend.

    ``temperature == 0`` is greedy; otherwise ``rng`` (a ``numpy.random.Generator``, e.g.
    ``portable_ssm.backends.load("numpy").rng(seed)``) supplies the Gumbel noise.
    """
    xp = namespace(logits=logits)
    temperature = check_sampling(temperature, top_k, top_p)
    if logits.ndim != 2:
        raise ValueError(f"logits: expected shape [b, V], got {tuple(logits.shape)}")
    if not xp.isdtype(logits.dtype, "real floating"):
        raise TypeError(f"logits: expected a real floating dtype, got {dtype_name(logits.dtype)}")
    if temperature > 0 and not hasattr(rng, "uniform"):
        raise TypeError(f"rng: temperature > 0 needs a numpy.random.Generator, got {type(rng).__name__}")
    return _choose(logits, temperature, top_k, top_p, rng, xp=xp)


def _keep_finished(old: Mamba2State, new: Mamba2State, active: Array, *, xp: Namespace) -> Mamba2State:
    """``new`` on the ``active [b]`` rows, ``old`` on the others."""
    return Mamba2State(conv=tuple(xp.where(active[:, None, None], n, o) for o, n in zip(old.conv, new.conv)),
                       ssm=tuple(xp.where(active[:, None, None, None], n, o) for o, n in zip(old.ssm, new.ssm)))


def _compiler(xp: Namespace, compile: bool | None) -> Callable[..., Any] | None:
    """The decode step's compiler: the backend's ``fast_op(xp, "jit")`` (JAX: always, unless
    ``compile=False``) or its ``fast_op(xp, "compile")`` (torch: ``torch.compile``, only with
    ``compile=True``); None runs the step eagerly. ValueError for ``compile=True`` on a backend
    with neither."""
    default, on_request = fast_op(xp, "jit"), fast_op(xp, "compile")
    if compile and default is None and on_request is None:
        raise ValueError(f"compile: backend {backend_name(xp)!r} has no compiler (torch and jax have), got True")
    if compile is False:
        return None
    return default or (on_request if compile else None)


@lru_cache(maxsize=8)
def _prefiller(config: Mamba2Config, xp: Namespace) -> Callable[..., tuple[Array, Mamba2State]]:
    """``(ids [b, l], state or None, pad [b] or None, params) -> (last logits [b, rows], state)``,
    compiled where the backend compiles by default (JAX: once per prompt shape); never with
    torch.compile, which would compile a graph per prompt length."""

    def run(ids: Array, state: Mamba2State | None, pad: Array | None, params: Params) -> tuple[Array, Mamba2State]:
        return prefill(ids, state, pad, params, config=config, xp=xp)

    return compiled(run, xp, "prefill")


@lru_cache(maxsize=8)
def _decoder(config: Mamba2Config, xp: Namespace, donate_state: bool = False,
             compile: bool | None = None) -> Callable[..., tuple[Array, Mamba2State]]:
    """``(token [b], state, active [b] or None, params) -> (logits [b, rows], state)``: one decode
    step, the inactive rows' state kept; ``donate_state``: the state passed in is never read again
    (no caller holds it), so the step may overwrite it; ``compile``: as :func:`_compiler`."""

    def run(token: Array, state: Mamba2State, active: Array | None, params: Params) -> tuple[Array, Mamba2State]:
        out, new = decode(token, state, params, config=config, xp=xp)
        return out, (new if active is None else _keep_finished(state, new, active, xp=xp))

    compiler = _compiler(xp, compile)
    return run if compiler is None else compiler(run, "decode", (1,) if donate_state else ())


def _processed(processor: Callable[[Array, Array], Array], input_ids: Array, generated: list[Array],
               scores: Array, *, xp: Namespace) -> Array:
    """The user's ``processor(ids_so_far [b, l + i], scores [b, vocab])``, its result checked."""
    ids = input_ids if not generated else xp.concat([input_ids, xp.stack(generated, axis=1)], axis=1)
    out = processor(ids, scores)
    name = "logits_processor's result"
    check_given(**{name: out})
    namespace(**{"scores": scores, name: out})
    if tuple(out.shape) != tuple(scores.shape) or out.dtype != scores.dtype:
        raise ValueError(f"logits_processor: expected scores of shape {tuple(scores.shape)} and dtype "
                         f"{dtype_name(scores.dtype)} (those it was given), got shape {tuple(out.shape)} "
                         f"of {dtype_name(out.dtype)}")
    check_same_device(name, out, "scores", scores)
    if bool(xp.any(xp.isnan(out))):
        raise ValueError("logits_processor: returned NaN scores; mask tokens with -inf instead")
    if bool(xp.any(xp.all(out == -math.inf, axis=-1))):
        raise ValueError("logits_processor: returned a row of scores that are all -inf (no token left to choose)")
    return out


def check_id_dtype(input_ids: Array, options: Options, *, xp: Namespace) -> None:
    """TypeError unless ``input_ids``' dtype holds every id generation may choose (new tokens come
    back in it)."""
    if xp.iinfo(input_ids.dtype).max < options.vocab - 1:
        raise TypeError(f"input_ids: dtype {dtype_name(input_ids.dtype)} holds ids up to "
                        f"{xp.iinfo(input_ids.dtype).max} but new tokens go up to {options.vocab - 1}; "
                        f"pass int32 or int64 ids")


class TokenChooser:
    """The per-step "scores -> next token" of every model's generation (:class:`portable_ssm.Mamba2LM`
    and :class:`portable_ssm.HybridLM` both call it): repetition penalty, min_new_tokens, the user's
    processor and the sampling on ``logits [b, rows]``, then the finished rows' bookkeeping (eos ids,
    stop sequences, the filler they emit from then on).

    ``options`` are checked (:func:`~portable_ssm.generation_options.check_options`);
    ``input_ids [b, l]`` the prompt (new tokens come in its dtype), ``attention_mask [b, l]`` or
    None its left padding (padding is not "seen" by the repetition penalty)."""

    def __init__(self, options: Options, input_ids: Array, attention_mask: Array | None, *, xp: Namespace) -> None:
        o = options
        self.xp, self.options, self.input_ids = xp, o, input_ids
        self.rng = load("numpy").rng(o.seed) if o.temperature > 0 else None
        valid = None if attention_mask is None else xp.astype(attention_mask, xp.bool)
        self.seen = None if o.penalty is None else seen_tokens(input_ids, valid, o.vocab, xp=xp)
        self.fill = None if o.fill is None else xp.full((input_ids.shape[0],), o.fill, dtype=input_ids.dtype,
                                                        device=device(input_ids))
        self.generated: list[Array] = []
        self.finished: Array | None = None
        self.some_finished = False  # whether a row of ``finished`` is true (read with the step's "done")

    def next(self, last: Array) -> tuple[Array, Array | None, bool]:
        """``last [b, rows]`` (the logits after the tokens so far) -> ``(token [b], fed, done)``:
        ``fed [b]`` bool the rows whose token is a real one (None: all; the others emit the
        filler), ``done`` once this was the last token (max_new_tokens, or every row finished).
        One host read a token at most (how many rows have finished, where eos or stop can end a
        row), none with neither; the filler and ``fed`` only once a row has finished."""
        xp, o = self.xp, self.options
        scores = last[:, :o.vocab]  # [b, vocab]
        if self.seen is not None:
            scores = penalize(scores, self.seen, o.penalty, xp=xp)
        if len(self.generated) < o.min_new and o.eos:
            scores = ban(scores, o.eos, xp=xp)
        if o.processor is not None:
            scores = _processed(o.processor, self.input_ids, self.generated, scores, xp=xp)
        token = xp.astype(_choose(scores, o.temperature, o.top_k, o.top_p, self.rng, xp=xp),
                          self.input_ids.dtype, copy=False)  # [b]
        fed = None
        if self.some_finished:
            fed = xp.logical_not(self.finished)
            token = xp.where(self.finished, self.fill, token)
        self.generated.append(token)
        ends = finishing(token, self.generated, o, xp=xp)
        if ends is not None:
            self.finished = ends if self.finished is None else self.finished | ends
        if self.seen is not None:
            self.seen = add_seen(self.seen, token, xp=xp)
        if len(self.generated) == o.new or self.finished is None:
            return token, fed, len(self.generated) == o.new
        count = int(xp.sum(xp.astype(self.finished, xp.int32)))  # rows finished so far
        self.some_finished = count > 0
        return token, fed, count == token.shape[0]


class _Prefill:
    """A checked call after its prefill: the options, the last logits ``[b, rows]``, the state and
    the tokens seen so far (``[b, vocab]`` bool, only for repetition_penalty)."""

    def __init__(self, input_ids: Array, params: Params, config: Mamba2Config, attention_mask: Array | None,
                 initial_state: Mamba2State | None, options: dict[str, Any]) -> None:
        xp = check_params(params, config)
        check_given(input_ids=input_ids)
        namespace(input_ids=input_ids, params=params["embedding.weight"])
        rows = config.padded_vocab_size
        if rows is None:
            raise ValueError("config.vocab_size: generation needs a language model, got None")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected shape [b, l] with l >= 1, got {tuple(input_ids.shape)}")
        check_token_ids("input_ids", input_ids, rows, xp=xp)
        shapes = Shapes()
        shapes.check("input_ids", input_ids, ("b", "l"))
        if initial_state is not None:
            _check_state(initial_state, config, params["embedding.weight"], shapes, "initial_state", xp=xp)
        pad = None if attention_mask is None else check_attention_mask(attention_mask, shapes, "input_ids",
                                                                       input_ids, xp=xp)
        self.xp, self.input_ids, self.params, self.config = xp, input_ids, params, config
        self.options = o = check_options(input_ids.shape[1], rows, **options)
        check_id_dtype(input_ids, o, xp=xp)
        self.last, self.state = _prefiller(config, xp)(input_ids, initial_state, pad, params)  # [b, rows]
        self.chooser = TokenChooser(o, input_ids, attention_mask, xp=xp)

    def tokens(self, return_state: bool) -> Iterator[Any]:
        """The new tokens ``[b]`` one at a time, or ``(token, state)`` pairs with ``return_state``."""
        step = _decoder(self.config, self.xp, not return_state, self.options.compile)  # else each state is handed out
        last, state = self.last, self.state
        for _ in range(self.options.new):
            token, fed, done = self.chooser.next(last)
            if return_state:
                last, state = step(token, state, fed, self.params)
                yield token, state
            else:
                yield token
                if not done:
                    last, state = step(token, state, None, self.params)
            if done:
                return


def stream(input_ids: Array, params: Params, *, config: Mamba2Config, attention_mask: Array | None = None,
           initial_state: Mamba2State | None = None, return_state: bool = False,
           **options: Any) -> Iterator[Any]:
    """The new tokens ``[b]`` (input_ids' dtype) one at a time, as they are chosen; with
    ``return_state`` each comes as ``(token, state)``, the state covering it.

    Arguments as :func:`generate`; they are all checked, and the prompt prefilled, before this returns.
    """
    check_bool("return_state", return_state)
    return _Prefill(input_ids, params, config, attention_mask, initial_state, options).tokens(return_state)


def generate(input_ids: Array, params: Params, *, config: Mamba2Config, attention_mask: Array | None = None,
             initial_state: Mamba2State | None = None, return_state: bool = False,
             **options: Any) -> Array | tuple[Array, Mamba2State]:
    """The prompt followed by up to ``max_new_tokens`` new tokens: ``input_ids [b, l] -> [b, l + new]``.

    Args:
        input_ids: integer prompt ids ``[b, l]`` (``l >= 1``) on the params' backend. New tokens
            come back in its dtype, so a dtype that cannot hold every id below ``vocab_size``
            (uint8 or int8 for a vocabulary over 256 or 128 rows) raises TypeError instead of
            wrapping; float ids raise TypeError instead of being truncated.
        params: the language model's parameters.
        config: its configuration (``config.vocab_size`` set).
        attention_mask: ``[b, l]`` left-padding mask (1/True tokens, 0/False padding): each row
            gets the tokens it gets alone (:func:`left_pad`).
        initial_state: a :class:`Mamba2State` the prompt continues (e.g. a previous call's).
        return_state: also return the state after every returned token (finished rows: after
            their eos or stop sequence), ready to continue with the next prompt.
        **options: ``max_new_tokens`` (or ``max_length``: l plus the new tokens; max_new_tokens
            wins), ``min_new_tokens``, ``do_sample`` (False: greedy; None: sample iff
            ``temperature > 0``), ``temperature`` (default 1 with do_sample, else 0), ``top_k``,
            ``top_p``, ``seed`` (the host generator of the sampling noise; None: fresh entropy),
            ``repetition_penalty``, ``eos_token_id`` (an int or several), ``pad_token_id``
            (finished rows' filler, default the first eos id), ``stop`` (token id sequences),
            ``logits_processor`` (``(ids_so_far, scores) -> scores``), ``vocab_size`` (only ids
            below it are chosen; default all ``config.padded_vocab_size`` rows) and ``compile``
            (the decode step: None as the backend does by default, ``jax.jit`` on JAX and eager
            elsewhere; True: on torch through ``torch.compile`` too, whose first step of each
            batch size compiles, about 35 s for the 24-layer 130m shape on two cores; False:
            eager). See :mod:`portable_ssm.generation_options`.

    Returns:
        ``[b, l + new]`` ids (``new <= max_new_tokens``: stops once every row finished), or
        ``(ids, state)``.

    Raises:
        TypeError / ValueError naming the argument or option, before the prompt is read, for any
        malformed one (an unknown option, a bool or float where an int belongs, NaN, a seed < 0,
        ids out of range...); ValueError naming ``logits_processor`` when its result has another
        shape, dtype or device than the scores it was given, or holds NaN or a row of only -inf
        (TypeError for another backend). An exception raised inside the processor propagates.
    """
    check_bool("return_state", return_state)
    run = _Prefill(input_ids, params, config, attention_mask, initial_state, options)
    xp, state = run.xp, run.state
    tokens = []
    for item in run.tokens(return_state):
        token, state = item if return_state else (item, state)
        tokens.append(token)
    ids = input_ids if not tokens else xp.concat([input_ids, xp.stack(tokens, axis=1)], axis=1)  # [b, l + new]
    return (ids, state) if return_state else ids
