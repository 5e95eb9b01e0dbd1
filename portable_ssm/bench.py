"""Benchmarks (tooling, not core): portable_ssm against transformers' pure-torch Mamba2, same weights.

One run builds identical random weights for portable_ssm and, when installed, transformers'
``Mamba2Model`` / ``Mamba2ForCausalLM``, then times, in parts (``--only``):

- ``forward``: inference at the seed shape and a mamba2-130m layer at l = 512 ... 32768;
- ``train``: forward + backward on torch (portable_ssm and transformers);
- ``decode``: tokens/s of a mamba2-130m-shaped random LM at batch 1 and 8 (``logits_step``
  against transformers' cached ``generate``);
- ``scaling``: the 130m-layer rows alone, for the time-vs-length table and plot.

It reports medians, ratios to transformers measured in the same run, GFLOP/s against this
machine's sgemm rate (numpy float32 matmul, timed in the same rounds), peak memory and time-vs-length scaling,
and writes ``RESULTS.md`` and ``scaling.png`` (:mod:`portable_ssm.bench_report`, which also
defines the FLOP count). Timings are reported, never asserted. Frameworks are imported inside
functions only, so ``import portable_ssm`` stays framework-free.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .bench_report import Case, Row, proc_kib, write_results
from .config import Mamba2Config

PARTS = ("forward", "train", "decode", "scaling")
BACKENDS = ("numpy", "torch", "jax", "transformers")
SEED = Mamba2Config(d_model=256, n_layer=2, expand=4, d_state=16, headdim=64)
LAYER_130M = Mamba2Config(d_model=768, n_layer=1, d_state=128, headdim=64, expand=2)
LM_130M = replace(LAYER_130M, n_layer=24, vocab_size=50280)
QUICK = (Mamba2Config(d_model=32, n_layer=2, d_state=8, headdim=16),
         Mamba2Config(d_model=32, n_layer=1, d_state=16, headdim=16),
         Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16, vocab_size=100))
LENGTHS, QUICK_LENGTHS = (512, 2048, 8192, 32768), (64, 256)
TRAIN_MAX_LEN = 8192  # longer training rows need more memory than a CPU runner is assumed to have
PROMPT, DECODE_STEPS = 8, 32
#: The sgemm timed beside every forward and training case, in the same rounds (``[n, n] @ [n, n]``).
SGEMM, SGEMM_N = "sgemm", 4096
Clock = Callable[[], float]
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.process_time}


def cases(parts: tuple[str, ...], quick: bool, max_len: int | None) -> list[Case]:
    """The shapes each part runs; lengths above ``max_len`` are left out."""
    seed, layer, lm = QUICK if quick else (SEED, LAYER_130M, LM_130M)
    b, l = (2, 24) if quick else (8, 60)
    lengths = [n for n in (QUICK_LENGTHS if quick else LENGTHS) if max_len is None or n <= max_len]
    out = [Case("forward", "seed", seed, b, l)] if "forward" in parts else []
    if "forward" in parts or "scaling" in parts:
        out += [Case("forward", "130m-layer", layer, 1, n) for n in lengths]
    if "train" in parts:
        out += [Case("train", "seed", seed, b, l)]
        out += [Case("train", "130m-layer", layer, 1, n) for n in lengths if n <= TRAIN_MAX_LEN]
    if "decode" in parts:
        out += [Case("decode", "tiny-lm" if quick else "130m-lm", lm, batch, PROMPT) for batch in (1, 8)]
    return out


def _timed(fn: Callable[[], Any], clock: Clock) -> tuple[float, float | None, Any]:
    """``(seconds, peak MiB over the RSS before the call or None, output)`` of one call. The peak is
    the process's VmHWM, reset through ``/proc/self/clear_refs`` (Linux; None elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = proc_kib("/proc/self/status", "VmRSS")
    except OSError:
        base = None
    start = clock()
    out = fn()
    seconds = clock() - start
    hwm = proc_kib("/proc/self/status", "VmHWM")
    return seconds, None if base is None or hwm is None else max(hwm - base, 0) / 1024, out


