"""What the benchmarks time (tooling, not core): one call per backend on identical weights.

:func:`forward_fn` builds a no-argument forward (or forward + backward) on numpy (with or without
its native fast paths), torch, jax or transformers' pure-torch ``Mamba2Model``; :func:`prefill_fn`
a language model's prompt pass to the last position's logits; :func:`decode_run` a row's greedy
decode, stepped by the caller (:func:`decode` times one on its own); :func:`sgemm_call` is the
matrix multiply the machine's rate is measured with. Frameworks are imported inside functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import Mamba2Config

Clock = Callable[[], float]
PROMPT, DECODE_STEPS = 8, 32


def host(out: Any) -> Any:
    import numpy as np

    return np.asarray(out.detach().cpu() if hasattr(out, "detach") else out)


def transformers_model(config: Mamba2Config, params: dict[str, Any], *, lm: bool = False) -> Any:
    """transformers' ``Mamba2Model`` (``lm``: ``Mamba2ForCausalLM``) holding ``params`` (numpy,
    core names), in eval mode. Its chunk size stays transformers' default (256); the vocabulary is
    the padded one; a backbone without vocabulary gets an unused 16-row embedding."""
    import torch
    from transformers import Mamba2Config as HFConfig
    from transformers import Mamba2ForCausalLM, Mamba2Model

    c = config
    hf = HFConfig(hidden_size=c.d_model, num_hidden_layers=c.n_layer, state_size=c.d_state,
                  head_dim=c.headdim, num_heads=c.nheads, n_groups=c.ngroups, expand=c.expand,
                  conv_kernel=c.d_conv, time_step_limit=c.dt_limit, layer_norm_epsilon=c.norm_eps,
                  residual_in_fp32=c.residual_in_fp32, use_bias=c.bias, use_conv_bias=c.conv_bias,
                  vocab_size=c.padded_vocab_size or 16, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=0, eos_token_id=None)
    state = {k.replace("embedding.", "embeddings."): torch.from_numpy(v) for k, v in params.items()}
    if not lm:
        model = Mamba2Model(hf)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"embeddings.weight"}:
            raise RuntimeError(f"transformers layout changed: missing {missing}, unexpected {unexpected}")
        return model.eval()
    head = state.pop("lm_head.weight", state["embeddings.weight"])
    model = Mamba2ForCausalLM(hf)
    model.load_state_dict({"lm_head.weight": head, **{"backbone." + k: v for k, v in state.items()}})
    return model.eval()


def without_fast_ops(fn: Callable[[], Any], backend: str) -> Callable[[], Any]:
    """``fn`` run with ``backend``'s native fast paths switched off: the array-API core alone."""
    from ..backends import load

    ops = load(backend).FAST_OPS

    def call() -> Any:
        saved = dict(ops)
        ops.clear()
        try:
            return fn()
        finally:
            ops.update(saved)
    return call


def forward_fn(backend: str, config: Mamba2Config, params: dict[str, Any], x: Any,
               train: bool) -> Callable[[], Any]:
    """A no-argument call running one forward (``train``: forward + backward) on ``backend``;
    ``"numpy-ref"`` is numpy without its native fast paths, ``"torch-compile"`` torch through
    ``torch.compile`` (what ``Mamba2Module(compile=True)`` runs)."""
    from ..model import forward

    if backend == "numpy":
        return lambda: forward(x, params, config=config)
    if backend == "numpy-ref":
        return without_fast_ops(lambda: forward(x, params, config=config), "numpy")
    if backend == "jax":
        import jax

        run = jax.jit(lambda xj, pj: forward(xj, pj, config=config))
        xj, pj = jax.numpy.asarray(x), {k: jax.numpy.asarray(v) for k, v in params.items()}
        return lambda: run(xj, pj).block_until_ready()
    import torch

    xt = torch.from_numpy(x)
    if backend in ("torch", "torch-compile"):
        from ..backends.torch import compiled

        leaves = {k: torch.from_numpy(v).requires_grad_(train) for k, v in params.items()}
        run = compiled(forward) if backend == "torch-compile" else forward

        def call() -> Any:
            return run(xt, leaves, config=config)
    else:
        model = transformers_model(config, params).train(train)
        leaves = dict(model.named_parameters())

        def call() -> Any:
            return model(inputs_embeds=xt).last_hidden_state
    if not train:
        return torch.inference_mode()(call)

    def step() -> Any:
        for v in leaves.values():
            v.grad = None
        y = call()
        (y * y).mean().backward()
        return y
    return step


