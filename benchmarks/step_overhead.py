"""The Python around a batch-1 decode step's compiled call: per token, the step's whole time, the
compiled call's (``portable_ssm_decode_model`` or ``portable_ssm_decode_hybrid`` of NumPy's kernel
library) and the rest, on NumPy, for the granite-4.0-h-350m-shaped hybrid (``HybridLM.step``) and
the mamba2-130m-shaped LM (``portable_ssm.stream``), random weights.

    .venv/bin/python benchmarks/step_overhead.py [--kind int8] [--steps 200] [--threads 2] [--models granite,130m]

Prints one Markdown table, medians over the steps in microseconds. The step's threads wait while
that Python runs, with the caches the call before flushed, so "outside" counts against every
token; it is what a decode loop's Python costs, not what the same lines cost warm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any


def _timing(library: Any, name: str) -> list[float]:
    """The library's ``name`` wrapped to append each call's seconds to the returned list."""
    real, spans = getattr(library, name), []

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        out = real(*args)
        spans.append(time.perf_counter() - start)
        return out

    setattr(library, name, timed)
    return spans


def _granite(kind: str, steps: int) -> tuple[Iterator[Any], str]:
    import numpy as np
    from hybrid_decode import _granite_350m

    from portable_ssm.bench.hybrid_models import random_params
    from portable_ssm.hybrid_lm import HybridLM

    config = _granite_350m()
    model = HybridLM(random_params(config), config)
    model = model if kind == "float32" else model.quantize(kind)
    _, state = model.prefill(np.arange(1, 65)[None, :], max_len=64 + steps + 1)

    def tokens() -> Iterator[Any]:
        token, s = np.array([1]), state
        while True:
            logits, s = model.step(token, s)
            token = logits.argmax(axis=-1)
            yield token

    return tokens(), "portable_ssm_decode_hybrid"


def _mamba2_130m(kind: str, steps: int) -> tuple[Iterator[Any], str]:
    import numpy as np

    import portable_ssm
    from portable_ssm.generation import stream

    config = portable_ssm.Mamba2Config(d_model=768, n_layer=24, vocab_size=50280, d_state=128, headdim=64)
    params = portable_ssm.init_params(config)
    params = params if kind == "float32" else portable_ssm.quantize(params, kind)
    ids = np.arange(1, 9, dtype=np.int64)[None, :]
    return stream(ids, params, config=config, max_new_tokens=steps + 2), "portable_ssm_decode_model"


MODELS: dict[str, tuple[str, Callable[[str, int], tuple[Iterator[Any], str]]]] = {
    "granite": ("granite-4.0-h-350m shape, HybridLM.step", _granite),
    "130m": ("mamba2-130m shape, stream", _mamba2_130m),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("float32", "int8", "bfloat16"), default="int8")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="granite,130m", help="comma-separated: " + ", ".join(MODELS))
    args = parser.parse_args(argv)
    os.environ.update(OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
                      PORTABLE_SSM_NUM_THREADS=str(args.threads))
    from portable_ssm.backends.numpy import kernels

    import portable_ssm

    portable_ssm.retain_freed_memory()
    library = kernels.library()
    if library is None:
        print("NumPy's compiled kernels are not usable here: no compiled step to time", file=sys.stderr)
        return 1
    print(f"| model ({args.kind} weights, numpy, batch 1, {args.threads} threads) | step µs | compiled call µs | "
          "outside µs |")
    print("|---|---|---|---|")
    for key in args.models.split(","):
        label, build = MODELS[key]
        tokens, name = build(args.kind, args.steps)
        calls = _timing(library, name)
        next(tokens)  # the first step: the plan and, for the hybrid, the prompt's KV caches copied
        steps, calls[:] = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            next(tokens)
            steps.append(time.perf_counter() - start)
        outside = [s - c for s, c in zip(steps, calls)]
        print(f"| {label} | {1e6 * statistics.median(steps):.0f} | {1e6 * statistics.median(calls):.0f} | "
              f"{1e6 * statistics.median(outside):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
