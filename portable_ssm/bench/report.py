"""Benchmark results (tooling, not core): what a row is, the FLOP count, and RESULTS.md.

:func:`forward_flops` defines the FLOP count every GFLOP/s figure uses (see :data:`FLOP_NOTE`);
:func:`write_results` writes the markdown tables, the targets of the CPU speed issue, the machine
details and the time-vs-length plot. Frameworks are imported inside functions only.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import Mamba2Config
from ..ssd import choose_chunk_size
from .quality import PATTERN_LM, REFERENCE, QualityRow

FLOP_NOTE = ("FLOP count, per layer and token (multiply-add = 2): projections 2·d_model·(d_in_proj + "
             "d_inner) + SSD 2·(Q·g·n + Q·h·p + 2·h·p·n) with Q = portable_ssm's chunk size for l; conv, "
             "norms and elementwise work are not counted; training counts 3x the forward. GFLOP/s = that "
             "count / median time for every backend (transformers' chunk of 256 does more work than "
             "counted). x transformers = transformers' median / this row's median. Peak MiB: what one call "
             "needs, the VmHWM of a fresh process that builds the row and calls it once minus that of one that "
             "only builds it (without --fresh-peak: the rise of the timing process's peak RSS during a call); "
             "process MiB: that fresh process's whole VmHWM (interpreter, framework, weights, inputs). "
             "rel err: max |y - y_ref| / max |y_ref|, ref = "
             "transformers (numpy without it).")
CEILING_NOTE = ("float32 ceiling of a training row: transformers' median / the time the projections' "
                "matmuls alone take at the sgemm rate timed in the row's rounds (in_proj and out_proj of every "
                "layer, forward and backward: 3 · 2·d_model·(d_in_proj + d_inner) per layer and token). No "
                "float32 training step that multiplies at that rate gains more on transformers, whatever its "
                "scan, norms and elementwise work cost.")
#: The rows that are portable_ssm (the others: transformers, llama.cpp).
PORTABLE = ("numpy", "numpy-ref", "torch", "torch-compile", "jax")


@dataclass(frozen=True)
class Case:
    """One benchmarked shape (for decode, ``length`` is the prompt length)."""

    part: str
    name: str
    config: Mamba2Config
    batch: int
    length: int


@dataclass
class Row:
    """One measurement: ``seconds`` is the median of ``runs`` calls (of one step for decode)."""

    case: Case
    backend: str
    seconds: float
    runs: int
    first_s: float
    peak_mib: float | None
    check: str = ""
    ratio: float | None = None
    sgemm: float | None = None  # GFLOP/s of the sgemm timed in the same rounds (forward and train)
    weight_bytes: int | None = None  # weights one decode step reads (decode rows of portable_ssm)
    bandwidth: float | None = None  # GB/s of the streaming read timed in the decode rows' rounds
    fresh: tuple[float, float] | None = None  # (peak MiB with one call, without it) of a fresh process


@dataclass
class HybridRow:
    """One row of the hybrid part: portable_ssm's median ``seconds`` (a decode step after a prompt
    of ``context`` tokens, or the prefill of ``context`` tokens) at ``precision`` weights beside
    the ``llama`` row's (None where it did not run, ``note`` saying why)."""

    shape: str
    part: str  # "decode" or "prefill"
    context: int
    precision: str
    seconds: float
    runs: int
    llama: str
    llama_seconds: float | None = None
    check: str = ""  # decode: greedy tokens equal to llama.cpp's; prefill: the last logits' rel err
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """llama.cpp's time over portable_ssm's (> 1: portable_ssm is faster)."""
        return None if self.llama_seconds is None else self.llama_seconds / self.seconds


def projection_flops(config: Mamba2Config, batch: int, length: int) -> float:
    """FLOPs of the projections alone (in_proj and out_proj of every layer) in one forward over
    ``[batch, length]``: the matmuls no implementation can skip."""
    c = config
    return float(c.n_layer * batch * length * 2 * c.d_model * (c.d_in_proj + c.d_inner))


