"""Side by side in one process: ``Mamba2LM.generate(prompt, N)``, consuming ``Mamba2LM.stream(prompt,
N)`` and the bare loop they wrap (one :func:`portable_ssm.lm.prefill`, then ``N - 1`` calls of
:func:`portable_ssm.lm.decode` fed the argmax), greedy, batch 1, no eos (``--eos``: the last id),
on random LMs (4 layers of d_model 256, and the mamba2-130m shape), NumPy and torch (CPU).

Rounds alternate the three (one call each in turn), so all share the machine's load; it prints
medians in ms a call and each one's overhead over the bare loop in µs a token. ``--profile`` adds
cProfile's top entries of one generate call, ``--chooser`` the token
chooser's own µs a token. Tooling, not a test: nothing is asserted.

    python benchmarks/generate_overhead.py --threads 2 --rounds 7
    python benchmarks/generate_overhead.py --models small --backends numpy --profile
    python benchmarks/generate_overhead.py --threads 1 --eos --models small --chooser
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from quantized_prefill import alternate  # this folder: the scripts run as files

MODELS = {"small": {"d_model": 256, "n_layer": 4, "vocab_size": 4096},
          "130m": {"d_model": 768, "n_layer": 24, "vocab_size": 50288}}


def _calls(backend: str, model: str, tokens: int, prompt: int, eos: bool) -> dict[str, Callable[[], Any]]:
    from portable_ssm.backends import load, to_backend

    import portable_ssm as ps
    from portable_ssm.lm import decode, prefill

    config = ps.Mamba2Config(**MODELS[model], d_state=128, headdim=64, expand=2)
    params = {k: to_backend(v, backend) for k, v in ps.init_params(config, seed=0, backend="numpy").items()}
    lm = ps.Mamba2LM(params, config)
    xp = load(backend).namespace()
    ids = to_backend(np.random.default_rng(1).integers(0, config.vocab_size, (1, prompt)), backend)

    def loop() -> Any:
        last, state = prefill(ids, None, None, params, config=config, xp=xp)
        out = [xp.argmax(last, axis=-1)]
        for _ in range(tokens - 1):
            last, state = decode(out[-1], state, params, config=config, xp=xp)
            out.append(xp.argmax(last, axis=-1))
        return out

    stop = config.vocab_size - 1 if eos else None  # with --eos a row could end: each token checks
    return {"loop": loop,
            "generate": lambda: lm.generate(ids, tokens, eos_token_id=stop),
            "stream": lambda: list(lm.stream(ids, tokens, eos_token_id=stop))}


def _chooser_us(backend: str, eos: int | None, calls: int = 1000) -> float:
    """µs a call of :meth:`portable_ssm.generation.TokenChooser.next` (greedy, batch 1, 4096 logits)."""
    from portable_ssm.backends import load, to_backend

    from portable_ssm.generation import TokenChooser
    from portable_ssm.generation_options import check_options

    ids = to_backend(np.zeros((1, 8), np.int64), backend)
    last = to_backend(np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32), backend)
    chooser = TokenChooser(check_options(8, 4096, max_new_tokens=2 * calls, eos_token_id=eos), ids, None,
                           xp=load(backend).namespace())
    start = time.perf_counter()
    for _ in range(calls):
        chooser.next(last)
    return (time.perf_counter() - start) * 1e6 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="threads of both backends")
    parser.add_argument("--rounds", type=int, default=7, help="timed calls of each, in turn")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a call")
    parser.add_argument("--prompt", type=int, default=8, help="prompt length")
    parser.add_argument("--models", default="small,130m", help="comma list of small, 130m")
    parser.add_argument("--backends", default="numpy,torch", help="comma list of numpy, torch")
    parser.add_argument("--eos", action="store_true",
                        help="generate and stream with an eos id (the last of the vocabulary; random weights "
                             "rarely choose it), so each token reads whether the row finished")
    parser.add_argument("--chooser", action="store_true",
                        help="also time the token chooser alone (no eos, and eos 4095 never chosen)")
    parser.add_argument("--profile", action="store_true", help="cProfile one generate call of each")
    args = parser.parse_args()
    os.environ["PORTABLE_SSM_NUM_THREADS"] = str(args.threads)
    backends = args.backends.split(",")
    if "torch" in backends:
        import torch

        torch.set_num_threads(args.threads)
        torch.set_grad_enabled(False)
    print(f"{args.threads} threads, prompt {args.prompt}, {args.tokens} new tokens, {args.rounds} rounds, medians",
          flush=True)
    for backend in backends:
        if args.chooser:
            print(f"{backend} TokenChooser.next: " + "  ".join(f"eos {eos} {_chooser_us(backend, eos):5.1f} us"
                                                             for eos in (None, 4095)), flush=True)
        for model in args.models.split(","):
            fns = _calls(backend, model, args.tokens, args.prompt, args.eos)
            ms = alternate(fns, args.rounds)
            over = {k: (v - ms["loop"]) * 1e3 / args.tokens for k, v in ms.items() if k != "loop"}
            print(f"{backend} {model:<5} " + "  ".join(f"{k} {v:7.1f} ms" for k, v in ms.items())
                  + "  overhead a token: " + "  ".join(f"{k} {v:+6.0f} us" for k, v in over.items()), flush=True)
            if args.profile:
                profile = cProfile.Profile()
                profile.runcall(fns["generate"])
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
