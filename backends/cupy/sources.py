"""The CUDA sources of the CuPy kernels (package data) and the switch that turns them on.

Nothing here imports cupy, so the sources can be found, read and compile-checked (``nvcc``) on a
machine without a GPU. ``kernel_source`` returns what ``cupy.RawModule`` compiles with NVRTC: the
``.cu`` file with its local ``#include "common.cuh"`` pasted in, so the source text alone decides
CuPy's kernel-cache key and NVRTC needs no include path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The directory holding the ``.cu`` sources and the shared ``.cuh`` header.
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
#: The environment variable that registers the kernels as CuPy fast paths (``"1"`` turns them on).
SWITCH = "PORTABLE_SSM_CUPY_KERNELS"
#: The kernel families, one ``.cu`` file each.
SOURCES = ("conv1d", "decode", "ssd")

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def kernels_enabled() -> bool:
    """Whether ``PORTABLE_SSM_CUPY_KERNELS=1`` is set: the one place the switch is read.

    The kernels compile and pass their tests under host emulation, but are not yet verified on a
    GPU, so CuPy arrays take the array-API path unless this is on.
    """
    return os.environ.get(SWITCH, "") == "1"


def source_path(name: str) -> Path:
    """The ``.cu`` file of kernel family ``name`` (one of :data:`SOURCES`)."""
    if name not in SOURCES:
        raise ValueError(f"name: expected one of {', '.join(SOURCES)}, got {name!r}")
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} is missing: the package data was not installed "
                                f"(pyproject.toml's package-data must list kernels/*.cu and kernels/*.cuh)")
    return path


def kernel_source(name: str) -> str:
    """The source of kernel family ``name`` with its local includes inlined (each header once)."""
    seen: set[str] = set()

    def inline(match: re.Match[str]) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        path = KERNEL_DIR / header
        if not path.is_file():
            raise FileNotFoundError(f"kernel header {path} (included from {name}.cu) is missing")
        return _LOCAL_INCLUDE.sub(inline, path.read_text())

    return _LOCAL_INCLUDE.sub(inline, source_path(name).read_text())