#: Decode rows with low-precision weights: ``backend-kind`` runs ``backend`` on ``quantize(params, kind)``.
QUANTIZED_DECODE = {"numpy-int8": ("numpy", "int8"), "numpy-bf16": ("numpy", "bfloat16"),
                    "torch-int8": ("torch", "int8"), "torch-bf16": ("torch", "bfloat16"),
                    "torch-compile-int8": ("torch", "int8"), "torch-compile-bf16": ("torch", "bfloat16")}


def decode_target(backend: str) -> tuple[str, str]:
    """``(array library, weight kind)`` a decode row runs: ``QUANTIZED_DECODE``'s, torch for
    ``torch-compile``, else the row's own backend with float32 weights."""
    return QUANTIZED_DECODE.get(backend, ("torch" if backend == "torch-compile" else backend, "float32"))


def decode_params(backend: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (numpy) on the decode row's backend, quantized for the ``QUANTIZED_DECODE`` rows."""
    from ..backends import to_backend
    from ..quantized import quantize

    name, kind = decode_target(backend)
    return quantize({k: to_backend(v, name) for k, v in params.items()}, kind)


def weight_bytes(params: dict[str, Any], config: Mamba2Config) -> int:
    """Bytes of weights one decode step reads: every parameter once, quantized ones by their
    storage (the tied embedding counts once, as the head; an untied embedding, of which a step
    reads one row, is left out)."""
    from ..quantized import params_nbytes

    read = {k: v for k, v in params.items() if config.tie_embeddings or k != "embedding.weight"}
    return params_nbytes(read)


@contextlib.contextmanager
def bandwidth_call(threads: int, gib: float = 1.0) -> Iterator[tuple[Callable[[], Any], int]]:
    """A context giving ``(call, bytes)``: one streaming read of a ``gib`` GiB float32 array, split
    over ``threads`` Python threads (``numpy.max`` releases the GIL): the machine's memory bandwidth
    as a decode step can use it, with the thread count the other rows get. Leaving it shuts the
    threads down and frees the array."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    data = np.ones(int(gib * 2**30) // 4, np.float32)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        yield (lambda: list(pool.map(np.max, parts))), data.nbytes


def prefill_fn(backend: str, config: Mamba2Config, params: dict[str, Any], ids: Any) -> Callable[[], Any]:
    """A no-argument prompt pass over ``ids [b, l]`` giving the last position's logits ``[b, vocab]``:
    :func:`portable_ssm.lm.prefill` (what generation runs; on jax under ``jax.jit``), or
    transformers' ``Mamba2ForCausalLM`` with ``logits_to_keep=1`` and no cache."""
    if backend == "transformers":
        import torch

        model, ids_t = transformers_model(config, params, lm=True), torch.from_numpy(ids)
        return torch.inference_mode()(lambda: model(ids_t, use_cache=False, logits_to_keep=1).logits[:, -1])
    from ..backends import load, to_backend
    from ..lm import prefill

    xp, x = load(backend).namespace(), to_backend(ids, backend)
    p = {k: to_backend(v, backend) for k, v in params.items()}

    def call(x: Any, p: dict[str, Any]) -> Any:
        return prefill(x, None, None, p, config=config, xp=xp)[0]
    if backend == "jax":
        import jax

        run = jax.jit(call)
        return lambda: run(x, p).block_until_ready()
    if backend == "torch":
        import torch

        return torch.inference_mode()(lambda: call(x, p))
    return lambda: call(x, p)


@dataclass
class DecodeRun:
    """One decode row ready to step: each ``next(tokens)`` is one greedy token on the host
    (``[b]``; the first after the prompt pass, each later one after one decode step), to be run
    inside ``context()``; ``weight_bytes`` is what a step reads (None where not counted)."""

    tokens: Iterator[Any]
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    weight_bytes: int | None


def decode_run(backend: str, config: Mamba2Config, params: dict[str, Any], ids: Any, *,
               new_tokens: int = DECODE_STEPS + 1, scores: list[Any] | None = None) -> DecodeRun:
    """A portable_ssm row's greedy decode of ``new_tokens`` tokens after ``ids [b, l]``:
    :func:`portable_ssm.stream` (arguments checked once, then one unchecked decode step per token,
    as generation runs it; compiled on JAX, and through torch.compile for the ``torch-compile*``
    rows, ``compile=True``), under ``torch.inference_mode`` on torch, with the weight bytes a step
    reads (:func:`weight_bytes`). With ``scores``, each token's logits ``[b, vocab]`` are appended
    to it on the host (through ``logits_processor``)."""
    from ..backends import to_backend
    from ..generation import stream

    name = decode_target(backend)[0]
    p = decode_params(backend, params)
    context = __import__("torch").inference_mode if name == "torch" else contextlib.nullcontext
    record = {} if scores is None else {"logits_processor": lambda _, s: scores.append(host(s).copy()) or s}

    def tokens() -> Iterator[Any]:  # stream() checks and prefills when called: inside the first next()'s context
        for token in stream(to_backend(ids, name), p, config=config, max_new_tokens=new_tokens,
                            compile=True if backend.startswith("torch-compile") else None, **record):
            yield host(token)  # on the host: the step is done (JAX dispatches asynchronously)

    return DecodeRun(tokens(), context, weight_bytes(p, config))


def timed_steps(run: DecodeRun, steps: int, clock: Clock) -> tuple[list[float], list[Any]]:
    """The next ``steps`` tokens of ``run``, each step timed alone: ``(seconds, tokens)``."""
    times, tokens = [], []
    for _ in range(steps):
        with run.context():
            start = clock()
            tokens.append(next(run.tokens))
            times.append(clock() - start)
    return times, tokens


def decode(backend: str, config: Mamba2Config, params: dict[str, Any], ids: Any,
           clock: Clock) -> tuple[list[float], Any, int | None]:
    """Greedy decode of ``DECODE_STEPS + 1`` tokens after ``ids [b, PROMPT]`` on its own: step
    seconds, tokens and the weight bytes a step reads (None for transformers, whose
    ``generate(use_cache=True)`` is timed token to token; portable_ssm rows: :func:`decode_run`,
    the prompt pass untimed, then each step; the one compiling step does not move the median)."""
    import numpy as np

    if backend == "transformers":
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        class Stamp(LogitsProcessor):  # called once per generated token: times each decode step
            def __init__(self) -> None:
                self.stamps: list[float] = []

            def __call__(self, input_ids: Any, scores: Any) -> Any:
                self.stamps.append(clock())
                return scores

        model, stamp = transformers_model(config, params, lm=True), Stamp()
        with torch.inference_mode():
            out = model.generate(torch.from_numpy(ids), max_new_tokens=DECODE_STEPS + 1, do_sample=False,
                                 use_cache=True, logits_processor=LogitsProcessorList([stamp]))
        return list(np.diff(stamp.stamps)), host(out[:, ids.shape[1]:]), None
    run = decode_run(backend, config, params, ids)
    first = timed_steps(run, 1, clock)[1]
    times, rest = timed_steps(run, DECODE_STEPS, clock)
    return times, np.stack(first + rest, axis=1), run.weight_bytes


def sgemm_call(n: int) -> Callable[[], Any]:
    """One numpy float32 ``[n, n] @ [n, n]``: the machine's matrix-multiply rate, timed in the rounds."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((2, n, n)).astype(np.float32)
    return lambda: a[0] @ a[1]