def forward_flops(config: Mamba2Config, batch: int, length: int) -> float:
    """Model FLOPs of one forward over ``[batch, length]`` (see the module docstring): the
    projections and the chunked scan's matmuls."""
    c, Q = config, choose_chunk_size(length)
    ssd = 2 * (Q * c.ngroups * c.d_state + Q * c.nheads * c.headdim + 2 * c.nheads * c.headdim * c.d_state)
    return projection_flops(config, batch, length) + float(c.n_layer * batch * length * ssd)


def float32_ceiling(r: Row) -> float | None:
    """The most a float32 training step of ``r``'s case can gain on transformers on this machine:
    transformers' median over the time the projections' matmuls alone take (the forward product and
    the two of the backward, 3x :func:`projection_flops`) at the sgemm rate timed in ``r``'s rounds.
    None where the row has no sgemm or no transformers ratio."""
    if r.sgemm is None or r.ratio is None:
        return None
    matmuls_s = 3 * projection_flops(r.case.config, r.case.batch, r.case.length) / (r.sgemm * 1e9)
    return r.ratio * r.seconds / matmuls_s


def proc_kib(path: str, field: str) -> int | None:
    """The kB value of ``field`` in a /proc status-like file, or None where there is none."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def blas_info() -> str:
    """numpy's BLAS and, for OpenBLAS, the kernel it runs (through threadpoolctl when installed)."""
    import ctypes
    import glob

    import numpy as np

    try:
        from threadpoolctl import threadpool_info

        return "; ".join(f"{i['internal_api']} {i.get('version')} {i.get('architecture')} "
                         f"threads={i['num_threads']}" for i in threadpool_info())
    except ImportError:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    info = f"{blas['name']} {blas.get('version', '')}"
    for path in glob.glob(os.path.join(os.path.dirname(np.__path__[0]), "numpy.libs", "*openblas*")):
        lib = ctypes.CDLL(path)
        for symbol, label in (("scipy_openblas_get_corename64_", "kernel"),
                              ("scipy_openblas_get_num_threads64_", "threads")):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p if label == "kernel" else ctypes.c_int
                value = fn()
                info += f", {label} {value.decode() if isinstance(value, bytes) else value}"
    return info