def measure(fns: dict[str, Callable[[], Any]], repeats: int, clock: Clock = time.perf_counter,
            budget_s: float = 30.0) -> dict[str, tuple[float, int, float, float | None, Any]]:
    """Side by side: one warm-up call of each function, then rounds that call each in turn, so every
    backend sees the same machine load; each gets ``repeats`` timed calls (fewer, at least two,
    when its first call says ``budget_s`` would be exceeded). Returns, per name, ``(median s, runs,
    first-call s, peak MiB or None, last output)``."""
    first, out = {}, {}
    for name, fn in fns.items():
        first[name], _, out[name] = _timed(fn, clock)
    runs = {name: max(2, min(repeats, int(budget_s / max(first[name], 1e-9)))) for name in fns}
    times: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, list[float | None]] = {name: [] for name in fns}
    for turn in range(max(runs.values(), default=0)):
        for name, fn in fns.items():
            if turn < runs[name]:
                seconds, peak, out[name] = _timed(fn, clock)
                times[name].append(seconds)
                peaks[name].append(peak)
    return {name: (statistics.median(times[name]), runs[name], first[name],
                   None if None in peaks[name] else max(peaks[name]), out[name]) for name in fns}


def _host(out: Any) -> Any:
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


def _forward_fn(backend: str, config: Mamba2Config, params: dict[str, Any], x: Any,
                train: bool) -> Callable[[], Any]:
    """A no-argument call running one forward (``train``: forward + backward) on ``backend``."""
    from .model import forward

    if backend == "numpy":
        return lambda: forward(x, params, config=config)
    if backend == "jax":
        import jax

        run = jax.jit(lambda xj, pj: forward(xj, pj, config=config))
        xj, pj = jax.numpy.asarray(x), {k: jax.numpy.asarray(v) for k, v in params.items()}
        return lambda: run(xj, pj).block_until_ready()
    import torch

    xt = torch.from_numpy(x)
    if backend == "torch":
        leaves = {k: torch.from_numpy(v).requires_grad_(train) for k, v in params.items()}

        def call() -> Any:
            return forward(xt, leaves, config=config)
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


def _decode(backend: str, config: Mamba2Config, params: dict[str, Any], ids: Any,
            clock: Clock) -> tuple[list[float], Any]:
    """Greedy decode of ``DECODE_STEPS + 1`` tokens after ``ids [b, PROMPT]``: step seconds, tokens."""
    import contextlib

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
        return list(np.diff(stamp.stamps)), _host(out[:, ids.shape[1]:])
    from .backends import load, to_backend
    from .lm import logits, logits_step

    xp, p = load(backend).namespace(), {k: to_backend(v, backend) for k, v in params.items()}
    no_grad = __import__("torch").inference_mode() if backend == "torch" else contextlib.nullcontext()
    with no_grad:
        out, state = logits(to_backend(ids, backend), p, config=config, return_state=True)
        tokens, times = [xp.argmax(out[:, -1, :], axis=-1)], []
        for _ in range(DECODE_STEPS):
            start = clock()
            out, state = logits_step(tokens[-1], state, p, config=config)
            tokens.append(xp.argmax(out, axis=-1))
            times.append(clock() - start)
    return times, np.stack([_host(t) for t in tokens], axis=1)


