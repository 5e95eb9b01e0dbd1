"""Where the NumPy backend's forward of one mamba2-130m-shaped layer spends its time: the forward
as ``benchmarks/run.py``'s forward rows call it, each of NumPy's native ops (the projections, the
conv with SiLU, the norms, the scan: ``portable_ssm.backends.numpy.FAST_OPS``) timed on every call
and summed per forward, beside the ``[4096, 4096]`` float32 sgemm the benchmark measures its share
against, each after the runner's idle ``SETTLE_S``, as there (without it the forward shared the
cores with OpenBLAS's threads, still spinning from the sgemm before it, and took about 1.2x as
long). It prints the medians over the rounds and the forward's % of that sgemm (the model FLOPs
of ``portable_ssm.bench.report.forward_flops``). Tooling, not a test: nothing is asserted.

    python benchmarks/numpy_profile.py --threads 2 --length 8192 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="NumPy's pool and its BLAS")
    parser.add_argument("--length", type=int, default=8192, help="sequence length (batch 1)")
    parser.add_argument("--rounds", type=int, default=5, help="forwards (and sgemms) timed")
    args = parser.parse_args()
    for name in ("PORTABLE_SSM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(args.threads)  # before NumPy and the pool read them

    import numpy as np
    from portable_ssm.backends.numpy import FAST_OPS

    import portable_ssm as ps
    from portable_ssm.bench.calls import forward_fn, sgemm_call
    from portable_ssm.bench.report import forward_flops
    from portable_ssm.bench.runner import LAYER_130M, SETTLE_S, SGEMM_N
    from portable_ssm.host import retain_unless_disabled

    retain_unless_disabled()
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return op(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    for name, op in list(FAST_OPS.items()):
        FAST_OPS[name] = timed(name, op)
    params = ps.init_params(LAYER_130M, seed=0, backend="numpy", dtype="float32")
    x = np.random.default_rng(0).standard_normal((1, args.length, LAYER_130M.d_model)).astype(np.float32)
    forward, sgemm = forward_fn("numpy", LAYER_130M, params, x, train=False), sgemm_call(SGEMM_N)
    forward(), sgemm()  # warm-up
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        spent.clear()
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        forward()
        samples["forward"].append(time.perf_counter() - start)
        for name, seconds in spent.items():
            samples[name].append(seconds)
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        sgemm()
        samples["sgemm"].append(time.perf_counter() - start)
    median = {name: statistics.median(v) for name, v in samples.items()}
    rate = 2 * SGEMM_N**3 / median["sgemm"] / 1e9
    flops = forward_flops(LAYER_130M, 1, args.length)
    print(f"numpy {np.__version__}, {args.threads} threads, 130m layer, l={args.length}, {args.rounds} rounds")
    for name, seconds in sorted(median.items(), key=lambda item: -item[1]):
        if name != "sgemm":
            print(f"  {name:20s} {1e3 * seconds:8.1f} ms")
    print(f"sgemm {rate:.1f} GFLOP/s; forward {flops / median['forward'] / 1e9:.1f} GFLOP/s, "
          f"{100 * flops / median['forward'] / 1e9 / rate:.1f}% of it; 65% needs the forward in "
          f"{1e3 * flops / (0.65 * rate * 1e9):.0f} ms")


if __name__ == "__main__":
    main()
