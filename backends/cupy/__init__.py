"""CuPy: the raw-GPU backend (no PyTorch needed). The core runs on CuPy arrays as written.

Fast paths: fused CUDA kernels for the causal conv1d over a sequence, the chunked scan (its
non-matmul parts; the matmuls run in cuBLAS) and the one-token decode step of a layer. Their
sources are package data (``kernels/*.cu``, see :mod:`.sources`), compiled with NVRTC through
``cupy.RawModule`` on first use and cached by CuPy; :class:`.ops.KernelSet` validates, sizes and
launches them, :mod:`.reference` holds the array-API twins they are tested against, and
:mod:`.torch_ops` runs them on CUDA torch tensors.

The kernels are registered in ``FAST_OPS`` only when ``PORTABLE_SSM_CUPY_KERNELS=1`` is set (read
in :func:`.sources.kernels_enabled`): they compile with nvcc and pass the tests under host
emulation, but are not yet verified on a GPU. :data:`KERNELS` stays usable directly either way.
"""

from __future__ import annotations

from typing import Any

try:
    import cupy
except ImportError as err:
    raise ImportError("portable_ssm.backends.cupy needs cupy (an NVIDIA GPU and "
                      "pip install 'portable-ssm[cupy]')", name="cupy") from err
import array_api_compat.cupy as xp
import numpy as np

from .ops import KernelSet
from .sources import kernel_source, kernels_enabled


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    if name == "bfloat16":
        raise TypeError("dtype: cupy has no bfloat16 array dtype; use float16, float32 or float64")
    return getattr(cupy, name)


def _device(device: Any) -> cupy.cuda.Device:
    if device is None:
        return cupy.cuda.Device()
    if isinstance(device, str):
        platform, _, index = device.partition(":")
        if platform not in ("cuda", "gpu"):
            raise ValueError(f"device: cupy arrays live on 'cuda:N', got {device!r}")
        return cupy.cuda.Device(int(index or 0))
    return device if isinstance(device, cupy.cuda.Device) else cupy.cuda.Device(int(device))


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    with _device(device):
        out = cupy.asarray(np.asarray(host))
        return out if dtype_name is None else out.astype(dtype(dtype_name), copy=False)


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    with _device(device if device is not None else x.device):
        out = cupy.asarray(x)
        return out if dtype_name is None else out.astype(dtype(dtype_name), copy=False)


def to_numpy(x: Any) -> np.ndarray:
    return cupy.asnumpy(x)


class _RawModules:
    """The ``launch`` of :class:`.ops.KernelSet` on CuPy: each ``.cu`` family becomes one
    ``cupy.RawModule`` per device on first use (CuPy caches the compiled binary on disk too)."""

    def __init__(self) -> None:
        self._modules: dict[tuple[str, int], Any] = {}

    def __call__(self, source: str, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: tuple[Any, ...], shared_mem: int) -> None:
        key = (source, cupy.cuda.runtime.getDevice())
        module = self._modules.get(key)
        if module is None:
            module = self._modules[key] = cupy.RawModule(code=kernel_source(source))
        module.get_function(kernel)(grid, block, args, shared_mem=shared_mem)


#: Launches the kernels of a ``.cu`` family on the current device and stream.
LAUNCH = _RawModules()
#: The kernels on CuPy arrays.
KERNELS = KernelSet(cupy, LAUNCH)

FAST_OPS: dict[str, Any] = {}
if kernels_enabled():
    FAST_OPS.update(causal_conv1d=KERNELS.causal_conv1d, ssd_chunked=KERNELS.ssd_chunked,
                    decode_step=KERNELS.decode_step)
