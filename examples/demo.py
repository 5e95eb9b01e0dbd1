"""The one-liner demo: Mamba-2 on NumPy (and on whichever other backends are installed).

    python examples/demo.py            # numpy only
    python examples/demo.py --all      # also torch / jax / cupy / array_api_strict when installed

Prints each backend's output shape, dtype and timing for ``portable_ssm.forward(x, backend=...)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np

import portable_ssm


def run(backend: str, x: np.ndarray, repeats: int) -> None:
    y = portable_ssm.forward(x, backend=backend)  # first call builds and converts the default model
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        y = portable_ssm.forward(x, backend=backend)
        if hasattr(y, "block_until_ready"):
            y.block_until_ready()
        times.append(time.perf_counter() - start)
    print(f"{backend:>16}: x {tuple(x.shape)} -> y {tuple(y.shape)} {portable_ssm.to_backend(y, 'numpy').dtype}, "
          f"median {1e3 * float(np.median(times)):.1f} ms over {repeats} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=60)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--all", action="store_true", help="also every other installed backend")
    args = parser.parse_args()

    x = np.random.default_rng(0).standard_normal((args.batch, args.length, args.d_model)).astype(np.float32)
    config = portable_ssm.default_config(args.d_model)
    print(f"portable_ssm {portable_ssm.__version__}: default model {config.n_layer} layers, d_model "
          f"{config.d_model}, d_state {config.d_state}, {config.nheads} heads of {config.headdim}")
    backends = ["numpy"]
    if args.all:
        backends += [b for b in ("torch", "jax", "array_api_strict", "cupy") if importlib.util.find_spec(b)]
    for backend in backends:
        run(backend, x, args.repeats)


if __name__ == "__main__":
    main()
