"""How the benchmarks time calls (tooling, not core): side by side, in rounds, each after a settle.

:func:`measure` times no-argument calls (forward, training, prefill) in rounds that take one sample
of each in turn; :func:`interleaved_decode` steps decode rows in rounds likewise. Both idle
:data:`SETTLE_S` before each sample, so no call pays for the worker threads the one before left
spinning. Used by :mod:`portable_ssm.bench.runner` and :mod:`portable_ssm.bench.hybrid`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .calls import DECODE_STEPS, Clock, DecodeRun, timed_steps
from .report import proc_kib


def _timed(fn: Callable[[], Any], clock: Clock) -> tuple[float, float | None, Any]:
    """``(seconds, peak MiB over the RSS before the call or None, output)`` of one call. The peak is
    the process's VmHWM, reset through ``/proc/self/clear_refs`` (Linux; None elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = proc_kib("/proc/self/status", "VmRSS")
    except OSError:
        base = None
    start = clock()
    out = fn()
    seconds = clock() - start
    hwm = proc_kib("/proc/self/status", "VmHWM")
    return seconds, None if base is None or hwm is None else max(hwm - base, 0) / 1024, out


def _timed_calls(fn: Callable[[], Any], calls: int, clock: Clock) -> tuple[float, float | None, Any]:
    """:func:`_timed` over ``calls`` back-to-back calls: ``(mean s per call, peak MiB, last output)``."""
    def batch() -> Any:
        for _ in range(calls - 1):
            fn()
        return fn()

    seconds, peak, out = _timed(batch, clock)
    return seconds / calls, peak, out


#: Seconds the machine idles before each sample (and each decode row's turn): a library's worker
#: threads spin for up to about 0.2 s after its last call, and take cores from whatever runs next
#: (measured here: a torch matmul right after a NumPy one ran at 92 against 180 GFLOP/s 0.2 s later,
#: as OpenBLAS's two threads were still spinning), so without it a row paid for the row before it.
SETTLE_S = 0.2


def measure(fns: dict[Any, Callable[[], Any]], repeats: int, clock: Clock = time.perf_counter,
            budget_s: float = 30.0, sample_s: float = 1.0,
            settle_s: float = SETTLE_S) -> dict[Any, tuple[float, int, float, float | None, Any]]:
    """Side by side: a warm-up and a calibration call of each function, then rounds that take one
    sample of each in turn, so every function sees the same machine load. A sample is the mean of
    enough back-to-back calls to last about ``sample_s`` (one for slow calls), so short and long
    calls average over comparable stretches of time, and follows ``settle_s`` idle seconds, so it
    does not pay for the previous function's spinning threads; each function gets ``repeats``
    samples (fewer, at least two, past ``budget_s``). Returns, per name, ``(median s per call,
    samples, first-call s, peak MiB or None, last output)``."""
    first, out, calls = {}, {}, {}
    for name, fn in fns.items():
        first[name], _, out[name] = _timed(fn, clock)
        warm, _, out[name] = _timed(fn, clock)
        calls[name] = max(1, round(sample_s / max(warm, 1e-9)))
    runs = {name: max(2, min(repeats, int(budget_s / max(first[name], sample_s)))) for name in fns}
    times: dict[Any, list[float]] = {name: [] for name in fns}
    peaks: dict[Any, list[float | None]] = {name: [] for name in fns}
    for turn in range(max(runs.values(), default=0)):
        for name, fn in fns.items():
            if turn < runs[name]:
                time.sleep(settle_s)
                seconds, peak, out[name] = _timed_calls(fn, calls[name], clock)
                times[name].append(seconds)
                peaks[name].append(peak)
    return {name: (statistics.median(times[name]), runs[name], first[name],
                   None if None in peaks[name] else max(peaks[name]), out[name]) for name in fns}


#: Decode steps each row takes in one turn of :func:`interleaved_decode`'s rounds.
ROUND_STEPS = 4


def interleaved_decode(runs: dict[Any, DecodeRun], read: Callable[[], Any], clock: Clock,
                       round_steps: int = ROUND_STEPS, settle_s: float = SETTLE_S,
                       steps: int = DECODE_STEPS) -> tuple[dict[Any, tuple[list[float], list[Any]]], list[float]]:
    """Decode rows side by side: each run's prompt pass and first token in turn (untimed), then
    rounds in which every run takes ``round_steps`` timed steps in turn and ``read`` (the streaming
    read) is timed once, each after ``settle_s`` idle seconds (:data:`SETTLE_S`), until each run has
    ``steps`` steps. So the rows' step times, and the bandwidth they are compared with, share
    the machine's load as the forward rows' do (a compiling first step lands in the first round).
    Returns ``({run: (step seconds, tokens)}, read seconds)``."""
    out = {key: ([], timed_steps(run, 1, clock)[1]) for key, run in runs.items()}
    read()  # warm-up
    reads = []
    for done in range(0, steps, round_steps):
        for key, run in runs.items():
            time.sleep(settle_s)
            times, tokens = timed_steps(run, min(round_steps, steps - done), clock)
            out[key][0].extend(times)
            out[key][1].extend(tokens)
        time.sleep(settle_s)
        start = clock()
        read()
        reads.append(clock() - start)
    return out, reads
