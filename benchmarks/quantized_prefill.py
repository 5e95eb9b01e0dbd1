"""Side by side in one process: many-row products and whole-model prefill with float32, int8 and
bfloat16 weights, on NumPy and torch (CPU), for a mamba2-130m-shaped random LM.

* ``matmul``: ``x [T, 768]`` times in_proj ``[3352, 768]`` and out_proj ``[768, 1536]`` transposed
  (float32: the backend's ``linear`` path; else ``quantized_matmul``).
* ``prefill``: :func:`portable_ssm.lm.prefill` over a ``T``-token prompt (what generation runs).

Rounds alternate the weight kinds (one call each in turn), so all share the machine's load; it
prints medians in ms and each kind's ratio to float32. Tooling, not a test: nothing is asserted.

    python benchmarks/quantized_prefill.py --threads 2 --rounds 7
    python benchmarks/quantized_prefill.py --parts prefill --layers 4 --tokens 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("float32", "int8", "bfloat16")
PROJECTIONS = {"in_proj": (3352, 768), "out_proj": (768, 1536)}  # a 130m layer's [out, in]


def alternate(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median ms of each call over ``rounds`` rounds (one call of each in turn), after a warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _print(label: str, medians: dict[str, float]) -> None:
    base = medians["float32"]
    print(f"{label:<28}" + "  ".join(f"{k} {v:8.1f} ms ({v / base:.2f}x)" for k, v in medians.items()), flush=True)


def _matmuls(backend: str, tokens: int) -> dict[str, dict[str, Callable[[], Any]]]:
    from portable_ssm.backends import fast_op, load, to_backend

    import portable_ssm as ps
    from portable_ssm.quantized import quantized_matmul

    xp = load(backend).namespace()
    linear = fast_op(xp, "linear")
    rng = np.random.default_rng(0)
    out = {}
    for name, (rows, cols) in PROJECTIONS.items():
        w = to_backend(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, backend)
        x = to_backend(rng.standard_normal((tokens, cols), dtype=np.float32), backend)
        fns: dict[str, Callable[[], Any]] = {
            "float32": (lambda x=x, w=w: linear(x, w)) if linear else (lambda x=x, w=w: xp.matmul(x, w.T))}
        for kind in KINDS[1:]:
            q = ps.quantize({"w": w}, kind, names=("w",))["w"]
            fns[kind] = lambda x=x, q=q: quantized_matmul(x, q, xp=xp)
        out[name] = fns
    return out


def _prefills(backend: str, layers: int, tokens: int) -> dict[str, Callable[[], Any]]:
    import portable_ssm as ps
    from portable_ssm.bench.calls import prefill_fn

    config = ps.Mamba2Config(d_model=768, n_layer=layers, d_state=128, headdim=64, expand=2, vocab_size=50288)
    base = ps.init_params(config, seed=0, backend="numpy", dtype="float32")
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (1, tokens))
    fns = {}
    for kind in KINDS:
        from portable_ssm.backends import to_backend

        params = ps.quantize({k: to_backend(v, backend) for k, v in base.items()}, kind)
        fns[kind] = prefill_fn(backend, config, params, ids)
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads of both backends")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls of each kind, in turn")
    parser.add_argument("--tokens", type=int, default=2048, help="rows T of the products / prompt length")
    parser.add_argument("--layers", type=int, default=24, help="layers of the prefill's model (130m: 24)")
    parser.add_argument("--backends", default="numpy,torch", help="comma list of numpy, torch")
    parser.add_argument("--parts", default="matmul,prefill", help="comma list of matmul, prefill")
    args = parser.parse_args()
    os.environ["PORTABLE_SSM_NUM_THREADS"] = str(args.threads)  # NumPy's pool and the C++ team
    backends = args.backends.split(",")
    if "torch" in backends:
        import torch

        torch.set_num_threads(args.threads)
        torch.set_grad_enabled(False)
    print(f"{args.threads} threads, T={args.tokens}, {args.rounds} rounds, medians", flush=True)
    for backend in backends:
        if "matmul" in args.parts:
            for name, fns in _matmuls(backend, args.tokens).items():
                _print(f"{backend} {name}", alternate(fns, args.rounds))
        if "prefill" in args.parts:
            _print(f"{backend} prefill {args.layers}L", alternate(_prefills(backend, args.layers, args.tokens),
                                                                  args.rounds))


if __name__ == "__main__":
    main()
