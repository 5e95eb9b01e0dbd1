"""What a JAX user waits for: ``logits`` of a hybrid (``HybridLM``) and a Mamba-2 model
(``Mamba2LM``) at new prompt lengths, and the hybrid's ``generate``, each call's first and second
time, run op by op (the JAX backend's ``jit`` fast op withheld: how these calls ran before they
were ``jax.jit``-compiled; Mamba-2's ``generate`` already was) beside the default.

    .venv/bin/python benchmarks/jax_compile.py [--new 16]

The hybrid is ``portable_ssm.bench.hybrid_models``' ``--quick`` Granite-4.0-H shape (4 layers, 2 of
them attention, d 64, the real vocabulary) built by transformers, the Mamba-2 model 4 layers of d 64
(vocabulary 1000), both on random weights. Each path gets prompt lengths of its own, so neither
finds the other's compiled shapes. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from portable_ssm.backends import jax as jax_backend

import portable_ssm
from portable_ssm import hybrid_lm, language_model
from portable_ssm.bench.hybrid_models import QUICK_SHAPES, write_folder

MAMBA2 = portable_ssm.Mamba2Config(d_model=64, n_layer=4, d_state=16, headdim=16, vocab_size=1000)


def _seconds(call) -> float:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


@contextlib.contextmanager
def _op_by_op() -> Iterator[None]:
    """The models' calls as they ran on JAX before they were compiled: without the backend's ``jit``."""
    caches = (hybrid_lm._layers_and_head, language_model._all_logits)
    jit = jax_backend.FAST_OPS.pop("jit")
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        jax_backend.FAST_OPS["jit"] = jit
        for cache in caches:
            cache.cache_clear()


def _rows(lm, eager: bool, lengths: tuple[int, ...], new: int) -> list[tuple[str, float, float]]:
    """``(call, first s, second s)``: logits at each of ``lengths`` (first: the mean over them), then
    (``new`` > 0) generate of ``new`` tokens after the first length's prompt."""
    rng = np.random.default_rng(0)
    prompts = [jax.numpy.asarray(rng.integers(1, 1000, (1, length))) for length in lengths]
    with _op_by_op() if eager else contextlib.nullcontext():
        logits = [(_seconds(lambda p=p: lm.logits(p)), _seconds(lambda p=p: lm.logits(p))) for p in prompts]
        rows = [(f"logits, a new prompt length ({', '.join(map(str, lengths))})",
                 statistics.mean(f for f, _ in logits), statistics.mean(s for _, s in logits))]
        if new:
            rows.append((f"generate {new} tokens", *(_seconds(lambda: lm.generate(prompts[0], new, eos_token_id=None))
                                                     for _ in range(2))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=16, help="new tokens of the hybrid's generate rows")
    args = parser.parse_args()
    mamba2 = portable_ssm.Mamba2LM(portable_ssm.cast_params(portable_ssm.init_params(MAMBA2, seed=0), "float32",
                                                           backend="jax"), MAMBA2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_folder(QUICK_SHAPES[0], Path(tmp))
        hybrid = portable_ssm.load_pretrained(tmp, backend="jax")
        for model, lm, new in ((QUICK_SHAPES[0].name, hybrid, args.new), ("mamba2 4 layers d 64", mamba2, 0)):
            rows += [(model, "op by op (before)", *row) for row in _rows(lm, True, (8, 9, 10), new)]
            rows += [(model, "jax.jit (the default)", *row) for row in _rows(lm, False, (11, 12, 13), new)]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}\n")
    print("| model | path | call | first s | second s |\n|---|---|---|---|---|")
    for model, path, call, first, second in rows:
        print(f"| {model} | {path} | {call} | {first:.2f} | {second:.3f} |")


if __name__ == "__main__":
    main()
