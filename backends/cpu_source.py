"""What the CPU kernels of two backends share: the switch that turns them off, the compiler's SIMD
flags and the C++ sources (package data under ``backends/cpu/``) with the key that names a build.

``cpu/shared.h`` holds the SIMD helpers and pointer-level loops (AVX2 and FMA), written once:
``cpu/torch_ops.cpp`` builds them into torch ops (:mod:`portable_ssm.backends.torch_kernels`, with
``at::parallel_for`` over the rows), ``cpu/numpy_kernels.cpp`` into a plain shared library that
NumPy's native paths call through ctypes (:mod:`portable_ssm.backends.numpy.kernels`, its thread
pool over the rows); both call ``conv_silu_steps`` and ``norm_rows`` for the conv with SiLU and the
gated RMSNorm, ``row_products`` for a batch-1 decode step's products with float32, int8 or bfloat16
weights and ``scan_forward_item`` (with their own matrix product) for the chunked scan, over work
items of :func:`head_block` heads, and ``cpu/decode_model.h``'s ``decode_model_run`` for a language
model's whole batch-1 decode step, so the two backends compute them with the same code.
:data:`ISA_ENV` picks the instruction set they are built for (:func:`isa`). A build is
named by :func:`source_key`, which covers every source file's name and contents and the flags, so a
changed header builds both again."""

import hashlib
import os
import warnings
from functools import lru_cache
from pathlib import Path

#: The folder of the C++ sources: ``shared.h`` and one ``.cpp`` file per backend.
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
#: The environment variable that turns the kernels off (``0``); anything else leaves them on.
ENV = "PORTABLE_SSM_CPU_KERNELS"

#: The environment variable that picks the instruction set the kernels are built for: ``auto`` (the
#: default: the AVX2 build, whose int8 products with no -128 go through AVX-512 VNNI where the CPU
#: has it, chosen at run time), ``avx2`` (AVX2 and FMA code only: the switch that runs the AVX2
#: path on an AVX-512 machine) or ``avx512`` (the same source compiled for AVX-512 F/BW/VL/DQ as
#: well, with the VNNI products: the compiler's own loops 512 bits wide and 32 vector registers;
#: only where the CPU has them, else the avx2 build with a warning). Each has its own build (the
#: flags are in the key).
ISA_ENV = "PORTABLE_SSM_CPU_ISA"
#: The instruction-set flags of each build :data:`ISA_ENV` names (``PORTABLE_SSM_VNNI``: the VNNI
#: products are compiled in, each function for AVX-512 VNNI by its own target attribute).
ISA_FLAGS = {"auto": ("-mavx2", "-mfma", "-DPORTABLE_SSM_VNNI"),
             "avx2": ("-mavx2", "-mfma"),
             "avx512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                        "-DPORTABLE_SSM_VNNI")}
#: The CPU features (as NumPy's dispatcher names them) each build needs.
ISA_FEATURES = {"auto": ("AVX2", "FMA3"), "avx2": ("AVX2", "FMA3"),
                "avx512": ("AVX2", "FMA3", "AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ")}


@lru_cache(maxsize=1)
def cpu_features() -> dict[str, bool]:
    """The CPU's features as NumPy's dispatcher found them (empty where NumPy does not say)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return {}
    return dict(features)


def isa() -> str:
    """The build :data:`ISA_ENV` asks for (``auto`` unset or empty); ValueError naming it for any
    other value; ``avx2`` with a warning where the CPU lacks a feature the asked one needs."""
    asked = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
    if asked not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}: expected one of {sorted(ISA_FLAGS)}, got {os.environ[ISA_ENV]!r}")
    features = cpu_features()
    missing = [f for f in ISA_FEATURES[asked] if not features.get(f)]
    if asked == "avx512" and missing:
        warnings.warn(f"portable_ssm: {ISA_ENV}={asked} but this CPU lacks {', '.join(missing)}; the kernels are "
                      "built for avx2", RuntimeWarning, stacklevel=2)
        return "avx2"
    return asked


def simd_flags() -> tuple[str, ...]:
    """The compiler's optimization and instruction-set flags for the build :func:`isa` picks."""
    return ("-O3", *ISA_FLAGS[isa()])


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