def _machine() -> list[str]:
    import numpy as np

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = proc_kib("/proc/meminfo", "MemTotal")
    lines = [f"CPU: {cpu}, {os.cpu_count()} logical cores" + (f", {mem / 2**20:.0f} GiB RAM" if mem else ""),
             f"OS: {platform.platform()}; Python {platform.python_version()}; numpy {np.__version__}",
             f"BLAS: {blas_info()}"]
    for name in ("torch", "jax", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            threads = f" ({module.get_num_threads()} threads)" if name == "torch" else ""
            lines.append(f"{name} {module.__version__}{threads}")
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _memory(r: Row) -> str:
    """The two memory cells of a row: the call's peak (from a fresh process where measured, else
    the rise in the timing process) and the fresh process's whole peak."""
    call = r.peak_mib if r.fresh is None else r.fresh[0] - r.fresh[1]
    return f"| {_fmt(call, '.0f')} | {_fmt(None if r.fresh is None else r.fresh[0], '.0f')} "


def _tables(rows: list[Row]) -> list[str]:
    out = []
    for part, title in (("forward", "Forward (inference)"), ("train", "Training step (forward + backward)")):
        if any(r.case.part == part for r in rows):
            out += [f"## {title}", "", "| shape | b | l | backend | median ms | runs | first ms "
                    "| x transformers | GFLOP/s | % sgemm | peak MiB | process MiB | rel err |", "|" + "---|" * 13]
        for r in (r for r in rows if r.case.part == part):
            rate = forward_flops(r.case.config, r.case.batch, r.case.length) * (3 if part == "train" else 1)
            rate /= r.seconds * 1e9
            out.append(f"| {r.case.name} | {r.case.batch} | {r.case.length} | {r.backend} "
                       f"| {r.seconds * 1e3:.1f} | {r.runs} | {r.first_s * 1e3:.0f} | {_fmt(r.ratio, '.2f')} "
                       f"| {rate:.1f} | {_fmt(None if r.sgemm is None else 100 * rate / r.sgemm, '.0f')} "
                       f"{_memory(r)}| {r.check} |")
        out += [""] if any(r.case.part == part for r in rows) else []
    prefill = [r for r in rows if r.case.part == "prefill"]
    if prefill:
        out += ["## Prefill (b=1: the prompt pass to the last position's logits; tokens/s = b·l / median)", "",
                "| model | b | prompt | backend | median ms | runs | first ms | tokens/s | x transformers "
                "| peak MiB | process MiB | rel err of the last logits |", "|" + "---|" * 12]
        out += [f"| {r.case.name} | {r.case.batch} | {r.case.length} | {r.backend} | {r.seconds * 1e3:.1f} "
                f"| {r.runs} | {r.first_s * 1e3:.0f} | {r.case.batch * r.case.length / r.seconds:.0f} "
                f"| {_fmt(r.ratio, '.2f')} {_memory(r)}| {r.check} |" for r in prefill]
        out.append("")
    decode = [r for r in rows if r.case.part == "decode"]
    if decode:
        out += ["## Decode (greedy; tokens/s = b / median step time)", "",
                f"Memory bandwidth (streaming read): {_fmt(decode[0].bandwidth, '.1f')} GB/s. Tokens equal to ref: "
                "greedy tokens equal to transformers' (numpy's without it) on these random weights, which amplify "
                "any rounding, so low-precision rows part early; the quality part grades them on a trained LM.", "",
                "| model | b | backend | ms / step | tokens/s | x transformers | weight MB / step | GB/s "
                "| % bandwidth | peak MiB | process MiB | tokens equal to ref |", "|" + "---|" * 12]
        for r in decode:
            rate = None if r.weight_bytes is None else r.weight_bytes / r.seconds / 1e9
            share = None if rate is None or not r.bandwidth else 100 * rate / r.bandwidth
            out.append(f"| {r.case.name} | {r.case.batch} | {r.backend} | {r.seconds * 1e3:.2f} "
                       f"| {r.case.batch / r.seconds:.0f} | {_fmt(r.ratio, '.2f')} "
                       f"| {_fmt(None if r.weight_bytes is None else r.weight_bytes / 1e6, '.4g')} "
                       f"| {_fmt(rate, '.1f')} | {_fmt(share, '.0f')} {_memory(r)}| {r.check} |")
        out.append("")
    return out


def scaling_curves(rows: list[Row]) -> dict[str, list[tuple[int, float]]]:
    """Forward seconds vs length of the one-layer rows, per backend: ``{backend: [(l, s), ...]}``."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.case.part == "forward" and r.case.name == "130m-layer":
            curves.setdefault(r.backend, []).append((r.case.length, r.seconds))
    return curves


def _scaling_table(curves: dict[str, list[tuple[int, float]]], plot: bool) -> list[str]:
    lengths = sorted({n for pts in curves.values() for n, _ in pts})
    lines = ["## Time vs length (forward, one 130m layer, b=1)", "",
             "| backend | " + " | ".join(f"l={n}" for n in lengths) + " | t(l_max)/t(l_min) |",
             "|" + "---|" * (len(lengths) + 2)]
    for backend, pts in curves.items():
        times = dict(pts)
        lines.append(f"| {backend} | " + " | ".join(f"{times[n] * 1e3:.0f} ms" if n in times else "-"
                                                   for n in lengths) +
                     f" | {pts[-1][1] / pts[0][1]:.1f} for {pts[-1][0] // pts[0][0]}x tokens |")
    return lines + (["", "![time vs length](scaling.png)", ""] if plot else [""])


def plot_scaling(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """Log-log time vs length, one line per backend, with a linear-in-l guide; a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for backend, pts in curves.items():
        ax.plot([n for n, _ in pts], [s for _, s in pts], marker="o", label=backend)
    n0, s0 = min(min(pts) for pts in curves.values())
    ends = [n0, max(n for pts in curves.values() for n, _ in pts)]
    ax.plot(ends, [s0 * n / n0 for n in ends], "k:", label="linear in l")
    ax.set(xscale="log", yscale="log", xlabel="sequence length l", ylabel="forward time (s)",
           title="Mamba-2 layer (130m shape) forward time vs length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _targets(rows: list[Row], curves: dict[str, list[tuple[int, float]]], quality: list[QualityRow]) -> list[str]:
    lines, ceilings = [], False
    for r in rows:
        where = f"{r.case.name} l={r.case.length}"
        if r.ratio is not None and r.case.part == "forward" and r.backend in ("numpy", "torch") and (
                r.case.name == "seed" or r.case.length in (2048, 8192)):
            lines.append(f"{r.backend} forward {where}: {r.ratio:.2f}x transformers (target >= 2)")
        if r.ratio is not None and r.case.part == "train" and r.backend in ("torch", "torch-compile"):
            aim = "target >= 3" if (r.case.name, r.case.length) == ("130m-layer", 2048) else "target >= 1.5"
            memory = "" if r.fresh is None else f", peak {r.fresh[0] - r.fresh[1]:.0f} MiB"
            ceiling = float32_ceiling(r)
            ceilings |= ceiling is not None
            bound = "" if ceiling is None else f"; float32 ceiling {ceiling:.2f}x"
            lines.append(f"{r.backend} train {where}: {r.ratio:.2f}x transformers ({aim}{memory}{bound})")
        if (r.case.part, r.case.name, r.case.length, r.backend) == ("forward", "130m-layer", 8192, "numpy"):
            rate = forward_flops(r.case.config, 1, 8192) / r.seconds / 1e9
            lines.append(f"numpy forward {where}: {100 * rate / r.sgemm:.1f}% of sgemm ({rate:.1f} of "
                         f"{r.sgemm:.1f} GFLOP/s; target >= 65%)")
    lines += _llama_targets(rows, quality)
    for backend, pts in curves.items():
        times = dict(pts)
        if 2048 in times and 32768 in times:
            aim = "target <= 18" if backend in ("numpy", "torch", "jax") else "for comparison"
            lines.append(f"{backend}: t(32768)/t(2048) = {times[32768] / times[2048]:.1f} ({aim})")
    if not lines:
        return []
    return ["## Targets", ""] + [f"- {line}" for line in lines] + [""] + ([CEILING_NOTE, ""] if ceilings else [])


#: Issue 14's decode comparisons: the portable_ssm rows of one weight precision, the llama.cpp row
#: they are held against.
DECODE_PAIRS = (("float32", PORTABLE, "llama.cpp-f32"),
                ("8-bit", ("numpy-int8", "torch-int8", "torch-compile-int8"), "llama.cpp-q8_0"),
                ("bfloat16", ("numpy-bf16", "torch-bf16", "torch-compile-bf16"), "llama.cpp-f16"))


def _llama_targets(rows: list[Row], quality: list[QualityRow]) -> list[str]:
    """Issue 14's goals against llama.cpp, where a case has its row: the fastest portable_ssm row's
    speed over llama.cpp's (llama.cpp's time / portable_ssm's); prefill against f32, decode at each
    weight precision against llama.cpp's of the same size, with both rows' quality on the trained
    LM where the quality part ran."""
    lines = []
    for case in dict.fromkeys(r.case for r in rows if r.backend.startswith("llama.cpp")):
        pairs = DECODE_PAIRS if case.part == "decode" else DECODE_PAIRS[:1]
        for precision, ours, theirs in pairs:
            llama = next((r for r in rows if r.case == case and r.backend == theirs), None)
            best = min((r for r in rows if r.case == case and r.backend in ours), key=lambda r: r.seconds,
                       default=None)
            if llama is None or best is None:
                continue
            speed = f"{llama.seconds / best.seconds:.2f}x ({best.backend}"
            if case.part == "prefill":
                lines.append(f"prefill {case.length}: best portable_ssm / llama.cpp f32 = {speed}; target >= 1.5)")
            elif case.batch == 1:
                graded = {q.backend: q for q in quality if q.backend in (best.backend, theirs)}
                grades = "; ".join(f"{q.backend} logits err {q.logits_err:.1e}, {q.equal}/{q.total} tokens equal"
                                   for q in graded.values())
                lines.append(f"decode b=1: best portable_ssm {precision} vs {theirs} = {speed}; target >= 1)"
                             + (f"; quality on the trained LM: {grades}" if grades else ""))
    return lines


def _quality_table(quality: list[QualityRow]) -> list[str]:
    c = PATTERN_LM
    return [f"## Quality of the weights (a trained {c.n_layer}-layer d_model {c.d_model} LM, greedy decode)", "",
            f"Against {REFERENCE} with float32 weights: logits err ‖Δ‖/‖ref‖ over the steps up to the first "
            "differing token; tokens equal to that reference's; tokens continuing the learnt sequence.", "",
            "| backend | weights | logits rel err | tokens equal to float32 | tokens continuing the pattern |",
            "|" + "---|" * 5] + [f"| {q.backend} | {q.weights} | {q.logits_err:.1e} | {q.equal}/{q.total} "
                                 f"| {q.on_pattern}/{q.total} |" for q in quality] + [""]


def _hybrid_table(rows: list[HybridRow]) -> list[str]:
    lines = ["## Hybrid models (b=1: portable_ssm's HybridLM on numpy beside llama.cpp, the same random weights)", "",
             "decode: ms per greedy token after a prompt of `context` tokens (median of the steps); prefill: ms "
             "for a prompt of `context` tokens. llama / portable: llama.cpp's time over portable_ssm's (> 1: "
             "portable_ssm is faster). check: greedy tokens equal to llama.cpp's (random weights amplify any "
             "rounding, so low-precision pairs part early), or the last logits' rel err between the two.", "",
             "| shape | part | context | portable_ssm weights | portable_ssm ms | llama.cpp | llama.cpp ms "
             "| llama / portable | check |", "|" + "---|" * 9]
    for r in rows:
        theirs = "-" if r.llama_seconds is None else f"{r.llama_seconds * 1e3:.2f}"
        lines.append(f"| {r.shape} | {r.part} | {r.context} | {r.precision} | {r.seconds * 1e3:.2f} | {r.llama} "
                     f"| {theirs} | {_fmt(r.ratio, '.2f')} | {r.check or r.note} |")
    return lines + [""]


def write_results(rows: list[Row], out: Path, notes: list[str], *, append: bool = False,
                  quality: list[QualityRow] | None = None, hybrid: list[HybridRow] | None = None) -> Path:
    """Writes ``RESULTS.md`` (and ``scaling.png`` when there are length rows and matplotlib) into ``out``; with
    ``append``, adds the run as one section at the end of the existing RESULTS.md instead (its
    headings one level down, no plot). ``quality``: the quality part's rows, tabled after decode;
    ``hybrid``: the hybrid part's, tabled after them."""
    quality = quality or []
    out.mkdir(parents=True, exist_ok=True)
    path = out / "RESULTS.md"
    if append and not path.exists():
        raise FileNotFoundError(f"--append: there is no {path} to add to; run once without --append")
    curves = scaling_curves(rows)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    text = ["# portable_ssm benchmarks", "", f"Date: {date}", ""]
    if append:
        text = ["", f"# Appended run ({date})", ""]
    text += [f"- {line}" for line in _machine() + notes]
    rates = sorted({r.sgemm for r in rows if r.sgemm is not None})
    if rates:
        text.append(f"- sgemm over the groups (numpy float32 matmul, timed beside each): {rates[0]:.1f} to "
                    f"{rates[-1]:.1f} GFLOP/s, median {statistics.median(rates):.1f}")
    plot = bool(curves) and not append and importlib.util.find_spec("matplotlib") is not None
    if curves and not append and not plot:
        text.append("- scaling.png not written: matplotlib is not installed (pip install matplotlib)")
    text += ["", FLOP_NOTE, ""] + _targets(rows, curves, quality) + _tables(rows)
    text += _quality_table(quality) if quality else []
    text += _hybrid_table(hybrid) if hybrid else []
    if curves:
        text += _scaling_table(curves, plot=plot)
    if append:
        text = [f"#{line}" if line.startswith("#") else line for line in text]
        path.write_text(path.read_text().rstrip("\n") + "\n" + "\n".join(text))
        return path
    if plot:
        plot_scaling(curves, out / "scaling.png")
    path.write_text("\n".join(text))
    return path