def run_case(case: Case, backends: list[str], repeats: int, clock: Clock = time.perf_counter,
             sgemm_n: int = SGEMM_N) -> list[Row]:
    """Measures one case on each backend that applies, side by side with an ``[sgemm_n, sgemm_n]``
    sgemm (forward and training cases), then fills ratios and agreement checks."""
    import numpy as np

    from .params import init_params

    params, rng = init_params(case.config, seed=0), np.random.default_rng(1)
    if case.part == "decode":
        x = rng.integers(0, case.config.vocab_size, (case.batch, case.length))
        backends = [b for b in backends if b != "jax"]
    else:
        x = rng.standard_normal((case.batch, case.length, case.config.d_model)).astype(np.float32)
        backends = [b for b in backends if case.part == "forward" or b in ("torch", "transformers")]
    rows, outputs = [], {}
    if case.part == "decode":
        for backend in backends:
            times, outputs[backend] = _decode(backend, case.config, params, x, clock)
            rows.append(Row(case, backend, statistics.median(times), len(times), times[0], None))
    else:
        fns = {b: _forward_fn(b, case.config, params, x, case.part == "train") for b in backends}
        measured = measure({**fns, SGEMM: _sgemm_call(sgemm_n)}, repeats, clock)
        sgemm = 2 * sgemm_n**3 / measured.pop(SGEMM)[0] / 1e9
        for backend, (seconds, runs, first, peak, out) in measured.items():
            outputs[backend] = _host(out)
            rows.append(Row(case, backend, seconds, runs, first, peak, sgemm=sgemm))
    ref = outputs.get("transformers", outputs.get("numpy"))
    base = next((r.seconds for r in rows if r.backend == "transformers"), None)
    for row in rows:
        row.ratio = None if base is None else base / row.seconds
        got = outputs[row.backend]
        if ref is not None and case.part == "decode":
            row.check = f"{int((got == ref).sum())}/{ref.size}"
        elif ref is not None:
            row.check = f"{float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30)):.1e}"
    return rows


def _sgemm_call(n: int) -> Callable[[], Any]:
    """One numpy float32 ``[n, n] @ [n, n]``: the machine's matrix-multiply rate, timed in the rounds."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((2, n, n)).astype(np.float32)
    return lambda: a[0] @ a[1]


def _set_threads(threads: int | None) -> list[str]:
    """Before any framework loads: drops OpenBLAS settings tuned for another CPU and applies
    ``--threads``. Returns notes for RESULTS.md."""
    if "numpy" in sys.modules:
        return ["numpy was imported before the runner: BLAS environment left as it was"]
    notes = [f"unset for this run: {k}={os.environ.pop(k)}" for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
             if k in os.environ]
    if threads is not None:
        os.environ.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                          MKL_NUM_THREADS=str(threads))
        if threads == 1:
            os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        notes.append(f"--threads {threads}: every library limited to {threads} thread(s)")
    return notes


def main(argv: list[str] | None = None) -> int:
    """``portable-ssm bench``: runs the parts asked for and writes RESULTS.md and scaling.png."""
    parser = argparse.ArgumentParser(prog="portable-ssm bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run under a minute")
    parser.add_argument("--max-len", type=int, default=None, help="leave out lengths above this")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list (default: all installed)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row after one warm-up")
    parser.add_argument("--threads", type=int, default=None, help="threads for every library")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (steadier on a shared machine; "
                             "meaningful with --threads 1 only)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks"), help="folder for the results")
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.only.split(",") if p.strip())
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    for bad in [p for p in parts if p not in PARTS] + [b for b in wanted if b not in BACKENDS]:
        parser.error(f"unknown part or backend {bad!r}: parts {PARTS}, backends {BACKENDS}")
    notes = _set_threads(args.threads)
    import importlib.util

    from tqdm import tqdm

    backends = [b for b in wanted if importlib.util.find_spec(b) is not None]
    if "torch" not in backends:
        backends = [b for b in backends if b != "transformers"]
    notes += [f"skipped (not installed): {b}" for b in wanted if b not in backends]
    notes += [f"load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}",
              "forward and training cases run side by side: one warm-up call per backend, then rounds "
              f"that call every backend and a numpy [{SGEMM_N}, {SGEMM_N}] float32 sgemm in turn; medians "
              "per backend; % sgemm is against the sgemm timed in the same rounds",
              "jax rows time `jax.jit(forward)`; their first ms includes the compile",
              f"decode: {PROMPT}-token prompt, then {DECODE_STEPS} greedy steps timed one by one "
              "(portable_ssm.lm.logits_step + argmax; transformers: generate(use_cache=True))"]
    clock = CLOCKS[args.clock]
    if args.clock == "cpu":
        notes.append("--clock cpu: times are this process's CPU seconds (time.process_time), not wall time")
    rows: list[Row] = []
    for case in tqdm(cases(parts, args.quick, args.max_len), desc="bench", unit="shape"):
        rows += run_case(case, backends, args.repeats, clock, sgemm_n=1024 if args.quick else SGEMM_N)
    notes.append(f"load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"wrote {write_results(rows, args.out, notes)}")
    return 0
