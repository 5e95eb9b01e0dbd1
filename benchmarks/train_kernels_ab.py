"""Side by side in one process: a training step (forward + backward of ``mean(y²)``) of one
mamba2-130m-shaped layer on the torch backend with its CPU kernels (:mod:`portable_ssm.backends.
torch_kernels`: the conv, the gated norm and the scan backward's diagonal blocks) and without them
(``PORTABLE_SSM_CPU_KERNELS=0`` between turns), as ``benchmarks/run.py``'s training rows call it;
``--only-norm``: without the norm kernel alone (torch's ops take the norms, the other kernels
stay); ``--forward``: the inference forward instead of the training step.

Rounds alternate the two (2 steps each in turn), so both share the machine's load; it prints
medians and their ratio. Tooling, not a test: nothing is asserted.

    python benchmarks/train_kernels_ab.py --threads 2 --length 2048 --rounds 10
    python benchmarks/train_kernels_ab.py --threads 2 --length 2048 --rounds 10 --only-norm
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--length", type=int, default=2048, help="sequence length (batch 1)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 2 steps of each")
    parser.add_argument("--only-norm", action="store_true", help="turn off the gated norm's kernel alone")
    parser.add_argument("--forward", action="store_true", help="time the inference forward, not a training step")
    args = parser.parse_args()

    import torch
    from portable_ssm.backends import torch as backend
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
    step = forward_fn("torch", LAYER_130M, params, x, train=not args.forward)

    @contextlib.contextmanager
    def without_kernels() -> Iterator[None]:
        """All the kernels off (the environment variable), or with --only-norm the norm's alone."""
        if args.only_norm:
            taken = backend._takes_norm_kernel
            backend._takes_norm_kernel = lambda *tensors: False
            try:
                yield
            finally:
                backend._takes_norm_kernel = taken
            return
        before = os.environ.get(torch_kernels.ENV)
        os.environ[torch_kernels.ENV] = "0"
        try:
            yield
        finally:  # the variable as it was
            if before is None:
                os.environ.pop(torch_kernels.ENV, None)
            else:
                os.environ[torch_kernels.ENV] = before

    other = "without the norm's" if args.only_norm else "torch ops"
    paths = {"kernels": contextlib.nullcontext, other: without_kernels}
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(args.rounds + 1):  # the first round warms up
        for path, context in paths.items():
            with context():
                for _ in range(2):
                    start = time.perf_counter()
                    step()
                    times[path].append(time.perf_counter() - start)
    fast, slow = (1e3 * statistics.median(times[path][2:]) for path in paths)
    print(f"torch {torch.__version__}, {args.threads} threads, l={args.length}, {args.rounds} rounds of 2 steps each")
    print(f"{'forward' if args.forward else 'training step'}: kernels {fast:.1f} ms  {other} {slow:.1f} ms  "
          f"ratio {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
