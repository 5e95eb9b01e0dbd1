"""Side by side in one process: torch's whole-model batch-1 decode step (``decode_model``, one
C++ call a token) against the per-layer eager step it replaces (the hook removed between turns),
on a mamba2-130m-shaped random LM, for float32, int8 and bfloat16 weights.

Rounds alternate the two (4 steps each in turn, as ``benchmarks/run.py`` does), so both share the
machine's load; it prints medians and their ratio. Tooling, not a test: nothing is asserted.

    python benchmarks/decode_model_ab.py --threads 2 --rounds 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 4 steps of each path")
    parser.add_argument("--kinds", default="float32,int8,bfloat16", help="comma list of weight kinds")
    args = parser.parse_args()

    import torch
    from portable_ssm.backends import torch as backend
    from portable_ssm.backends import torch_kernels

    import portable_ssm as ps
    from portable_ssm.host import retain_unless_disabled

    retain_unless_disabled()
    torch.set_num_threads(args.threads)
    if not torch_kernels.ensure():
        raise SystemExit("the CPU kernels are not built here (see the warning): nothing to compare")
    config = ps.Mamba2Config(d_model=768, n_layer=24, d_state=128, headdim=64, expand=2, vocab_size=50288)
    base = ps.init_params(config, seed=0, backend="torch", dtype="float32")
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, config.vocab_size, (1, 8)))
    hook = backend.FAST_OPS["decode_model"]
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds of 4 steps each, ms a step")
    for kind in args.kinds.split(","):
        params = ps.quantize(base, kind)
        times: dict[str, list[float]] = {"whole model": [], "per layer": []}
        with torch.inference_mode():
            _, prefilled = ps.lm.logits(ids, params, config=config, return_state=True)
            states = dict.fromkeys(times, prefilled)
            for _ in range(args.rounds):
                for path in times:
                    if path == "per layer":
                        del backend.FAST_OPS["decode_model"]
                    try:
                        for _ in range(4):
                            start = time.perf_counter()
                            _, states[path] = ps.lm.decode(ids[:, -1], states[path], params, config=config,
                                                           xp=backend.xp)
                            times[path].append(time.perf_counter() - start)
                    finally:
                        backend.FAST_OPS["decode_model"] = hook
        whole, layers = (1e3 * statistics.median(times[path][4:]) for path in times)  # the first round warms up
        print(f"{kind:>9}: whole model {whole:6.2f}  per layer {layers:6.2f}  ratio {layers / whole:.2f}x")


if __name__ == "__main__":
    main()
