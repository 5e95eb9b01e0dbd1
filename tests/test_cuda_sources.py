"""The CUDA sources of the CuPy kernels, checked without a GPU or cupy.

* every ``.cu`` file, and the inlined text NVRTC gets, compiles to PTX with ``nvcc`` for sm_80 and
  sm_90 (skipped with a reason when ``nvcc`` is not on PATH), and includes no system header;
* the package data is found by the loader without importing cupy, importing the backend without
  cupy fails with an ImportError naming cupy, and the switch is read from the environment.

It also holds :class:`HostEmulator`, which compiles the ``.cu`` files with the host C++ compiler
against a small CUDA shim (one host thread per CUDA thread of a block, blocks in turn,
``__syncthreads`` as a barrier, warp shuffles through a buffer, shared memory poisoned with NaN
between blocks) and launches them on NumPy arrays through ``ctypes``, checking each argument's
dtype, contiguity and the guard bytes around it. ``test_cupy_kernels.py`` runs every kernel test on
it as well as on a real GPU.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from portable_ssm import backends

PACKAGE = "portable_ssm.backends.cupy"
PACKAGE_DIR = Path(backends.__file__).resolve().parent / "cupy"


def import_without_cupy(module: str) -> types.ModuleType:
    """``portable_ssm.backends.cupy.<module>`` for a module that does not need cupy. Without cupy the
    package's ``__init__`` (which imports cupy) is bypassed by a stand-in package, removed afterwards."""
    name = f"{PACKAGE}.{module}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    stand_in = types.ModuleType(PACKAGE)
    stand_in.__path__ = [str(PACKAGE_DIR)]
    sys.modules[PACKAGE] = stand_in
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules[PACKAGE]


sources = import_without_cupy("sources")


# --- host emulation of the kernels -------------------------------------------------------------

_SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };

namespace emu {
inline dim3 grid_dim, block_dim;
inline thread_local dim3 thread_idx, block_idx;
inline std::barrier<>* block_barrier = nullptr;
inline double shuffle_slots[1024];
constexpr unsigned long long kSharedBytes = 1 << 16;
}  // namespace emu

// The kernels declare their dynamic shared memory as `extern __shared__ double shared_raw[];`.
alignas(16) double shared_raw[emu::kSharedBytes / sizeof(double)];

#define gridDim emu::grid_dim
#define blockDim emu::block_dim
#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __restrict__ __restrict

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, sizeof f); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, sizeof u); return u; }

// Every thread of the block must call it (the kernels do): the lanes exchange through a buffer.
template <typename V> V __shfl_xor_sync(unsigned, V v, int lane_mask) {
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    emu::shuffle_slots[t] = static_cast<double>(v);
    __syncthreads();
    const V out = static_cast<V>(emu::shuffle_slots[t ^ static_cast<unsigned>(lane_mask)]);
    __syncthreads();
    return out;
}

