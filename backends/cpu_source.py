"""What the CPU kernels of two backends share: the switch that turns them off, the compiler's SIMD
flags and the C++ sources (package data under ``backends/cpu/``) with the key that names a build.

``cpu/shared.h`` holds the SIMD helpers and pointer-level loops (AVX2 and FMA), written once:
``cpu/torch_ops.cpp`` builds them into torch ops (:mod:`portable_ssm.backends.torch_kernels`, with
``at::parallel_for`` over the rows), ``cpu/numpy_kernels.cpp`` into a plain shared library that
NumPy's native paths call through ctypes (:mod:`portable_ssm.backends.numpy.kernels`, its thread
pool over the rows); both call ``conv_silu_steps`` and ``norm_rows`` for the conv with SiLU and the
gated RMSNorm, ``row_products`` for a batch-1 decode step's products with float32, int8 or bfloat16
weights and ``scan_forward_item`` (with their own matrix product) for the chunked scan, over work
items of :func:`head_block` heads, so the two backends compute them with the same code. A build is
named by :func:`source_key`, which covers every source file's name and contents and the flags, so a
changed header builds both again."""

import hashlib
from pathlib import Path

#: The folder of the C++ sources: ``shared.h`` and one ``.cpp`` file per backend.
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
#: The environment variable that turns the kernels off (``0``); anything else leaves them on.
ENV = "PORTABLE_SSM_CPU_KERNELS"

#: The compiler's flags for both: AVX2 and FMA code, optimized.
SIMD_FLAGS = ("-O3", "-mavx2", "-mfma")


def head_block(b: int, g: int, h: int, threads: int, most: int) -> int:
    """Heads per work item of ``scan_forward_item`` (at most ``most`` of one group, so the item's
    state and diagonal blocks stay in L2): as many items per group as give each of ``threads`` one."""
    per_group = -(-threads // max(b * g, 1))
    return max(1, min(most, -(-(h // g) // per_group)))


def source_files() -> list[Path]:
    """Every C++ source of the CPU kernels (``.h`` and ``.cpp`` under :data:`SOURCE_DIR`), by name."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".h", ".cpp"))


def source_path(name: str) -> Path:
    """The C++ source ``name`` (``torch_ops.cpp`` or ``numpy_kernels.cpp``) under :data:`SOURCE_DIR`;
    FileNotFoundError naming it where it is missing (the package data was not installed)."""
    path = SOURCE_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} is missing: the package data was not installed "
                                f"(pyproject.toml's package-data must list cpu/*.cpp and cpu/*.h)")
    return path


def source_key(*flags: str) -> str:
    """16 hex digits of the sha256 of every source file's name and contents and ``flags``: the key a
    build is cached under, so any change to a source or a flag builds again."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:16]
