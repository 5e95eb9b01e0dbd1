"""Batch-1 greedy decode of a granite-4.0-h-350m-shaped random hybrid model beside the pure
Mamba-2 130m-shaped model, on NumPy with 2 threads (issue 44's benchmark row).

    .venv/bin/python benchmarks/hybrid_decode.py [--steps 64] [--threads 2]

Prints one Markdown table: milliseconds per token (median over the steps) and tokens/s. The
granite shape (32 layers, 4 attention, d 768, 12 heads / 4 KV heads, Mamba 48 heads x 32, state
128, shared SwiGLU MLP 2048, vocab 100352, nope, tied) is taken from the public config as the
author recalls it; the weights are random, so only the speed means anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _granite_350m():
    from portable_ssm.blocks import AttentionSpec, MLPSpec
    from portable_ssm.config import Mamba2Config
    from portable_ssm.stack import HybridConfig

    attention_at = {9, 17, 25, 31}
    layers = tuple(("attention" if i in attention_at else "mamba", "mlp") for i in range(32))
    return HybridConfig(d_model=768, vocab_size=100352, layers=layers,
                        mamba=Mamba2Config(d_model=1536, expand=1, n_layer=1, d_state=128, headdim=32, ngroups=1,
                                           vocab_size=None),
                        attention=AttentionSpec(12, 4, 64, 0.015625), mlp=MLPSpec("silu", True), d_ff=2048,
                        tie_embeddings=True, family="granitemoehybrid")


def _median_ms(step, token, state, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits, state = step(token, state)
        token = logits.argmax(axis=-1)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.update(OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    import numpy as np

    import portable_ssm
    from portable_ssm.bench.hybrid_models import random_params
    from portable_ssm.hybrid_lm import HybridLM
    from portable_ssm.lm import decode, prefill

    prompt = np.arange(1, 17, dtype=np.int64)[None, :]  # [1, 16]
    config = _granite_350m()
    hybrid = HybridLM(random_params(config), config)
    _, state = hybrid.prefill(prompt, max_len=16 + args.steps)
    granite = _median_ms(hybrid.step, np.array([1]), state, args.steps)

    m2 = portable_ssm.Mamba2Config(d_model=768, n_layer=24, vocab_size=50280, d_state=128, headdim=64)
    params = portable_ssm.init_params(m2)
    xp = portable_ssm.backends.load("numpy").namespace()
    _, state = prefill(prompt, None, None, params, config=m2, xp=xp)
    mamba = _median_ms(lambda t, s: decode(t, s, params, config=m2, xp=xp), np.array([1]), state, args.steps)

    print(f"| model (random weights, numpy, batch 1, {args.threads} threads) | ms/token | tokens/s |")
    print("|---|---|---|")
    for name, ms in (("granite-4.0-h-350m shape (HybridLM.step)", granite), ("mamba2-130m shape (lm.decode)", mamba)):
        print(f"| {name} | {ms:.2f} | {1e3 / ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
