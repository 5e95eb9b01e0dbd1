"""GPU timing table for the CuPy kernels: one Mamba-2 layer of mamba2-130m's shape
(d_model 768, d_state 128, headdim 64, expand 2, one group).

Four paths run the same ``portable_ssm.forward`` / ``portable_ssm.step``: the array-API core on CuPy,
the core on CuPy with the kernels as its fast paths, the core on torch CUDA, and the core on torch
CUDA with the kernels through DLPack (``torch_ops``). Measured: the forward at l = 2048, 8192 and
32768 (batch 1) and decode tokens/s (batch 1 and 16), with the achieved FLOP rate and bandwidth
against this card's measured ceilings (a float32 matmul and a device-to-device copy). The table
says which fast-path hooks each path actually called, so a hook the core does not call yet shows.
One dated section titled with the card's name is appended to ``benchmarks/RESULTS.md``.

Run it through ``benchmarks/gpu.sh``. Without CuPy and a GPU it exits with status 2 and a message,
measuring and writing nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
LENGTHS = (2048, 8192, 32768)
DECODE_BATCHES = (1, 16)
NO_GPU = 2


def _gpu_problem() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
    except cupy.cuda.runtime.CUDARuntimeError as err:
        return f"no usable CUDA device ({err})"
    return "no CUDA device"


def _config() -> Any:
    from portable_ssm.config import Mamba2Config

    return Mamba2Config(d_model=768, n_layer=1, d_state=128, headdim=64, expand=2, ngroups=1)


@contextlib.contextmanager
def _hooks(module: Any, ops: dict[str, Callable[..., Any]] | None, used: set[str]) -> Iterator[None]:
    """``module.FAST_OPS`` replaced by ``ops`` (None: kept), each op recording its name in ``used``."""
    saved = module.FAST_OPS
    current = saved if ops is None else ops

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            used.add(name)
            return fn(*args, **kwargs)
        return call

    module.FAST_OPS = {name: counted(name, fn) for name, fn in current.items()}
    try:
        yield
    finally:
        module.FAST_OPS = saved


class Variant:
    """One row group of the table: where the arrays live and which fast paths the core sees
    (``ops()`` returns the FAST_OPS to install, or None to keep the backend's own)."""

    def __init__(self, name: str, backend: str, ops: Callable[[], dict[str, Any] | None]) -> None:
        self.name, self.backend, self._ops = name, backend, ops
        self.used: set[str] = set()

    def module(self) -> Any:
        from portable_ssm.backends import load

        return load(self.backend)

    def run(self, fn: Callable[[], Any]) -> Any:
        with _hooks(self.module(), self._ops(), self.used), _no_grad(self.backend):
            return fn()

    def sync(self) -> None:
        if self.backend == "cupy":
            import cupy

            cupy.cuda.Device().synchronize()
        else:
            import torch

            torch.cuda.synchronize()


@contextlib.contextmanager
def _no_grad(backend: str) -> Iterator[None]:
    if backend != "torch":
        yield
        return
    import torch

    with torch.no_grad():
        yield


def variants() -> list[Variant]:
    from portable_ssm.backends import cupy as cupy_backend

    kernels = cupy_backend.KERNELS
    cupy_ops = {"causal_conv1d": kernels.causal_conv1d, "ssd_chunked": kernels.ssd_chunked,
                "decode_step": kernels.decode_step}
    found = [Variant("cupy array-API", "cupy", lambda: {}),
             Variant("cupy + kernels", "cupy", lambda: cupy_ops)]
    try:
        import torch
    except ImportError:
        return found
    if torch.cuda.is_available():
        from portable_ssm.backends.cupy import torch_ops

        found += [Variant("torch-cuda array-API", "torch", lambda: None),
                  Variant("torch + cupy kernels", "torch", torch_ops.fast_ops)]
    return found


def _time(path: Variant, fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up run (which also compiles the kernels)."""
    path.run(fn)
    path.sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        path.run(fn)
        path.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    """``(float32 matmul FLOP/s, device copy bytes/s)`` measured on the current GPU."""
    import cupy

    a = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
    src = cupy.ones(1 << 27, cupy.float32)  # 512 MiB
    dst = cupy.empty_like(src)

    def best(fn: Callable[[], Any]) -> float:
        fn()
        cupy.cuda.Device().synchronize()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            runs.append(time.perf_counter() - start)
        return min(runs)

    flops = 2 * 8192 ** 3 / best(lambda: cupy.matmul(a, a))
    bandwidth = 2 * src.nbytes / best(lambda: cupy.copyto(dst, src))
    return flops, bandwidth


def forward_flops(c: Any, b: int, l: int) -> float:
    """FLOPs of the layer's projections and its chunked scan (the terms that scale)."""
    from portable_ssm.ssd import choose_chunk_size

    Q = choose_chunk_size(l)
    h, p, n, g = c.nheads, c.headdim, c.d_state, c.ngroups
    projections = 2 * b * l * c.d_model * (c.d_in_proj + c.d_inner)
    scan = 2 * b * l * Q * (g * n + h * p) + 4 * b * l * h * p * n
    return projections + scan


def decode_bytes(c: Any, b: int) -> float:
    """Bytes a decode step must move at least: the layer's weights once, both states in and out."""
    weights = c.d_in_proj * c.d_model + c.d_inner * c.d_model + c.conv_dim * c.d_conv
    states = b * (c.nheads * c.headdim * c.d_state + c.conv_dim * c.d_conv)
    return 4 * (weights + 2 * states)


def _device(path: Variant) -> str | None:
    return "cuda:0" if path.backend == "torch" else None


def _inputs(path: Variant, host: np.ndarray) -> Any:
    from portable_ssm import to_backend

    return to_backend(host, path.backend, device=_device(path), dtype="float32")


def _forward_row(path: Variant, params: Any, c: Any, l: int, x: Any,
                 flops_ceiling: float) -> tuple[list[str], float]:
    import portable_ssm

    seconds = _time(path, lambda: portable_ssm.forward(x, params, config=c), 3 if l > 8192 else 5)
    rate = forward_flops(c, 1, l) / seconds
    return [path.name, str(l), f"{seconds * 1e3:.2f}", f"{rate / 1e12:.2f}",
            f"{100 * rate / flops_ceiling:.1f}%"], seconds


def _decode_row(path: Variant, params: Any, c: Any, prompt: Any, tokens: Any,
                bandwidth_ceiling: float) -> tuple[list[str], float]:
    """Decode ``tokens [T, b, d_model]`` one step at a time after a short prefill of ``prompt``."""
    import portable_ssm

    _, start = path.run(lambda: portable_ssm.forward(prompt, params, config=c, return_state=True))

    def decode() -> None:
        state = start
        for i in range(tokens.shape[0]):
            _, state = portable_ssm.step(tokens[i, ...], state, params, config=c)

    b = tokens.shape[1]
    seconds = _time(path, decode, 3) / tokens.shape[0]
    moved = decode_bytes(c, b) / seconds
    return [path.name, str(b), f"{b / seconds:,.0f}", f"{moved / 1e9:.1f}",
            f"{100 * moved / bandwidth_ceiling:.1f}%"], seconds


def measure(paths: list[Variant], ceiling: tuple[float, float],
            deadline: float) -> tuple[list[list[str]], list[list[str]]]:
    """The forward and the decode rows for ``paths`` (each records the hooks it called), each with
    its speed-up over the first path (the CuPy array-API core); rows past the deadline say so."""
    from portable_ssm.params import init_params

    c = _config()
    rows: dict[str, list[list[str]]] = {"forward": [], "decode": []}
    baseline: dict[tuple[str, int], float] = {}
    rng = np.random.default_rng(0)

    def add(kind: str, size: int, measure_row: Callable[..., tuple[list[str], float]], *args: Any) -> None:
        path = args[0]
        if time.monotonic() > deadline:
            rows[kind].append([path.name, str(size), "skipped (time budget)", "", "", ""])
            return
        row, seconds = measure_row(*args)
        base = baseline.setdefault((kind, size), seconds)
        rows[kind].append(row + [f"{base / seconds:.2f}x"])

    for path in paths:
        params = init_params(c, seed=0, backend=path.backend, device=_device(path))
        for l in LENGTHS:
            x = _inputs(path, rng.standard_normal((1, l, c.d_model)))
            add("forward", l, _forward_row, path, params, c, l, x, ceiling[0])
        for b in DECODE_BATCHES:
            prompt = _inputs(path, rng.standard_normal((b, 8, c.d_model)))
            tokens = _inputs(path, rng.standard_normal((64, b, c.d_model)))
            add("decode", b, _decode_row, path, params, c, prompt, tokens, ceiling[1])
    return rows["forward"], rows["decode"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(forward_rows: list[list[str]], decode_rows: list[list[str]], paths: list[Variant],
           ceiling: tuple[float, float], tests: str) -> str:
    import cupy
    from portable_ssm.backends.cupy.sources import kernels_enabled

    card = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    card = card.decode() if isinstance(card, bytes) else card
    versions = f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}"
    with contextlib.suppress(ImportError):
        import torch

        versions += f", torch {torch.__version__}"
    used = "; ".join(f"{p.name}: {', '.join(sorted(p.used)) or 'none'}" for p in paths)
    return "\n".join([
        f"## {datetime.date.today().isoformat()}: {card}",
        "",
        f"{versions}. Kernel tests: {tests}. PORTABLE_SSM_CUPY_KERNELS=1: {kernels_enabled()}.",
        f"Ceilings measured here: float32 matmul 8192³ {ceiling[0] / 1e12:.1f} TFLOP/s, "
        f"device copy {ceiling[1] / 1e9:.0f} GB/s. One layer of mamba2-130m's shape, float32.",
        f"Fast-path hooks called: {used}.",
        "",
        "Forward, batch 1 (FLOPs: projections + chunked scan):",
        "",
        _table(["path", "l", "ms", "TFLOP/s", "of matmul ceiling", "vs cupy array-API"], forward_rows),
        "",
        "Decode, one token per step (bytes: weights once + states in and out):",
        "",
        _table(["path", "batch", "tokens/s", "GB/s", "of copy ceiling", "vs cupy array-API"], decode_rows),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="markdown file to append to")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop adding measurements after this")
    parser.add_argument("--tests", default="not run", help="the kernel tests' outcome, for the record")
    args = parser.parse_args(argv)
    problem = _gpu_problem()
    if problem:
        print(f"gpu_bench: needs CuPy and an NVIDIA GPU ({problem}); nothing measured, {args.out} unchanged",
              file=sys.stderr)
        return NO_GPU
    paths, ceiling = variants(), ceilings()
    forward_rows, decode_rows = measure(paths, ceiling, time.monotonic() + args.budget_s)
    section = report(forward_rows, decode_rows, paths, ceiling, args.tests)
    if not args.out.exists():
        args.out.write_text("# Benchmark results\n\nAppended by the benchmark scripts; newest last.\n\n")
    with args.out.open("a") as out:
        out.write(section + "\n")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
