"""The thread pool NumPy's native paths split their passes over.

NumPy's ufuncs and matmul release the GIL, so independent slices of one pass (blocks of heads,
ranges of tiles) run in parallel from Python threads. The pool has :func:`workers` threads: the
``PORTABLE_SSM_NUM_THREADS``, ``OMP_NUM_THREADS`` or ``OPENBLAS_NUM_THREADS`` environment variable
(the first set, read once), else the CPUs this process may run on. One worker runs everything
inline, so a single-threaded setting has no pool at all.

While the pool runs, OpenBLAS (NumPy's wheels ship it) is held at one thread
(:func:`one_blas_thread`): each worker's matmuls would otherwise start the BLAS's own threads and
oversubscribe the cores (2x slower on two cores). Where that BLAS cannot be found and limited
(another BLAS, or a renamed symbol), work with matmuls in it runs inline instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

_ENV = ("PORTABLE_SSM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@lru_cache(maxsize=1)
def workers() -> int:
    """Threads of the pool (at least 1), from the environment at first use or the usable CPUs."""
    for name in _ENV:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: ``inside`` is True on the pool's own threads.
_WORKER = threading.local()


def _mark_worker() -> None:
    _WORKER.inside = True


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers(), thread_name_prefix="portable_ssm", initializer=_mark_worker)


#: OpenBLAS's thread-count functions under the names its builds export (scipy-openblas first).
_BLAS_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                 ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                 ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                 ("openblas_get_num_threads", "openblas_set_num_threads"))


#: OpenBLAS's CBLAS sgemm under the names its builds export, and whether its integers are 64-bit.
_SGEMM_SYMBOLS = (("scipy_cblas_sgemm64_", True), ("cblas_sgemm64_", True), ("scipy_cblas_sgemm", False),
                  ("cblas_sgemm", False))


@lru_cache(maxsize=1)
def _openblas_library() -> ctypes.CDLL | None:
    """The OpenBLAS mapped into the process once NumPy is imported whose thread count can be set
    (the one NumPy's matmul runs in), or None (no OpenBLAS mapped, or the maps cannot be read)."""
    import numpy  # noqa: F401  (maps NumPy's BLAS into the process)

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        library = ctypes.CDLL(path)
        if any(hasattr(library, get) and hasattr(library, set_) for get, set_ in _BLAS_SYMBOLS):
            return library
    return None


@lru_cache(maxsize=1)
def blas_sgemm() -> tuple[int, bool] | None:
    """``(address, ilp64)`` of that OpenBLAS's CBLAS ``sgemm`` (``ilp64``: it takes 64-bit integers),
    which NumPy's compiled scan calls inside :func:`one_blas_thread`; None where there is none."""
    library = _openblas_library()
    if library is None:
        return None
    for name, ilp64 in _SGEMM_SYMBOLS:
        if hasattr(library, name):
            return ctypes.cast(getattr(library, name), ctypes.c_void_p).value, ilp64
    return None


@lru_cache(maxsize=1)
def _openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """``(get, set)`` of the loaded OpenBLAS's thread count, or None (no OpenBLAS mapped)."""
    library = _openblas_library()
    if library is None:
        return None
    for get, set_ in _BLAS_SYMBOLS:
        if hasattr(library, get) and hasattr(library, set_):
            getter, setter = getattr(library, get), getattr(library, set_)
            getter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
            return getter, setter
    return None


_LIMIT_LOCK = threading.Lock()
_LIMITED = [0, 0]  # calls inside one_blas_thread, the thread count to restore after the last


@contextlib.contextmanager
def one_blas_thread() -> Iterator[bool]:
    """OpenBLAS at one thread inside (restored after the outermost exit); yields False, changing
    nothing, where it cannot be limited."""
    blas = _openblas()
    if blas is None:
        yield False
        return
    get, set_ = blas
    with _LIMIT_LOCK:
        if _LIMITED[0] == 0:
            _LIMITED[1] = get()
            set_(1)
        _LIMITED[0] += 1
    try:
        yield True
    finally:
        with _LIMIT_LOCK:
            _LIMITED[0] -= 1
            if _LIMITED[0] == 0:
                set_(_LIMITED[1])


def run_all(fn: Callable[..., Any], items: Iterable[Any], *, blas: bool = False) -> list[Any]:
    """``[fn(item) for item in items]``, the items spread over the pool (inline with one worker or
    item, and on a worker of the pool itself, which would otherwise wait for its own pool);
    ``blas``: ``fn`` runs matmuls, so the BLAS is held at one thread meanwhile (inline where it
    cannot be)."""
    items = list(items)
    if workers() == 1 or len(items) < 2 or getattr(_WORKER, "inside", False):
        return [fn(item) for item in items]
    if not blas:
        return list(_pool().map(fn, items))
    with one_blas_thread() as limited:
        return list(_pool().map(fn, items)) if limited else [fn(item) for item in items]


def row_ranges(n: int, min_rows: int) -> list[tuple[int, int]]:
    """``n`` rows cut into at most :func:`workers` contiguous ``(start, stop)`` ranges of at least
    ``min_rows`` rows each (one range when ``n`` is small)."""
    parts = max(1, min(workers(), n // max(min_rows, 1)))
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
