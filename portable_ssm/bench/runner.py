"""Benchmarks (tooling, not core): portable_ssm against transformers' pure-torch Mamba2, same weights.

One run builds identical random weights for portable_ssm and, when installed, transformers'
``Mamba2Model`` / ``Mamba2ForCausalLM``, then times, in parts (``--only``):

- ``forward``: inference at the seed shape and a mamba2-130m layer at l = 512 ... 32768;
- ``train``: forward + backward on torch (portable_ssm and transformers);
- ``prefill``: a mamba2-130m-shaped random LM's pass over a 2048-token prompt to the last
  position's logits, at batch 1;
- ``decode``: tokens/s of a mamba2-130m-shaped random LM at batch 1 and 8 (``logits_step``
  against transformers' cached ``generate``);
- ``scaling``: the 130m-layer rows alone, for the time-vs-length table and plot;
- ``quality``: each decode row's logits error and greedy agreement against float32 weights on a
  small LM trained for it (:mod:`portable_ssm.bench.quality`; needs torch);
- ``hybrid``: granite-4.0-h-350m- and Falcon-H1-0.5B-shaped random models (built by transformers)
  through portable_ssm's ``HybridLM`` on numpy beside llama.cpp on the same weights: batch-1 decode
  after a short and a long prompt at float32, bfloat16 and int8 weights, and a float32 prefill
  (:mod:`portable_ssm.bench.hybrid`).

With llama-cpp-python installed and llama.cpp's converter given (``--llama-convert``), the prefill,
batch-1 decode and hybrid parts also time llama.cpp on the same weights (:mod:`portable_ssm.bench.llama`),
and the quality part decodes the trained LM's conversions.

It reports medians, ratios to transformers measured in the same run, GFLOP/s against this
machine's sgemm rate (numpy float32 matmul, timed in the same rounds), peak memory and time-vs-length scaling,
and writes ``RESULTS.md`` and ``scaling.png`` (:mod:`portable_ssm.bench.report`, which also
defines the FLOP count). Timings are reported, never asserted. Frameworks are imported inside
functions only, so ``import portable_ssm`` stays framework-free.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..cli_args import Parser, count, nonempty_path
from ..config import Mamba2Config
from ..host import retain_unless_disabled
from . import hybrid
from .calls import (
    DECODE_STEPS,
    PROMPT,
    QUANTIZED_DECODE,
    Clock,
    bandwidth_call,
    decode,
    decode_run,
    forward_fn,
    host,
    prefill_fn,
    sgemm_call,
)
from .llama import CONVERT_ENV, ROWS, LlamaCpp, greedy_run, prefill_calls, thread_count, unavailable
from .peak import case_inputs, fresh_peak_mib
from .quality import TRAIN_STEPS, QualityRow, quality_notes, quality_rows, train_pattern_lm
from .report import Case, HybridRow, Row, write_results
from .timing import ROUND_STEPS, SETTLE_S, interleaved_decode, measure

PARTS = ("forward", "train", "prefill", "decode", "scaling", "quality", "hybrid")
BACKENDS = ("numpy", "numpy-ref", "torch", "torch-compile", "jax", "transformers", *QUANTIZED_DECODE)
SEED = Mamba2Config(d_model=256, n_layer=2, expand=4, d_state=16, headdim=64)
LAYER_130M = Mamba2Config(d_model=768, n_layer=1, d_state=128, headdim=64, expand=2)
LM_130M = replace(LAYER_130M, n_layer=24, vocab_size=50288)  # a multiple of 16, as llama.cpp needs
QUICK = (Mamba2Config(d_model=32, n_layer=2, d_state=8, headdim=16),
         Mamba2Config(d_model=32, n_layer=1, d_state=16, headdim=16),
         Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16, vocab_size=100))
LENGTHS, QUICK_LENGTHS = (512, 2048, 8192, 32768), (64, 256)
PREFILL, QUICK_PREFILL = 2048, 64  # prompt lengths of the prefill part
TRAIN_MAX_LEN = 8192  # longer training rows need more memory than a CPU runner is assumed to have
#: The sgemm timed beside every forward and training case, in the same rounds (``[n, n] @ [n, n]``).
SGEMM, SGEMM_N = "sgemm", 4096
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.process_time}
#: How long ``--quick`` took, measured once on the project's quiet 2-core VM, the quality part included
#: (``time portable-ssm bench --quick [--backends numpy]``; see docs/benchmarks.md).
QUICK_NOTE = "measured: about 200 s with every backend, 8 s with --backends numpy, on a quiet 2-core VM"


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
    prefill = QUICK_PREFILL if quick else PREFILL
    if "prefill" in parts and (max_len is None or prefill <= max_len):
        out += [Case("prefill", "tiny-lm" if quick else "130m-lm", lm, 1, prefill)]
    if "decode" in parts:
        out += [Case("decode", "tiny-lm" if quick else "130m-lm", lm, batch, PROMPT) for batch in (1, 8)]
    return out


def groups(shapes: list[Case]) -> list[list[Case]]:
    """Cases measured together (:func:`run_group`): forward or training cases of one shape family at
    every length side by side, so time-vs-length ratios share the machine's load; prefill and decode
    cases alone."""
    out: dict[tuple[str, str, int], list[Case]] = {}
    for i, case in enumerate(shapes):
        key = (case.part, case.name, i if case.part in ("prefill", "decode") else -1)
        out.setdefault(key, []).append(case)
    return list(out.values())


def _applies(case: Case, backend: str) -> bool:
    """numpy-ref (numpy without its fast paths) runs forward rows only, the low-precision rows
    (``QUANTIZED_DECODE``) decode rows only, torch-compile forward, training and decode rows; training runs
    on torch (portable_ssm, eager or compiled) and transformers only; prefill and decode on the others."""
    if backend == "numpy-ref":
        return case.part == "forward"
    if backend in QUANTIZED_DECODE:
        return case.part == "decode"
    if backend == "torch-compile":
        return case.part in ("forward", "train", "decode")
    if case.part in ("prefill", "decode"):
        return True
    return case.part == "forward" or backend in ("torch", "transformers")


def run_group(group: list[Case], backends: list[str], repeats: int, clock: Clock = time.perf_counter,
              sgemm_n: int = SGEMM_N, sample_s: float = 1.0, llama: LlamaCpp | None = None,
              threads: int = 1, bandwidth_gib: float = 1.0, settle_s: float = SETTLE_S) -> list[Row]:
    """Measures cases of one config on each backend that applies, then fills ratios (to transformers
    on the same case) and agreement checks. Forward, training and prefill calls of every case and
    backend (forward and training with an ``[sgemm_n, sgemm_n]`` sgemm) run side by side in the
    same rounds (:func:`measure`), so ratios across backends and across lengths compare calls made
    under the same machine load; decode steps likewise (:func:`interleaved_decode`), with the memory
    bandwidth (a streaming read on ``threads`` threads, :func:`~portable_ssm.bench.calls.bandwidth_call`)
    their weight reads are compared with timed in the same rounds; transformers' ``generate`` runs
    apart, before them. With ``llama``, prefill and batch-1 decode groups also get the llama.cpp
    rows (:data:`ROWS`). Every sample and decode turn follows ``settle_s`` idle seconds."""
    import numpy as np

    from ..params import init_params

    part, params = group[0].part, init_params(group[0].config, seed=0)
    inputs = {case: case_inputs(case) for case in group}
    pairs = [(case, b) for case in group for b in backends if _applies(case, b)]
    rows, outputs = [], {}
    with _llama_models(group, params, llama) as models:
        if part == "decode":
            timed = {}
            for case, backend in [(c, b) for c, b in pairs if b == "transformers"]:  # not steppable
                times, outputs[case, backend], _ = decode(backend, case.config, params, inputs[case], clock)
                timed[case, backend] = (times, None)
            runs = {(case, b): decode_run(b, case.config, params, inputs[case]) for case, b in pairs
                    if b != "transformers"}
            runs.update({(group[0], name): greedy_run(model, inputs[group[0]]) for name, model in models.items()})
            with bandwidth_call(threads, bandwidth_gib) as (read, nbytes):
                steps, reads = interleaved_decode(runs, read, clock, settle_s=settle_s)
            bandwidth = nbytes / statistics.median(reads) / 1e9
            for key, (times, tokens) in steps.items():
                outputs[key] = np.stack(tokens, axis=1)
                timed[key] = (times, runs[key].weight_bytes)
            for (case, backend), (times, weights) in timed.items():
                rows.append(Row(case, backend, statistics.median(times), len(times), times[0], None,
                                weight_bytes=weights, bandwidth=bandwidth))
        else:
            fns = {(case, b): prefill_fn(b, case.config, params, inputs[case]) if part == "prefill"
                   else forward_fn(b, case.config, params, inputs[case], part == "train") for case, b in pairs}
            for case in group if models else []:  # llama.cpp's prefill rows
                fns.update({(case, name): fn for name, fn in prefill_calls(models, inputs[case]).items()})
            sgemm_fn = {} if part == "prefill" else {SGEMM: sgemm_call(sgemm_n)}
            measured = measure({**fns, **sgemm_fn}, repeats, clock, sample_s=sample_s, settle_s=settle_s)
            sgemm = 2 * sgemm_n**3 / measured.pop(SGEMM)[0] / 1e9 if sgemm_fn else None
            for (case, backend), (seconds, runs, first, peak, out) in measured.items():
                outputs[case, backend] = host(out)
                rows.append(Row(case, backend, seconds, runs, first, peak, sgemm=sgemm))
    for row in rows:
        ref = outputs.get((row.case, "transformers"), outputs.get((row.case, "numpy")))
        base = next((r.seconds for r in rows if r.case == row.case and r.backend == "transformers"), None)
        row.ratio = None if base is None else base / row.seconds
        got = outputs[row.case, row.backend]
        if ref is not None and row.case.part == "decode":
            row.check = f"{int((got == ref).sum())}/{ref.size}"
        elif ref is not None:
            row.check = f"{float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30)):.1e}"
    order = [*backends, *ROWS]
    return sorted(rows, key=lambda r: (group.index(r.case), order.index(r.backend)))


def _llama_models(group: list[Case], params: dict[str, Any], llama: LlamaCpp | None) -> Any:
    """A context giving ``{row name: llama_cpp.Llama}`` for a prefill or batch-1 decode group (n_ctx:
    the prompt plus the decoded tokens), ``{}`` otherwise."""
    case = group[0]
    if llama is None or case.part not in ("prefill", "decode") or case.batch != 1:
        return contextlib.nullcontext({})
    steps = DECODE_STEPS + 1 if case.part == "decode" else 0
    return llama.models(case.config, params, n_ctx=max(c.length for c in group) + steps)


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


#: Training steps of the quality part's LM in a ``--quick`` run (a smoke run: it need not learn).
QUICK_TRAIN_STEPS = 20


def quality(backends: list[str], llama: LlamaCpp | None, steps: int,
            notes: list[str]) -> list[QualityRow]:
    """The quality part: trains :data:`~portable_ssm.bench.quality.PATTERN_LM` ``steps`` steps and
    compares every decode row of ``backends`` (and llama.cpp's, with ``llama``) on it; no rows,
    with a note, without torch."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        notes.append("quality part skipped: training its LM needs torch")
        return []
    params, loss = train_pattern_lm(steps)
    notes.extend(quality_notes(loss, steps))
    return quality_rows(backends, params, llama)


#: Where results go without ``--out``: a folder of its own, so no run replaces the committed
#: ``benchmarks/RESULTS.md`` unless asked with ``--out benchmarks``.
DEFAULT_OUT = Path("bench-out")


def output_dir(out: Path, *, quick: bool, overwrite: bool) -> Path:
    """``out``, after checking that this run may write there: a ``--quick`` run never replaces or
    extends a RESULTS.md that holds a full run (e.g. the committed ``benchmarks/RESULTS.md``)
    unless ``overwrite``. Raises FileExistsError naming the file."""
    results = out / "RESULTS.md"
    if quick and not overwrite and results.is_file() and not _is_quick_run(results):
        raise FileExistsError(f"{results} holds a full benchmark run; a --quick run does not replace it. "
                              f"Pass another --out (default {DEFAULT_OUT}) or --overwrite")
    return out


def _is_quick_run(results: Path) -> bool:
    """Whether a RESULTS.md records a ``--quick`` run (its ``command:`` line says so)."""
    command = next((line for line in results.read_text().splitlines() if line.startswith("- command: ")), "")
    return "--quick" in command.split()


def _progress(items: list[Any]) -> Any:
    """``items`` with a progress bar (tqdm when installed; otherwise one line per item on stderr)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _plain_progress(items)
    return tqdm(items, desc="bench", unit="group")


def _plain_progress(items: list[Any]) -> Any:
    for i, item in enumerate(items):
        print(f"bench: group {i + 1}/{len(items)}", file=sys.stderr, flush=True)
        yield item


def _llama(args: argparse.Namespace, parts: tuple[str, ...], notes: list[str],
           stack: contextlib.ExitStack) -> LlamaCpp | None:
    """The run's llama.cpp rows (converted files in a temporary folder that ``stack`` removes), or
    None with a note saying why not, when the prefill, decode, quality or hybrid part runs."""
    if not {"prefill", "decode", "quality", "hybrid"} & set(parts):
        return None
    why = unavailable(args.llama_convert, QUICK[2] if args.quick else LM_130M)
    if why is not None:
        notes.append(why)
        return None
    import tempfile

    import llama_cpp

    count = thread_count(args.threads)
    notes.append(f"llama.cpp rows: llama-cpp-python {llama_cpp.__version__}, the same weights converted by "
                 f"{args.llama_convert} to f32, f16 and q8_0 GGUF (not timed); Llama(n_threads={count}, "
                 f"n_threads_batch={count}, n_batch=n_ctx, logits_all=False) with use_extra_bufts=False (no AMX "
                 "repacking); prompt: one eval() to the last logits; decode (b=1 only): one eval() of the last "
                 "token + argmax per step")
    return LlamaCpp(Path(args.llama_convert), count, Path(stack.enter_context(
        tempfile.TemporaryDirectory(prefix="portable-ssm-llama-"))))


def main(argv: list[str] | None = None) -> int:
    """``portable-ssm bench``: runs the parts asked for and writes RESULTS.md and scaling.png."""
    parser = Parser(prog="portable-ssm bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny shapes: a smoke run ({QUICK_NOTE}); never replaces a full run's "
                             "RESULTS.md without --overwrite")
    parser.add_argument("--max-len", type=count(1), default=None, help="leave out lengths above this")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list (default: all installed)")
    parser.add_argument("--repeats", type=count(1), default=5, help="timed calls per row after one warm-up")
    parser.add_argument("--threads", type=count(1), default=None, help="threads for every library")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (steadier on a shared machine; "
                             "meaningful with --threads 1 only)")
    parser.add_argument("--out", type=lambda text: Path(nonempty_path(text)), default=DEFAULT_OUT,
                        help=f"folder for RESULTS.md and scaling.png (default ./{DEFAULT_OUT}; the committed "
                             "results are written only with an explicit --out benchmarks)")
    parser.add_argument("--fresh-peak", action=argparse.BooleanOptionalAction, default=None,
                        help="measure each row's peak memory in a fresh process (VmHWM; default: on, "
                             "off with --quick)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let a --quick run replace (or --append to) a full run's RESULTS.md")
    parser.add_argument("--append", action="store_true",
                        help="add this run as a section at the end of the folder's RESULTS.md (no plot), "
                             "e.g. a --threads 2 run after the main one")
    parser.add_argument("--hybrid-shapes", default=",".join(hybrid.DEFAULT_SHAPES),
                        help=f"comma list of the hybrid part's shapes: {', '.join(hybrid.SHAPE_KEYS)} "
                             f"(default: {','.join(hybrid.DEFAULT_SHAPES)})")
    parser.add_argument("--hybrid-steps", type=count(1), default=DECODE_STEPS,
                        help="timed greedy steps of each hybrid decode row")
    parser.add_argument("--llama-convert", default=os.environ.get(CONVERT_ENV), metavar="CONVERT_HF_TO_GGUF",
                        help="llama.cpp's convert_hf_to_gguf.py: with llama-cpp-python installed, the prefill "
                             f"and decode parts get llama.cpp rows (default: ${CONVERT_ENV})")
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.only.split(",") if p.strip())
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    shape_keys = [k.strip() for k in args.hybrid_shapes.split(",") if k.strip()]
    for bad in [p for p in parts if p not in PARTS] + [b for b in wanted if b not in BACKENDS]:
        parser.error(f"unknown part or backend {bad!r}: parts {PARTS}, backends {BACKENDS}")
    for bad in [k for k in shape_keys if k not in hybrid.SHAPE_KEYS]:
        parser.error(f"--hybrid-shapes: unknown shape {bad!r}: {', '.join(hybrid.SHAPE_KEYS)}")
    out = output_dir(args.out, quick=args.quick, overwrite=args.overwrite)
    notes = [f"command: portable-ssm bench {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()]
    notes += _set_threads(args.threads)
    notes.append("host memory: freed memory kept in the process for reuse (portable_ssm.retain_freed_memory, "
                 "glibc mallopt) for every row, transformers' included, and the fresh peak processes; "
                 "PORTABLE_SSM_RETAIN_MEMORY=0 runs with glibc's default" if retain_unless_disabled() else
                 "host memory: the C library's default (freed blocks go back to the kernel)")
    import importlib.util

    backends = [b for b in wanted if importlib.util.find_spec(b.split("-")[0]) is not None]
    if importlib.util.find_spec("torch") is None:  # transformers' Mamba2 runs on torch
        backends = [b for b in backends if b != "transformers"]
    notes += [f"skipped (not installed): {b}" for b in wanted if b not in backends]
    notes += [f"load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}",
              "forward and training rows of one shape run side by side, every length and backend: one "
              "warm-up call each, then rounds that take a sample of each of them and of a numpy "
              f"[{SGEMM_N}, {SGEMM_N}] float32 sgemm in turn (a sample: the mean of back-to-back calls "
              "lasting about 1 s, or one slower call); medians of the samples; % sgemm is against the "
              "sgemm timed in the same rounds, so ratios across backends and lengths share the machine's load",
              f"every sample, decode turn and streaming read follows {SETTLE_S:g} s idle"
              + (" (not in --quick runs)" if args.quick else "") + ", so no row pays for the worker threads the "
              "row before it left spinning (after a NumPy matmul, OpenBLAS's halve a torch matmul's rate for "
              "about that long)",
              "jax rows time `jax.jit(forward)`; their first ms includes the compile",
              f"decode: {PROMPT}-token prompt, then {DECODE_STEPS} greedy steps timed one by one, the rows "
              f"side by side: rounds in which each row (llama.cpp's included) takes {ROUND_STEPS} steps in turn "
              "(portable_ssm.stream, the tokens as they reach the host; transformers apart, before them: "
              "generate(use_cache=True)); numpy-int8 etc.: the same weights through portable_ssm.quantize",
              "decode GB/s: the weights one step reads / its median time; % bandwidth: against a streaming "
              "read of 1 GiB (numpy.max over as many Python threads as --threads) timed once in each round",
              "prefill: b=1, a prompt of random token ids to the last position's logits, timed side by side "
              "in rounds like the forward rows (no sgemm) (portable_ssm.lm.prefill, the pass generate runs; "
              "jax: jax.jit of it; transformers: Mamba2ForCausalLM(ids, logits_to_keep=1, use_cache=False))"]
    clock = CLOCKS[args.clock]
    if args.clock == "cpu":
        notes.append("--clock cpu: times are this process's CPU seconds (time.process_time), not wall time")
    rows: list[Row] = []
    graded: list[QualityRow] = []
    hybrid_rows: list[HybridRow] = []
    fresh = not args.quick if args.fresh_peak is None else args.fresh_peak
    if fresh:
        notes.append("peak MiB from fresh processes (python -m portable_ssm.bench.peak, one per row and call)")
    with contextlib.ExitStack() as stack:
        llama = _llama(args, parts, notes, stack)
        for group in _progress(groups(cases(parts, args.quick, args.max_len))):
            rows += run_group(group, backends, args.repeats, clock, sgemm_n=1024 if args.quick else SGEMM_N,
                              sample_s=0.05 if args.quick else 1.0, llama=llama,
                              threads=thread_count(args.threads),
                              bandwidth_gib=1 / 16 if args.quick else 1.0, settle_s=0.0 if args.quick else SETTLE_S)
        if "quality" in parts:
            graded = quality(backends, llama, QUICK_TRAIN_STEPS if args.quick else TRAIN_STEPS, notes)
        if "hybrid" in parts:
            hybrid_rows = hybrid.part(shape_keys, llama, args.llama_convert, backends, quick=args.quick,
                                      max_len=args.max_len, steps=args.hybrid_steps, repeats=args.repeats, clock=clock,
                                      sample_s=0.05 if args.quick else 1.0,
                                      settle_s=0.0 if args.quick else SETTLE_S, notes=notes)
    for row in _progress([r for r in rows if r.backend in BACKENDS]) if fresh else []:  # not llama.cpp's
        row.fresh = fresh_peak_mib(row.case, row.backend)
    notes.append(f"load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"wrote {write_results(rows, out, notes, append=args.append, quality=graded, hybrid=hybrid_rows)}")
    return 0
