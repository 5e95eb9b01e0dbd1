"""Peak memory of one benchmark row, measured in a fresh process (tooling, not core).

In the timing process, allocators that keep freed memory (torch's, XLA's) and everything earlier
rows left behind hide a row's real footprint. :func:`fresh_peak_mib` runs the row's call once in a
new Python process (``python -m portable_ssm.bench.peak ROW``) and reads that process's ``VmHWM``
(Linux): the most memory it ever held, interpreter, framework, weights, inputs and the call's
intermediates included; the same process run again without the call gives the baseline, so the
difference is what the call itself needed. Both reset the peak to the memory in use once the
weights and inputs are built (``/proc/self/clear_refs``), so a higher peak while building them
(the float64 draws of ``init_params``) cannot hide the call's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import subprocess
import sys
from typing import Any

from ..config import Mamba2Config
from ..host import retain_unless_disabled
from .report import Case, proc_kib

#: Seconds one measurement may take before it is given up (reported as unknown).
TIMEOUT_S = 900


def _case_json(case: Case, backend: str) -> str:
    return json.dumps({"part": case.part, "name": case.name, "batch": case.batch, "length": case.length,
                       "backend": backend, "config": dataclasses.asdict(case.config)})


def _case_from(text: str) -> tuple[Case, str]:
    row = json.loads(text)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in row["config"].items()}
    return Case(row["part"], row["name"], Mamba2Config(**fields), row["batch"], row["length"]), row["backend"]


def fresh_peak_mib(case: Case, backend: str) -> tuple[float, float] | None:
    """``(peak MiB with one call of the row, peak MiB of the same process without it)`` from a
    fresh process, or None where it cannot be measured (no /proc, a failed or timed-out child)."""
    out = []
    for call in (True, False):
        try:
            done = subprocess.run([sys.executable, "-m", __name__, _case_json(case, backend), str(int(call))],
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None
        lines = done.stdout.split()
        if done.returncode != 0 or not lines or not lines[-1].isdigit():
            return None
        out.append(int(lines[-1]) / 1024)
    return out[0], out[1]


def case_inputs(case: Case) -> Any:
    """The case's input: token ids for prefill and decode, else float32 embeddings (the same for
    every backend); here, below :mod:`.runner`, so the timing run and the peak process build one."""
    import numpy as np

    rng = np.random.default_rng(1)
    if case.part in ("prefill", "decode"):
        return rng.integers(0, case.config.vocab_size, (case.batch, case.length))
    return rng.standard_normal((case.batch, case.length, case.config.d_model)).astype(np.float32)


def _reset_peak() -> None:
    """Hands freed heap memory back (glibc's ``malloc_trim``), so the call cannot grow into it
    unseen, and sets this process's VmHWM to its RSS (Linux >= 4.0; elsewhere nothing changes)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def _run(case: Case, backend: str, call: bool) -> int | None:
    """Builds the row's weights, inputs and call (as the timing run does), calls it once when
    ``call``, and returns this process's VmHWM in kB."""
    from ..params import init_params
    from .calls import decode, forward_fn, prefill_fn

    params, inputs = init_params(case.config, seed=0), case_inputs(case)
    gc.collect()
    _reset_peak()
    if case.part == "decode":
        if call:
            decode(backend, case.config, params, inputs, lambda: 0.0)
    else:
        fn = (prefill_fn(backend, case.config, params, inputs) if case.part == "prefill"
              else forward_fn(backend, case.config, params, inputs, case.part == "train"))
        if call:
            fn()
    return proc_kib("/proc/self/status", "VmHWM")


def main(argv: list[str]) -> int:
    retain_unless_disabled()  # as the timing process (portable-ssm bench) does
    case, backend = _case_from(argv[0])
    peak = _run(case, backend, argv[1] == "1")
    if peak is None:
        return 1
    print(peak)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

