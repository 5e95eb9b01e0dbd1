"""Side by side in one process: NumPy's whole-model batch-1 decode step (``decode_model``, one call
of the compiled library a token, :mod:`portable_ssm.backends.numpy.decode`), NumPy's per-layer step
(the hook removed between turns) and torch's whole-model step (the same C++), on a
mamba2-130m-shaped random LM, for float32, int8 and bfloat16 weights.

Rounds alternate the paths (4 steps each in turn), so all share the machine's load; it prints
medians in ms a step. Tooling, not a test: nothing is asserted.

    python benchmarks/numpy_decode_model.py --threads 2 --rounds 10
    python benchmarks/numpy_decode_model.py --threads 1 --no-torch --isa-ab   # the avx512 build beside
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
    parser.add_argument("--threads", type=int, default=2, help="threads of both backends")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 4 steps of each path")
    parser.add_argument("--kinds", default="float32,int8,bfloat16", help="comma list of weight kinds")
    parser.add_argument("--isa-ab", action="store_true",
                        help="also NumPy's whole-model step of the avx512 build (PORTABLE_SSM_CPU_ISA=avx512)")
    parser.add_argument("--no-torch", action="store_true",
                        help="NumPy's two paths only, torch not imported (its OpenMP runtime not loaded)")
    args = parser.parse_args()
    os.environ["PORTABLE_SSM_NUM_THREADS"] = str(args.threads)  # NumPy's pool and the library's team

    from portable_ssm.backends import numpy as numpy_backend

    import portable_ssm as ps

    torch = None
    if not args.no_torch:
        import torch
        from portable_ssm.backends import torch as torch_backend

        torch.set_num_threads(args.threads)
    config = ps.Mamba2Config(d_model=768, n_layer=24, d_state=128, headdim=64, expand=2, vocab_size=50288)
    base = ps.init_params(config, seed=0, backend="numpy", dtype="float32")
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (1, 8))

    @contextlib.contextmanager
    def per_layer() -> Iterator[None]:
        hook = numpy_backend.FAST_OPS.pop("decode_model")
        try:
            yield
        finally:
            numpy_backend.FAST_OPS["decode_model"] = hook

    versions = f"numpy {np.__version__}, torch {'-' if torch is None else torch.__version__}"
    @contextlib.contextmanager
    def avx512() -> Iterator[None]:
        os.environ["PORTABLE_SSM_CPU_ISA"] = "avx512"
        try:
            yield
        finally:
            del os.environ["PORTABLE_SSM_CPU_ISA"]

    print(f"{versions}, {args.threads} threads, {args.rounds} rounds of 4 steps each, ms a step")
    for kind in args.kinds.split(","):
        params = {"numpy": ps.quantize(base, kind)}
        paths = {"numpy whole model": ("numpy", contextlib.nullcontext), "numpy per layer": ("numpy", per_layer)}
        if args.isa_ab:
            paths["numpy whole model avx512"] = ("numpy", avx512)
        states, tokens = {}, {"numpy": ids[:, -1]}
        if torch is not None:
            params["torch"] = ps.quantize({k: torch.from_numpy(v) for k, v in base.items()}, kind)
            paths["torch whole model"] = ("torch", contextlib.nullcontext)
            tokens["torch"] = torch.from_numpy(ids[:, -1])
        times: dict[str, list[float]] = {path: [] for path in paths}
        with contextlib.nullcontext() if torch is None else torch.inference_mode():
            for name in tokens:
                prompt = ids if name == "numpy" else torch.from_numpy(ids)
                _, states[name] = ps.lm.logits(prompt, params[name], config=config, return_state=True)
            state = {path: states[backend] for path, (backend, _) in paths.items()}
            for _ in range(args.rounds):
                for path, (backend, context) in paths.items():
                    xp = (numpy_backend if backend == "numpy" else torch_backend).xp
                    with context():
                        for _ in range(4):
                            start = time.perf_counter()
                            _, state[path] = ps.lm.decode(tokens[backend], state[path], params[backend],
                                                          config=config, xp=xp)
                            times[path].append(time.perf_counter() - start)
        medians = "  ".join(f"{path} {1e3 * statistics.median(t[4:]):6.2f}" for path, t in times.items())
        print(f"{kind:>9}: {medians}")  # the first round warms up


if __name__ == "__main__":
    main()
