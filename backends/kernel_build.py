"""``portable-ssm build-kernels``: the CPU kernels built ahead of the first call that would build them.

NumPy's library (:mod:`.numpy.kernels`) and, where torch is installed, torch's ops
(:mod:`.torch_kernels`) are built into their caches once; a later process finds them there and
starts at once. Each line says what was built (or found) where, or why it was not; a build that
fails warns as the first call would. The caches' keys cover every C++ source, the flags and the
compiler, so after an upgrade that changes a source the next call (or this command) builds again.
"""

from __future__ import annotations

import importlib.util
from typing import TextIO


def _numpy(out: TextIO) -> bool:
    from .numpy import kernels

    if not kernels.enabled():
        print("numpy: the CPU kernels are off here (an x86-64 CPU with AVX2 and FMA, PORTABLE_SSM_CPU_KERNELS "
              "not 0)", file=out)
        return True
    built = kernels.library() is not None
    cxx = kernels.compiler()
    where = kernels.library_path(cxx) if cxx is not None else "no C++ compiler"
    print(f"numpy: {'ready' if built else 'not built (see the warning)'}: {where}", file=out)
    return built


def _torch(out: TextIO) -> bool:
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed, nothing to build", file=out)
        return True
    from . import torch_kernels

    if not torch_kernels.enabled():
        print("torch: the CPU kernels are off here (an x86-64 CPU with AVX2, PORTABLE_SSM_CPU_KERNELS not 0)",
              file=out)
        return True
    built = torch_kernels.ensure()
    name = "portable_ssm_cpu_" + torch_kernels.source_key(*torch_kernels.CFLAGS)
    print(f"torch: {'ready' if built else 'not built (see the warning)'}: {torch_kernels.build_folder(name) or name}",
          file=out)
    return built


def build_kernels(out: TextIO) -> int:
    """Builds (or finds cached) every CPU kernel this machine can use, one line each on ``out``;
    returns 0 where every one that may be used here is ready, 1 where a build failed."""
    ready = [_numpy(out), _torch(out)]
    return 0 if all(ready) else 1
