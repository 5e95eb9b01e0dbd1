"""Settings of the host process that the CPU backends run faster with.

NumPy arrays and PyTorch's CPU tensors take their memory from the C library's ``malloc``. With
glibc's defaults a freed block of more than 128 KiB goes back to the kernel (blocks that large
are mapped on their own, and freed memory at the top of the heap beyond twice that threshold is
trimmed; both thresholds rise only after such a block is freed). A layer's temporaries are tens of
MiB at prefill lengths, made and freed in the same sizes call after call, so every call's buffers
are fresh pages the kernel has to map and zero: one extra pass over memory per temporary, on the
thread that first writes it. :func:`retain_freed_memory` keeps that memory in the process instead,
as the caching allocators of GPU frameworks do (docs/guides/threads-memory.md; the measured effect
is in benchmarks/HISTORY.md). The ``portable-ssm`` command line (and so the benchmarks) applies it to its own process
unless ``PORTABLE_SSM_RETAIN_MEMORY=0`` (:func:`retain_unless_disabled`); library code calls
:func:`retain_freed_memory` once at start-up.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Any

#: glibc's ``mallopt`` parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: The largest block glibc will take from the heap rather than map on its own (its maximum
#: M_MMAP_THRESHOLD on 64-bit builds, HEAP_MAX_SIZE / 2).
HEAP_BLOCK_LIMIT = 32 << 20
#: Freed memory :func:`retain_freed_memory` keeps by default: 1 GiB.
DEFAULT_RETAINED = 1 << 30
#: The environment variable that turns the command line's setting off ("0") or on ("1", the default).
ENV = "PORTABLE_SSM_RETAIN_MEMORY"


@lru_cache(maxsize=1)
def _glibc() -> Any:
    """The process's C library if it is glibc (it exports ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)  # the libraries already loaded (Windows has no such handle)
    except (OSError, TypeError):
        return None
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def retain_freed_memory(limit: int = DEFAULT_RETAINED) -> bool:
    """Keep up to ``limit`` bytes of freed memory in this process for reuse (glibc ``mallopt``):
    blocks of up to HEAP_BLOCK_LIMIT (32 MiB) come from the heap instead of their own mappings,
    and the heap's free top is returned to the kernel only beyond ``limit`` bytes. Larger blocks
    are still mapped and unmapped each time. The setting is process-wide and lasts until changed;
    the price is that up to ``limit`` bytes freed by any code stay counted in the process's RSS.

    Returns True where it was set, False where the C library is not glibc (nothing changes).
    TypeError for a non-integer ``limit``, ValueError unless ``0 < limit < 2**31`` (mallopt takes
    an int)."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit: expected an int number of bytes, got {type(limit).__name__}")
    if not 0 < limit < 2 ** 31:
        raise ValueError(f"limit: expected 0 < limit < 2**31 bytes (mallopt takes an int), got {limit}")
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, min(HEAP_BLOCK_LIMIT, limit))
                and libc.mallopt(_M_TRIM_THRESHOLD, limit))


def retain_unless_disabled() -> bool:
    """The command line's start-up: :func:`retain_freed_memory` unless the environment variable
    ``PORTABLE_SSM_RETAIN_MEMORY`` is "0"; returns whether it was set. ValueError naming the
    variable for a value other than "0" or "1"."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 (release freed memory, glibc's default) or 1 (retain it), "
                         f"got {value!r}")
    return value == "1" and retain_freed_memory()