namespace emu {
template <class Body> void launch(dim3 grid, dim3 block, unsigned long long shared_bytes, Body body) {
    if (shared_bytes > kSharedBytes) std::abort();
    grid_dim = grid;
    block_dim = block;
    const unsigned n = block.x * block.y * block.z;
    std::barrier<> barrier(n);
    block_barrier = &barrier;
    std::memset(shared_raw, 0xff, sizeof shared_raw);  // all-ones bits: NaN in every float format
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
            thread_idx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        block_idx = dim3{x, y, z};
                        body();
                        barrier.arrive_and_wait();
                        if (t == 0) std::memset(shared_raw, 0xff, sizeof shared_raw);
                        barrier.arrive_and_wait();
                    }
        });
    }
    for (auto& thread : threads) thread.join();
}
}  // namespace emu
"""

_POINTEE = {"float": ("float32",), "double": ("float64",), "half_bits": ("float16",),
            "bf16_bits": ("uint16", "int16"), "long long": ("int64",)}
_SCALAR = {"float": (ctypes.c_float, "float32"), "double": (ctypes.c_double, "float64"),
           "int": (ctypes.c_int, "int32"), "long long": (ctypes.c_longlong, "int64")}
_GUARD = 64  # bytes of 0xff before and after every array argument


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def _scratch_dir() -> Path:
    """A temporary directory removed when the test process exits."""
    path = Path(tempfile.mkdtemp(prefix="portable_ssm_emu_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def host_toolchain_problem() -> str | None:
    """Why the host emulation cannot build here (no C++20 compiler), or None."""
    compiler = _compiler()
    if compiler is None:
        return "no host C++ compiler (g++/c++) on PATH"
    work = _scratch_dir()
    (work / "probe.cpp").write_text(_SHIM + "int main() { return 0; }\n")
    done = subprocess.run([compiler, "-std=c++20", "-pthread", "probe.cpp", "-o", "probe"], cwd=work,
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"the host compiler lacks C++20 <barrier>: {done.stderr[-300:]}"


class HostEmulator:
    """``ops.Launch`` on the CPU: runs the ``.cu`` kernels on NumPy arrays (see the module docstring)."""

    def __init__(self) -> None:
        self._work = _scratch_dir()
        self._libraries: dict[str, tuple[ctypes.CDLL, dict[str, list[tuple[str, str, bool]]]]] = {}

    def _signatures(self, path: Path) -> dict[str, list[tuple[str, str, bool]]]:
        """``{kernel: [(C type, name, is_pointer), ...]}`` from the preprocessed source."""
        text = subprocess.run([_compiler(), "-E", "-P", "-x", "c++", "-D__global__=", "-D__device__=",
                               "-D__forceinline__=inline", "-D__restrict__=", str(path)],
                              check=True, capture_output=True, text=True).stdout
        kernels = {}
        for name, params in re.findall(r'extern "C" void (\w+)\s*\(([^)]*)\)', text):
            parsed = []
            for param in params.split(","):
                ctype, pname = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*", param).groups()
                pointer = ctype.endswith("*")
                parsed.append((ctype.replace("const", "").rstrip("*").strip(), pname, pointer))
            kernels[name] = parsed
        return kernels

    def _library(self, source: str) -> tuple[ctypes.CDLL, dict[str, list[tuple[str, str, bool]]]]:
        if source not in self._libraries:
            path = sources.source_path(source)
            kernels = self._signatures(path)
            wrappers = []
            for name, params in kernels.items():
                decl = ", ".join(f"{t}{'*' if p else ''} {n}" for t, n, p in params)
                wrappers.append(
                    f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                    f"unsigned by, unsigned bz, unsigned long long smem, {decl}) {{\n"
                    f"  emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, smem, [=] {{ "
                    f"{name}({', '.join(n for _, n, _ in params)}); }});\n}}\n")
            unit = self._work / f"{source}.cpp"
            unit.write_text(_SHIM + f'#include "{path}"\n' + "".join(wrappers))
            library = self._work / f"{source}.so"
            subprocess.run([_compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(unit),
                            "-o", str(library)], check=True, capture_output=True, text=True)
            self._libraries[source] = (ctypes.CDLL(str(library)), kernels)
        return self._libraries[source]

    def __call__(self, source: str, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: tuple[Any, ...], shared_mem: int) -> None:
        library, kernels = self._library(source)
        params = kernels[kernel]
        assert len(args) == len(params), f"{kernel}: {len(args)} arguments for {len(params)} parameters"
        assert block[0] % 32 == 0 and block[1] == block[2] == 1, f"{kernel}: block {block}"
        values, ctypes_args, guarded = [], [], []
        for (ctype, name, pointer), arg in zip(params, args):
            if pointer:
                assert isinstance(arg, np.ndarray), f"{kernel}: {name} is a {type(arg).__name__}"
                assert arg.dtype.name in _POINTEE[ctype], f"{kernel}: {name} is {arg.dtype}, wants {ctype}*"
                assert arg.flags.c_contiguous, f"{kernel}: {name} is not C-contiguous"
                buffer = np.full(arg.nbytes + 2 * _GUARD, 0xFF, np.uint8)
                inner = buffer[_GUARD:_GUARD + arg.nbytes].view(arg.dtype).reshape(arg.shape)
                inner[...] = arg
                guarded.append((name, arg, buffer, inner))
                values.append(inner.ctypes.data)
                ctypes_args.append(ctypes.c_void_p)
            else:
                ctype_class, dtype = _SCALAR[ctype]
                assert isinstance(arg, np.generic) and arg.dtype.name == dtype, \
                    f"{kernel}: {name} is {type(arg).__name__}, wants a numpy {dtype} scalar"
                values.append(arg.item())
                ctypes_args.append(ctype_class)
        function = getattr(library, f"emu_{kernel}")
        function.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_ulonglong] + ctypes_args
        function(*grid, *block, shared_mem, *values)
        for name, arg, buffer, inner in guarded:
            outside = np.concatenate([buffer[:_GUARD], buffer[-_GUARD:]])
            assert (outside == 0xFF).all(), f"{kernel}: wrote outside {name}"
            arg[...] = inner


@functools.cache
def host_emulator() -> HostEmulator:
    """One emulator per process, so each ``.cu`` family compiles once."""
    return HostEmulator()


# --- the sources compile ------------------------------------------------------------------------

def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH (the CUDA toolkit is needed to compile-check the kernels)")
    return nvcc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sources.SOURCES)
def test_every_cu_source_compiles_to_ptx_with_nvcc(name: str, arch: str, tmp_path: Path) -> None:
    done = subprocess.run([_nvcc(), "--ptx", f"-arch={arch}", "-Werror", "all-warnings",
                           str(sources.source_path(name)), "-o", str(tmp_path / f"{name}.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ".entry" in (tmp_path / f"{name}.ptx").read_text()


@pytest.mark.parametrize("name", sources.SOURCES)
def test_the_text_nvrtc_compiles_is_self_contained_and_compiles(name: str, tmp_path: Path) -> None:
    text = sources.kernel_source(name)
    assert not re.search(r"^\s*#include", text, re.MULTILINE), "NVRTC gets no include path: inline them all"
    assert 'extern "C" __global__' in text
    (tmp_path / f"{name}.cu").write_text(text)
    done = subprocess.run([_nvcc(), "--ptx", "-arch=sm_80", f"{name}.cu", "-o", f"{name}.ptx"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sources_include_only_local_headers() -> None:
    files = sorted(sources.KERNEL_DIR.glob("*.cu*"))
    assert {p.stem for p in files if p.suffix == ".cu"} == set(sources.SOURCES)
    for path in files:
        includes = re.findall(r"^#include\s+(\S+)", path.read_text(), re.MULTILINE)
        assert all(i.startswith('"') for i in includes), f"{path.name} includes {includes}: NVRTC has no " \
                                                          f"host headers"


# --- packaging and the switch -------------------------------------------------------------------

def test_kernel_sources_are_found_in_the_installed_package_without_cupy() -> None:
    assert sources.KERNEL_DIR == PACKAGE_DIR / "kernels"
    for name in sources.SOURCES:
        assert sources.source_path(name).is_file()
    with pytest.raises(ValueError, match="name: expected one of conv1d, decode, ssd, got 'scan'"):
        sources.source_path("scan")


def test_importing_the_backend_without_cupy_raises_import_error_naming_cupy(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if cupy were not installed
    monkeypatch.delitem(sys.modules, PACKAGE, raising=False)
    with pytest.raises(ImportError, match="cupy") as info:
        importlib.import_module(PACKAGE)
    assert info.value.name == "cupy"
    with pytest.raises(ImportError, match="backend 'cupy' needs cupy: pip install 'portable-ssm\\[cupy\\]'"):
        backends.load("cupy")


@pytest.mark.parametrize(("value", "enabled"), [(None, False), ("0", False), ("1", True), ("yes", False)])
def test_kernels_are_enabled_only_by_the_switch_set_to_one(value: str | None, enabled: bool,
                                                            monkeypatch: Any) -> None:
    if value is None:
        monkeypatch.delenv(sources.SWITCH, raising=False)
    else:
        monkeypatch.setenv(sources.SWITCH, value)
    assert sources.SWITCH == "PORTABLE_SSM_CUPY_KERNELS"
    assert sources.kernels_enabled() is enabled


def test_gpu_benchmark_exits_with_a_clear_message_and_writes_nothing_without_a_gpu(tmp_path: Path) -> None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present: benchmarks/gpu.sh runs the benchmark for real")
    except (ImportError, RuntimeError):
        pass
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"
    out = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "gpu_bench: needs CuPy and an NVIDIA GPU" in done.stderr
    assert not out.exists()
