"""Side by side in one process: torch's whole-model batch-1 decode step (``decode_model``, one
C++ call a token) against the per-layer eager step it replaces (the hook removed between turns),
or with ``--against REV`` against the whole-model step of the kernel source at git revision REV
(built beside this checkout's under its own op namespace; its ``decode_model`` op must take the
same arguments), on a mamba2-130m-shaped random LM, for float32, int8 and bfloat16 weights.

Rounds alternate the two (4 steps each in turn, as ``benchmarks/run.py`` does), so both share the
machine's load; it prints medians and their ratio. Tooling, not a test: nothing is asserted.

    python benchmarks/decode_model_ab.py --threads 2 --rounds 10
    python benchmarks/decode_model_ab.py --threads 2 --rounds 30 --against 74cc866
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

KERNELS, SHARED_SOURCE, CPU_SOURCES = "backends/torch_kernels.py", "backends/cpu_source.py", "backends/cpu"


def _show(rev: str, path: str, missing_ok: bool = False) -> str | None:
    """The text of ``path`` at git revision ``rev`` (None where it has no such file and ``missing_ok``)."""
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=Path(__file__).resolve().parent,
                           capture_output=True, text=True)
    if shown.returncode != 0 and missing_ok:
        return None
    shown.check_returncode()
    return shown.stdout


def _cpu_sources_at(rev: str, folder: Path) -> dict[str, str]:
    """The revision's C++ files under ``backends/cpu/`` (name -> text), written into ``folder``; empty
    for a revision from before they moved out of Python strings."""
    listed = subprocess.run(["git", "ls-tree", "--full-tree", "--name-only", f"{rev}:{CPU_SOURCES}"],
                            cwd=Path(__file__).resolve().parent, capture_output=True, text=True)
    names = listed.stdout.split() if listed.returncode == 0 else []
    files = {name: _show(rev, f"{CPU_SOURCES}/{name}") or "" for name in names}
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


@contextlib.contextmanager
def _sibling(name: str, text: str | None, filename: str, file: Path) -> Iterator[None]:
    """While inside, ``import name`` (the relative import of the revision's kernel module) gives
    ``text`` run as that module (its ``__file__`` is ``file``, so it finds the C++ files written
    beside it); nothing changes for None (a revision from before the C++ source shared with NumPy's
    kernels moved out, whose kernel module holds it whole)."""
    if text is None:
        yield
        return
    module = types.ModuleType(name)
    module.__package__ = name.rpartition(".")[0]
    module.__file__ = str(file)
    exec(compile(text, filename, "exec"), module.__dict__)
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


def kernel_at(rev: str) -> Callable[..., Any]:
    """:func:`portable_ssm.backends.torch_kernels.decode_model` as the kernel source at git revision
    ``rev`` computes it (its SOURCE string, or from a later revision on its ``backends/cpu/`` files, and
    its CFLAGS, built under the op namespace of its source hash)."""
    import torch
    from torch.utils import cpp_extension

    text = _show(rev, KERNELS)
    module: dict[str, Any] = {"__name__": f"portable_ssm.backends.torch_kernels_at_{rev}",
                              "__package__": "portable_ssm.backends"}
    shared = _show(rev, SHARED_SOURCE, missing_ok=True)
    with tempfile.TemporaryDirectory() as work:
        files = _cpu_sources_at(rev, Path(work) / "cpu")
        with _sibling("portable_ssm.backends.cpu_source", shared, f"{rev}:{SHARED_SOURCE}", Path(work) / "x.py"):
            exec(compile(text, f"{rev}:{KERNELS}", "exec"), module)
        if "SOURCE" in module:  # the C++ source in a Python string
            namespace = "portable_ssm_cpu_" + hashlib.sha256(module["SOURCE"].encode()).hexdigest()[:12]
            source = re.sub(r"\bportable_ssm_cpu\b", namespace, module["SOURCE"])
            cpp_extension.load_inline(namespace, cpp_sources=[source], extra_cflags=list(module["CFLAGS"]),
                                      is_python_module=False)
        else:  # the C++ files under backends/cpu/: the ops' file renamed into its namespace, built beside them
            every = "\0".join(f"{name}\0{body}" for name, body in sorted(files.items()))
            namespace = "portable_ssm_cpu_" + hashlib.sha256(every.encode()).hexdigest()[:12]
            ops = Path(work) / "cpu" / module["SOURCE_FILE"]
            ops.write_text(re.sub(r"\bportable_ssm_cpu\b", namespace, ops.read_text()))
            cpp_extension.load(namespace, sources=[str(ops)], extra_cflags=list(module["CFLAGS"]),
                               is_python_module=False)
    op = getattr(torch.ops, namespace).decode_model

    def decode_model(x: Any, conv_states: Any, ssm_states: Any, weights: Any, eps: float,
                     dt_limit: tuple[float, float], ngroups: int, headdim: int) -> Any:
        low, high = dt_limit
        return op(x, conv_states, ssm_states, *weights, float(eps), float(low), float(high), ngroups, headdim)

    return decode_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 4 steps of each path")
    parser.add_argument("--kinds", default="float32,int8,bfloat16", help="comma list of weight kinds")
    parser.add_argument("--against", metavar="REV",
                        help="compare with the whole-model step of the kernel at this git revision instead")
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
    if args.against is None:
        other = "per layer"

        @contextlib.contextmanager
        def other_path() -> Iterator[None]:  # the per-layer step: no decode_model hook
            hook = backend.FAST_OPS.pop("decode_model")
            try:
                yield
            finally:
                backend.FAST_OPS["decode_model"] = hook
    else:
        other, old_kernel = f"at {args.against}", kernel_at(args.against)

        @contextlib.contextmanager
        def other_path() -> Iterator[None]:  # the hook calls the revision's kernel
            current = torch_kernels.decode_model
            torch_kernels.decode_model = old_kernel
            try:
                yield
            finally:
                torch_kernels.decode_model = current
    paths = {"whole model": contextlib.nullcontext, other: other_path}
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds of 4 steps each, ms a step")
    for kind in args.kinds.split(","):
        params = ps.quantize(base, kind)
        times: dict[str, list[float]] = {path: [] for path in paths}
        with torch.inference_mode():
            _, prefilled = ps.lm.logits(ids, params, config=config, return_state=True)
            states = dict.fromkeys(times, prefilled)
            for _ in range(args.rounds):
                for path, context in paths.items():
                    with context():
                        for _ in range(4):
                            start = time.perf_counter()
                            _, states[path] = ps.lm.decode(ids[:, -1], states[path], params, config=config,
                                                           xp=backend.xp)
                            times[path].append(time.perf_counter() - start)
        whole, slower = (1e3 * statistics.median(times[path][4:]) for path in times)  # the first round warms up
        print(f"{kind:>9}: whole model {whole:6.2f}  {other} {slower:6.2f}  ratio {slower / whole:.2f}x")


if __name__ == "__main__":
    main()
