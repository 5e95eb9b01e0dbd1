"""Batch-1 greedy decode of the granite-4.0-h-350m-shaped random hybrid model on PyTorch (CPU),
with the torch backend's fused step (``backends/torch_hybrid.py``: NumPy's compiled hybrid step on
zero-copy views) and without it (the array-API step per layer), in one process.

    .venv/bin/python benchmarks/torch_hybrid_decode_ab.py [--steps 16] [--rounds 3] [--threads 1] [--kind float32]

Prints one Markdown table: milliseconds per token (median over the steps, then over the rounds, in
which the two arms alternate) and tokens/s. The model's shape is :mod:`hybrid_decode`'s; the
weights are random, so only the speed means anything. On a machine shared with other busy
processes keep ``--threads 1``: the fused step's threads meet at barriers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kind", choices=("float32", "int8", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    os.environ.update(OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
                      PORTABLE_SSM_NUM_THREADS=str(args.threads))
    import torch
    from hybrid_decode import _granite_350m, _median_ms
    from portable_ssm.backends import torch as torch_backend

    from portable_ssm.bench.hybrid_models import random_params
    from portable_ssm.hybrid_lm import HybridLM

    torch.set_num_threads(args.threads)
    config = _granite_350m()
    lm = HybridLM({k: torch.from_numpy(v) for k, v in random_params(config).items()}, config).quantize(args.kind)
    prompt = torch.arange(1, 17)[None, :]  # [1, 16]
    fused = torch_backend.FAST_OPS["decode_hybrid"]
    arms = {"fused (NumPy's compiled step on views)": fused, "array-API step per layer": None}
    times: dict[str, list[float]] = {name: [] for name in arms}
    with torch.inference_mode():
        for _ in range(args.rounds):  # the arms alternate, so a busy spell of the machine hits both
            for name, op in arms.items():
                if op is None:
                    del torch_backend.FAST_OPS["decode_hybrid"]
                _, state = lm.prefill(prompt, max_len=16 + 2 * args.steps)
                lm.step(torch.tensor([1]), state)  # the plan and the first step's cache copy
                times[name].append(_median_ms(lm.step, torch.tensor([1]), state, args.steps))
                torch_backend.FAST_OPS["decode_hybrid"] = fused
    rows = [(name, statistics.median(ms)) for name, ms in times.items()]
    print(f"| granite-4.0-h-350m shape, torch CPU, {args.kind}, batch 1, {args.threads} threads | ms/token | "
          "tokens/s |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {1e3 / ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
