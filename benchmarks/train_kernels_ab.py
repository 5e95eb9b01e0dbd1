"""Side by side in one process: a training step (forward + backward of ``mean(y²)``) of one
mamba2-130m-shaped layer on the torch backend with its CPU kernels (:mod:`portable_ssm.backends.
torch_kernels`: the training conv and the scan backward's diagonal blocks) and without them
(``PORTABLE_SSM_CPU_KERNELS=0`` between turns), as ``benchmarks/run.py``'s training rows call it.

Rounds alternate the two (2 steps each in turn), so both share the machine's load; it prints
medians and their ratio. Tooling, not a test: nothing is asserted.

    python benchmarks/train_kernels_ab.py --threads 2 --length 2048 --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--length", type=int, default=2048, help="sequence length (batch 1)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 2 steps of each")
    args = parser.parse_args()

    import torch
    from portable_ssm.backends import torch_kernels

    import portable_ssm as ps
    from portable_ssm.bench.calls import forward_fn
    from portable_ssm.bench.runner import LAYER_130M
    from portable_ssm.host import retain_unless_disabled

    retain_unless_disabled()
    torch.set_num_threads(args.threads)
    if not torch_kernels.ensure():
        raise SystemExit("the CPU kernels are not built here (see the warning): nothing to compare")
    params = ps.init_params(LAYER_130M, seed=0, backend="numpy", dtype="float32")
    x = np.random.default_rng(0).standard_normal((1, args.length, LAYER_130M.d_model)).astype(np.float32)
    step = forward_fn("torch", LAYER_130M, params, x, train=True)
    switch = {"kernels": "1", "torch ops": "0"}
    times: dict[str, list[float]] = {path: [] for path in switch}
    before = os.environ.get(torch_kernels.ENV)
    try:
        for _ in range(args.rounds + 1):  # the first round warms up
            for path, value in switch.items():
                os.environ[torch_kernels.ENV] = value
                for _ in range(2):
                    start = time.perf_counter()
                    step()
                    times[path].append(time.perf_counter() - start)
    finally:  # the variable as it was
        if before is None:
            os.environ.pop(torch_kernels.ENV, None)
        else:
            os.environ[torch_kernels.ENV] = before
    fast, slow = (1e3 * statistics.median(times[path][2:]) for path in switch)
    print(f"torch {torch.__version__}, {args.threads} threads, l={args.length}, {args.rounds} rounds of 2 steps each")
    print(f"training step: kernels {fast:.1f} ms  torch ops {slow:.1f} ms  ratio {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
