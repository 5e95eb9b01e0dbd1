"""Side by side in one process: a training step (forward + backward of ``mean(y²)``) of one
mamba2-130m-shaped layer on the torch backend with its CPU kernels (:mod:`portable_ssm.backends.
torch_kernels`: the conv, the gated norm, the scan and its backward) and without them
(``PORTABLE_SSM_CPU_KERNELS=0`` between turns), as ``benchmarks/run.py``'s training rows call it;
``--only-norm``: without the norm kernel alone (torch's ops take the norms, the other kernels
stay); ``--only-scan-op``: without the ``portable_ssm::ssd_scan`` op alone (autograd of the reference
scan takes the scan); ``--only-scan-backward``: without the scan backward's kernel alone (the op's
backward in torch ops, ``portable_ssm.backends.torch_scan``); ``--forward``: the inference forward
instead of the training step;
``--config seed --batch 8 --length 60``: the benchmark's seed shape instead of the 130m layer.

Rounds alternate the two (2 steps each in turn), so both share the machine's load; it prints
medians and their ratio. Tooling, not a test: nothing is asserted.

    python benchmarks/train_kernels_ab.py --threads 2 --length 2048 --rounds 10
    python benchmarks/train_kernels_ab.py --threads 2 --length 2048 --rounds 10 --only-norm
    python benchmarks/train_kernels_ab.py --threads 2 --length 512 --rounds 10 --only-scan-op
    python benchmarks/train_kernels_ab.py --threads 2 --length 2048 --rounds 10 --only-scan-backward
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
    parser.add_argument("--batch", type=int, default=1, help="rows")
    parser.add_argument("--config", choices=("130m-layer", "seed"), default="130m-layer",
                        help="the model: a mamba2-130m layer or the benchmark's seed shape (d_model 256, 2 layers)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only-norm", action="store_true", help="turn off the gated norm's kernel alone")
    which.add_argument("--only-scan-op", action="store_true",
                       help="turn off the scan op alone (autograd of the reference scan)")
    which.add_argument("--only-scan-backward", action="store_true",
                       help="turn off the scan backward's kernel alone (the op's backward in torch ops)")
    parser.add_argument("--forward", action="store_true", help="time the inference forward, not a training step")
    args = parser.parse_args()

    import torch
    from portable_ssm.backends import torch as backend
    from portable_ssm.backends import torch_kernels, torch_scan

    import portable_ssm as ps
    from portable_ssm.bench.calls import forward_fn
    from portable_ssm.bench.runner import LAYER_130M, SEED
    from portable_ssm.host import retain_unless_disabled

    retain_unless_disabled()
    torch.set_num_threads(args.threads)
    if not torch_kernels.ensure():
        raise SystemExit("the CPU kernels are not built here (see the warning): nothing to compare")
    config = SEED if args.config == "seed" else LAYER_130M
    params = ps.init_params(config, seed=0, backend="numpy", dtype="float32")
    x = np.random.default_rng(0).standard_normal((args.batch, args.length, config.d_model)).astype(np.float32)
    step = forward_fn("torch", config, params, x, train=not args.forward)

    @contextlib.contextmanager
    def without_kernels() -> Iterator[None]:
        """All the kernels off (the environment variable), or with --only-norm (--only-scan-op,
        --only-scan-backward) the norm's kernel (the scan op, the scan backward's kernel) alone."""
        if args.only_norm or args.only_scan_op or args.only_scan_backward:
            module, name = ((backend, "_takes_norm_kernel") if args.only_norm else (backend, "_scan_op_takes")
                            if args.only_scan_op else (torch_scan, "_kernel_takes"))
            taken = getattr(module, name)
            setattr(module, name, lambda *tensors: False)
            try:
                yield
            finally:
                setattr(module, name, taken)
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

    other = ("without the norm's" if args.only_norm else "without the scan op" if args.only_scan_op
             else "backward in torch ops" if args.only_scan_backward else "torch ops")
    first = "with the scan op" if args.only_scan_op else "kernels"
    paths = {first: contextlib.nullcontext, other: without_kernels}
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(args.rounds + 1):  # the first round warms up
        for path, context in paths.items():
            with context():
                for _ in range(2):
                    start = time.perf_counter()
                    step()
                    times[path].append(time.perf_counter() - start)
    fast, slow = (1e3 * statistics.median(times[path][2:]) for path in paths)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.config} b={args.batch} l={args.length}, "
          f"{args.rounds} rounds of 2 steps each")
    print(f"{'forward' if args.forward else 'training step'}: {first} {fast:.1f} ms  {other} {slow:.1f} ms  "
          f"ratio {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
