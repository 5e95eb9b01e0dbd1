"""NumPy's compiled kernels: the float32 conv with SiLU, the gated RMSNorm, a gated MLP's SiLU, the
chunked scan and a decode step's product with a quantized weight.

NumPy's ufuncs make one pass over a tile per operation: the tiled conv with SiLU of :mod:`.ops`
takes about a dozen, the norm about ten, the scan's loop about twenty per group of chunks, and at
long prompts the three took half of a 130m layer's forward (63, 53 and 125 of 510 ms at l=8192 on 2
threads, ``benchmarks/numpy_profile.py``). These kernels are the C++ loops of torch's CPU kernels
(``conv_silu_steps``, ``norm_rows`` and ``scan_forward_item`` of ``backends/cpu/shared.h``, written
once for both backends) built from ``backends/cpu/numpy_kernels.cpp`` into a plain shared library
and called through ctypes, which releases the GIL for the call, so each worker of NumPy's pool
(:mod:`.threads`) runs its range of rows (or the scan's blocks of heads) on its own core. The scan's
matrix products go to the CBLAS ``sgemm`` of the OpenBLAS NumPy ships (:func:`.threads.blas_sgemm`,
held at one thread per worker); where none is found the scan stays NumPy's loop. In that forward
they took the conv to 13-22 ms, the norms to 23-24 and the scan to 71-89 (the same command, the same
VM). A batch-1 decode step's products with int8 or bfloat16 weights (one float32 row:
``row_products``, the row kernel of torch's decode) widen each weight as they read it, where NumPy's
path widens the weight tile by tile into float32 and multiplies those: the 130m LM's step went from
58 to 26 ms (int8) and from 84 to 33 ms (bfloat16) on a 2-core VM. Float32 weights keep OpenBLAS's
sgemv, which reads them about as fast as that kernel. The whole batch-1 step of a language model
goes through ``portable_ssm_decode_model`` (``decode_model_run`` of ``backends/cpu/decode_model.h``,
torch's whole-model step, one OpenMP region of :func:`.threads.workers` threads; :mod:`.decode`).
The market reader's chunks of DBN records take one pass each where NumPy's takes a dozen:
:func:`ohlcv_columns` writes an OHLCV chunk's columns in place and :func:`event_bars` cuts trades or
MBP-1 into bars, each making the reader's checks and leaving any chunk it would refuse to NumPy's
path (``portable_ssm.market.bars``), which names the record.

The library is compiled on first use with the C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``; a few seconds, once) and cached as ``numpy_kernels_<hash>.so`` under
``$PORTABLE_SSM_CACHE`` (default ``$XDG_CACHE_HOME/portable_ssm``, i.e. ``~/.cache/portable_ssm``), the
hash covering every source file, the flags (``PORTABLE_SSM_CPU_ISA`` picks the auto, avx2 or avx512 build,
:func:`.cpu_source.isa`) and the compiler, beside a record of its size and sha256
(:mod:`portable_ssm.backends.kernel_cache`: each written to a temporary file, fsync'd and renamed
into place). It is loaded only where it is a regular file of this user's, writable by no one else,
whose size and sha256 are the record's: anything else (a truncated file, which ``dlopen`` would map
and the first call would die of with SIGBUS, flipped bytes, a missing or lying record, a link, FIFO
or folder) is built again over, with one warning naming the file. The
kernels are used only where they can be: an x86-64 CPU with AVX2 and FMA (as NumPy reports its CPU features) and
``PORTABLE_SSM_CPU_KERNELS`` not ``0``. Where no compiler is found or the build fails, one warning
says why and NumPy's ufunc paths and scan loop stay; nothing else changes. Float64 always takes
those.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from functools import lru_cache
from pathlib import Path

import array_api_compat.numpy as xp
import numpy as np

from portable_ssm import ssd

from ..cpu_source import ENV, head_block, isa, simd_flags, source_key, source_path
from ..kernel_cache import CACHE_ENV as CACHE_ENV  # the cache folder's variable, as before
from ..kernel_cache import cache_dir, damage, locked, store
from .threads import blas_sgemm, row_ranges, run_all, workers

#: The library's C++ source under :data:`.cpu_source.SOURCE_DIR` (it includes ``shared.h``).
SOURCE_FILE = "numpy_kernels.cpp"

#: The flags after the SIMD ones (:func:`.cpu_source.simd_flags`): a position-independent shared
#: library with OpenMP (the whole-model decode step's parallel region, :mod:`.decode`).
LIBRARY_FLAGS = ("-std=c++17", "-shared", "-fPIC", "-fopenmp")
#: Heads per pass of the native scan (NumPy's loop and this one's work items): a block's state and a
#: chunk's decays stay in L2.
SCAN_HEAD_BLOCK = 12
#: Steps or rows a worker takes at least.
MIN_ROWS = 16
#: The quantized weight storage :func:`row_product` reads, by its kind number in the library.
WEIGHT_KINDS = {np.dtype(np.int8): 1, np.dtype(np.uint16): 2}

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "portable_ssm_conv_silu": [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT,
                               _INT],
    "portable_ssm_gated_rms_norm": [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT, ctypes.c_double,
                                    _INT, _INT],
    "portable_ssm_silu_gate": [_POINTER, _INT, _POINTER, _INT, _POINTER, _INT, _INT, _INT],
    "portable_ssm_masked_softmax": [_POINTER, _INT, _INT, ctypes.c_float, _POINTER, _INT, _INT, _INT, _POINTER],
    "portable_ssm_scan_forward": [_POINTER, _POINTER, ctypes.c_double, _INT, _INT],
    "portable_ssm_row_product": [_POINTER, _INT, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT],
    "portable_ssm_decode_model": [_POINTER, _POINTER, ctypes.c_double, ctypes.c_double, ctypes.c_double, _INT],
    "portable_ssm_decode_rows": [_POINTER, _POINTER, _POINTER, _POINTER, _INT, ctypes.c_double, ctypes.c_double,
                                 ctypes.c_double, _POINTER, _POINTER],
    "portable_ssm_decode_hybrid": [_POINTER, _POINTER, _POINTER, _INT],
    "portable_ssm_market_bar": [_POINTER, _POINTER, _INT, _INT, _POINTER],
    "portable_ssm_vnni_usable": [],
    "portable_ssm_event_bars": [_POINTER, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _POINTER, _POINTER, _POINTER],
    "portable_ssm_ohlcv_columns": [_POINTER, _INT, _INT, _INT, _INT, _INT, _POINTER, _INT] + [_POINTER] * 6,
}
_RESTYPES = {"portable_ssm_scan_forward": ctypes.c_double, "portable_ssm_vnni_usable": _INT,
             "portable_ssm_event_bars": _INT, "portable_ssm_ohlcv_columns": _INT}

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}  # per build (isa): the library or None, after its first attempt


@lru_cache(maxsize=1)
def _cpu_has_avx2() -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA, as NumPy's dispatcher found it (asked once:
    every decode step asks for the library)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return False
    return (platform.machine().lower() in ("x86_64", "amd64") and bool(features.get("AVX2"))
            and bool(features.get("FMA3")))


def enabled() -> bool:
    """Whether the kernels may be used here: not turned off by ``PORTABLE_SSM_CPU_KERNELS=0``, an
    x86-64 CPU with AVX2 and FMA."""
    return os.environ.get(ENV, "").strip() != "0" and _cpu_has_avx2()


def compiler() -> str | None:
    """The C++ compiler's path: ``$CXX`` (its first word) if set, else the first of ``c++``, ``g++``
    and ``clang++`` on the PATH, else None."""
    named = os.environ.get("CXX", "").split()
    for candidate in (named[:1] or ["c++", "g++", "clang++"]):
        found = shutil.which(candidate)
        if found is not None:
            return found
    return None


def library_path(cxx: str) -> Path:
    """Where the library built by ``cxx`` is cached: ``numpy_kernels_<key>.so`` under
    :func:`.kernel_cache.cache_dir`, the key (:func:`.cpu_source.source_key`) covering every source
    file, the flags, the compiler and the machine."""
    return cache_dir() / f"numpy_kernels_{source_key(*flags(), cxx, platform.machine())}.so"


def flags() -> tuple[str, ...]:
    """The compiler's flags for the build :func:`.cpu_source.isa` picks."""
    return (*simd_flags(), *LIBRARY_FLAGS)


def _build(cxx: str, target: Path) -> None:
    """Compile :data:`SOURCE_FILE` into a temporary folder, then store it as ``target`` with its record
    (:func:`.kernel_cache.store`: written whole, fsync'd, renamed; one process at a time)."""
    target.parent.mkdir(parents=True, exist_ok=True)  # first: an unwritable cache costs no compile
    source = source_path(SOURCE_FILE)
    print(f"portable_ssm: building NumPy's CPU kernels (once, a few seconds) into {target}", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory() as work:
        built = Path(work) / target.name
        result = subprocess.run([cxx, *flags(), str(source), "-o", str(built)], capture_output=True, text=True,
                                timeout=600, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(cxx).name} exited with {result.returncode}: "
                               f"{(result.stderr.strip().splitlines() or [''])[0]}")
        with locked(target):  # the library and its record from one build, never two
            store(target, built.read_bytes())


def _bind(path: Path) -> ctypes.CDLL:
    """The library at ``path`` loaded, its functions' signatures set."""
    library = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, _RESTYPES.get(name)
    return library


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _cached(cxx: str) -> tuple[ctypes.CDLL, str | None]:
    """The cached library, loaded only where :func:`.kernel_cache.damage` finds it whole, else built
    (again) first; with why the cached one was not loaded (None where it was, or was not there)."""
    target = library_path(cxx)
    reason = damage(target)
    if reason is None:
        try:
            return _bind(target), None
        except (OSError, AttributeError) as error:  # whole as written, yet no library of ours
            reason = f"it could not be loaded: {_first_line(error)}"
    try:
        _build(cxx, target)
        return _bind(target), None if reason == "missing" else reason
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as error:
        if reason == "missing":
            raise
        raise RuntimeError(f"the cached {target} was damaged ({reason}), building it again: "
                           f"{_first_line(error)}") from error


def _load() -> ctypes.CDLL | None:
    """The library, built first where it is not cached whole yet; None (and a warning why) where it
    cannot be. A damaged cached library is built again over with one warning naming it."""
    cxx = compiler()
    try:
        if cxx is None:
            raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
        library, damaged = _cached(cxx)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as error:
        warnings.warn(f"portable_ssm: NumPy's CPU kernels could not be built ({_first_line(error)}); NumPy's conv, "
                      f"norm and scan use its ufuncs and loop (set {ENV}=0 to skip the attempt)", RuntimeWarning,
                      stacklevel=4)
        return None
    if damaged is not None:
        warnings.warn(f"portable_ssm: the cached NumPy kernel library {library_path(cxx)} was damaged ({damaged}); "
                      "it was built again", RuntimeWarning, stacklevel=4)
    return library


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they may not or could not be used (built once per process)."""
    if not enabled():
        return None
    build = isa()
    loaded = _LOADED.get(build, False)
    if loaded is not False:
        return loaded
    with _LOCK:
        if build not in _LOADED:
            _LOADED[build] = _load()
    return _LOADED[build]


def _float32_channels(a: np.ndarray) -> bool:
    """Whether the kernels can read ``a`` through its pointer: float32, native byte order, aligned,
    channels (its last axis) contiguous and every other stride a whole number of floats."""
    return (a.dtype == np.float32 and a.dtype.isnative and a.flags.aligned
            and (a.shape[-1] <= 1 or a.strides[-1] == 4) and all(s % 4 == 0 for s in a.strides))


def conv_silu(x: np.ndarray, taps: np.ndarray, bias: np.ndarray | None, history: np.ndarray) -> np.ndarray | None:
    """``silu(causal depthwise conv)`` of ``x [b, l, d]`` (channels contiguous, read in place) after
    ``history [b, k-1, d]``, with ``taps [k, d]`` and ``bias [d]`` or None (any layout: copied where
    not contiguous), all float32 -> ``y [b, l, d]``; None where the kernels are not usable, an input
    is not float32 or x is not laid out as they read it."""
    lib = library()
    b, l, d = x.shape
    k = taps.shape[0]
    copied = (taps, history, *(() if bias is None else (bias,)))  # small: made contiguous here
    if lib is None or not _float32_channels(x) or any(a.dtype != np.float32 for a in copied):
        return None
    taps, history = np.ascontiguousarray(taps), np.ascontiguousarray(history)
    bias = None if bias is None else np.ascontiguousarray(bias)
    y = np.empty((b, l, d), dtype=np.float32)
    if y.size == 0:
        return y
    run_all(lambda part: lib.portable_ssm_conv_silu(
        x.ctypes.data, x.strides[0] // 4, x.strides[1] // 4, history.ctypes.data, taps.ctypes.data,
        None if bias is None else bias.ctypes.data, y.ctypes.data, l, d, k, part[0], part[1]),
        row_ranges(b * l, MIN_ROWS))
    return y


def gated_rms_norm(y: np.ndarray, z: np.ndarray | None, weight: np.ndarray, groups: int,
                   eps: float) -> np.ndarray | None:
    """``rmsnorm(y · silu(z)) ⊙ weight`` per group of ``d / groups`` channels for ``y, z [rows, d]``
    (channels contiguous, rows read in place) and ``weight [d]`` (copied where not contiguous), all
    float32 -> ``[rows, d]``; None where the kernels are not usable, an input is not float32 or y or z
    is not laid out as they read it."""
    lib = library()
    rows, d = y.shape
    if (lib is None or weight.dtype != np.float32
            or not all(_float32_channels(a) for a in (y, *(() if z is None else (z,))))):
        return None
    weight = np.ascontiguousarray(weight)
    out = np.empty((rows, d), dtype=np.float32)
    if out.size == 0:
        return out
    run_all(lambda part: lib.portable_ssm_gated_rms_norm(
        y.ctypes.data, y.strides[0] // 4, None if z is None else z.ctypes.data, 0 if z is None else z.strides[0] // 4,
        weight.ctypes.data, out.ctypes.data, d, d // groups, eps, part[0], part[1]), row_ranges(rows, MIN_ROWS))
    return out


def silu_gate(y: np.ndarray, z: np.ndarray) -> np.ndarray | None:
    """``y · silu(z)`` of ``y, z [rows, f]`` (channels contiguous, rows read in place where they are
    apart) -> ``[rows, f]`` float32, in one pass over both workers (NumPy's ufuncs take five, one
    thread); None where the kernels are not usable or an input is not float32 laid out as they read it."""
    lib = library()
    if lib is None or y.ndim != 2 or y.shape != z.shape or not (_float32_channels(y) and _float32_channels(z)):
        return None
    rows, f = y.shape
    out = np.empty((rows, f), dtype=np.float32)
    if out.size == 0:
        return out
    run_all(lambda part: lib.portable_ssm_silu_gate(y.ctypes.data, y.strides[0] // 4, z.ctypes.data, z.strides[0] // 4,
                                                    out.ctypes.data, f, part[0], part[1]), row_ranges(rows, MIN_ROWS))
    return out


def gated_silu(u: np.ndarray) -> np.ndarray | None:
    """``silu(gate) · up`` of a gated MLP's up projection ``u [rows, 2f]`` (each row ``[gate; up]``)
    -> ``[rows, f]`` float32: :func:`silu_gate` of its halves."""
    if u.ndim != 2 or u.shape[1] % 2:
        return None
    f = u.shape[1] // 2
    return silu_gate(u[:, f:], u[:, :f])


def masked_softmax(scores: np.ndarray, scale: float, visible: np.ndarray, first: int) -> np.ndarray | None:
    """Attention scores ``[rows, cols]`` (float32, contiguous) made, in place and on the calling
    thread, their softmax's numerators ``exp(scale·s - top)`` in the columns each row sees (exactly
    0 elsewhere, ``top`` the row's largest seen ``scale·s``); returns ``1 / sum`` per row ``[rows]``.
    Every row sees the columns below ``first``; ``visible [period, cols - first]`` (bool, rows
    contiguous) says which later ones row ``r`` sees, by its row ``r % period``. Two passes over
    the scores where NumPy's ufuncs take six; None where the kernels are not usable or the arrays
    are not laid out so."""
    lib = library()
    rows, cols = scores.shape
    period = visible.shape[0]
    if (lib is None or scores.dtype != np.float32 or not scores.flags.c_contiguous or visible.dtype != np.bool_
            or visible.shape[1] != cols - first or visible.strides[1] != 1 or period == 0 or rows % period):
        return None
    inv = np.empty(rows, dtype=np.float32)
    lib.portable_ssm_masked_softmax(scores.ctypes.data, rows, cols, scale, visible.ctypes.data, visible.strides[0],
                                    period, first, inv.ctypes.data)
    return inv


def event_bars(records: np.ndarray, rtype: int, mbp: bool, chosen: int, first: int, interval: int,
               state: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """One chunk of DBN trade or MBP-1 ``records [n]`` (``mbp``; the layout of
    ``portable_ssm.market.dbn``, the first at file index ``first``) cut into bars of ``interval`` ns
    in one pass: ``(buckets [k] int64, bars [6, k] float64)`` (bucket, open, high, low, close,
    volume), the arithmetic of ``portable_ssm.market.bars``'s NumPy path bit for bit. ``state``
    (int64 ``[3]``: the instrument read or -1, the last ts_event read and its index) is read and
    updated; ``chosen`` the instrument asked for (-1: the file's only one). None, ``state`` as it
    was, where the kernels are not usable or the chunk holds anything for the NumPy path to report
    (a bad record, a second instrument, time order, a price beyond 2**53 units)."""
    lib = library()
    if lib is None or not records.flags.c_contiguous:
        return None
    n = records.shape[0]
    buckets, bars = np.empty(n, dtype=np.int64), np.empty((6, n))  # [n], [6, n]: at most a bar per record
    k = lib.portable_ssm_event_bars(records.ctypes.data, n, records.dtype.itemsize, rtype, int(mbp), chosen, first,
                                    interval, state.ctypes.data, buckets.ctypes.data, bars.ctypes.data)
    return None if k < 0 else (buckets[:k].copy(), bars[:, :k].copy())  # not views of [n]: bars are kept


#: The columns :func:`ohlcv_columns` writes, in its arguments' order, and their dtypes.
OHLCV_COLUMNS = {"ts_event": np.dtype(np.int64), "open": np.dtype(np.float64), "high": np.dtype(np.float64),
                 "low": np.dtype(np.float64), "close": np.dtype(np.float64), "volume": np.dtype(np.int64)}


def ohlcv_columns(records: np.ndarray, rtype: int, chosen: int, first: int, state: np.ndarray,
                  out: dict[str, np.ndarray], at: int) -> int | None:
    """One chunk of DBN OHLCV ``records [n]`` (the first at file index ``first``) as the columns of
    ``portable_ssm.market.bars`` in one pass, written into ``out`` (:data:`OHLCV_COLUMNS`,
    contiguous, room for ``n`` rows from row ``at``): how many rows, the NumPy path's values bit
    for bit. ``state`` and ``chosen`` as :func:`event_bars`'s. None, ``state`` as it was, where the
    kernels are not usable or the chunk holds anything for the NumPy path to report."""
    lib = library()
    n = records.shape[0]
    if (lib is None or not records.flags.c_contiguous or any(
            out[name].dtype != dtype or not out[name].flags.c_contiguous or out[name].shape[0] < at + n
            for name, dtype in OHLCV_COLUMNS.items())):
        return None
    m = lib.portable_ssm_ohlcv_columns(records.ctypes.data, n, records.dtype.itemsize, rtype, chosen, first,
                                       state.ctypes.data, at, *(out[name].ctypes.data for name in OHLCV_COLUMNS))
    return None if m < 0 else m


def vnni_products() -> bool:
    """Whether the library's int8 products of weights holding no -128 (a plan's ``INT8_SYMMETRIC``
    kind, :mod:`.decode`) go through AVX-512 VNNI: the auto or avx512 build on a CPU with it."""
    lib = library()
    return lib is not None and bool(lib.portable_ssm_vnni_usable())


def row_product(row: np.ndarray, weight: np.ndarray, scale: np.ndarray | None) -> np.ndarray | None:
    """``row [1, in] @ weight.T`` (times ``scale [out]`` per output, where given) -> ``[1, out]``
    float32, for a batch-1 decode step's quantized weight: ``weight [out, in]`` int8 or bfloat16 bits
    (``uint16``), contiguous, each value widened as it is read (``row_products`` of the shared
    source; float32 sums, the row never rounded). On the calling thread: NumPy's pool takes about
    0.1 ms to hand a call over on the 2-core VM, as long as a third of a layer's product, and the
    130m LM's step was no faster split over it. None where the kernels are not usable, row is not a
    float32 ``[1, in]``, the weight of another storage or layout, or scale not float32 ``[out]``."""
    lib = library()
    out, n = weight.shape
    kind = WEIGHT_KINDS.get(weight.dtype)
    if (lib is None or kind is None or row.dtype != np.float32 or row.shape != (1, n)
            or not (weight.flags.c_contiguous and weight.flags.aligned and weight.dtype.isnative)
            or (scale is not None and (scale.dtype != np.float32 or scale.shape != (out,)))):
        return None
    x = np.ascontiguousarray(row[0])
    scale = None if scale is None else np.ascontiguousarray(scale)
    y = np.zeros((1, out), dtype=np.float32)
    if y.size and n:
        lib.portable_ssm_row_product(weight.ctypes.data, kind, x.ctypes.data,
                                     None if scale is None else scale.ctypes.data, y.ctypes.data, out, n, 0, out)
    return y


def _packed_rows(a: np.ndarray) -> np.ndarray:
    """``a [b, l, u, v]`` as the scan reads it: itself where it is float32 with packed ``[u, v]`` rows
    whose steps are at least a row apart (a slice of the conv's output, read in place), else a copy."""
    b, l, u, v = a.shape
    if _float32_channels(a) and a.strides[2] == 4 * v and a.strides[1] >= 4 * u * v:
        return a
    return np.array(a, dtype=np.float32, order="C")  # a fresh array: steps exactly a row apart


def ssd_chunked(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray, chunk: int,
                initial_states: np.ndarray | None, D: np.ndarray | None,
                most_heads: int = SCAN_HEAD_BLOCK) -> tuple[np.ndarray, np.ndarray] | None:
    """The chunked scan ``(y [b, l, h, p], final state [b, h, p, n])`` of float32 ``x [b, l, h, p]``, Δ
    ``[b, l, h]``, A ``[h]``, B, C ``[b, l, g, n]``, D ``[h]``, ``[h, p]`` or None and initial states
    ``[b, h, p, n]`` or None in chunks of ``chunk`` steps, as :func:`.ops.ssd_chunked` computes it, in
    one C++ pass per block of heads (``scan_forward_item`` of the shared source, the kernel torch's
    CPU scan runs), the blocks over the pool and each chunk's products through the CBLAS sgemm of
    NumPy's own BLAS (:func:`.threads.blas_sgemm`), in blocks of at most ``most_heads`` heads (the
    caller's :data:`SCAN_HEAD_BLOCK`). A non-finite output (a non-finite input) runs it
    again with masked products, which keep it from the outputs before its step, as NumPy's loop
    does. None where the kernels or that sgemm are not usable, an input is not float32, or a size is 0."""
    lib, sgemm = library(), blas_sgemm()
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    inputs = (x, dt, A, B, C, *(v for v in (D, initial_states) if v is not None))
    if lib is None or sgemm is None or min(b, l, h, p, n) == 0 or any(v.dtype != np.float32 for v in inputs):
        return None
    x, B, C = _packed_rows(x), _packed_rows(B), _packed_rows(C)
    dt, A = np.ascontiguousarray(dt), np.ascontiguousarray(A)
    D = None if D is None else np.ascontiguousarray(D)
    initial_states = None if initial_states is None else np.ascontiguousarray(initial_states)
    y = np.empty((b, l, h, p), dtype=np.float32)
    final = np.empty((b, h, p, n), dtype=np.float32)
    block = head_block(b, g, h, workers(), most_heads)
    items = b * g * -(-(h // g) // block)
    address, ilp64 = sgemm
    pointers = (ctypes.c_void_p * 10)(*(None if v is None else v.ctypes.data
                                        for v in (x, dt, A, B, C, D, initial_states, y, final)), address)
    floor = float(ssd.decay_floor(np.float32, xp=xp))
    strides = (s // 4 for s in (*x.strides[:2], *B.strides[:2], *C.strides[:2]))  # xr, xl, br, bl, cr, cl
    sizes = (ctypes.c_int64 * 17)(b, l, h, p, g, n, *strides, ssd.chunk_length(l, chunk), block,
                                   D is not None and D.ndim == 2, 0, ilp64)  # sizes[15]: safe

    def scan() -> float:
        return sum(run_all(lambda part: lib.portable_ssm_scan_forward(sizes, pointers, floor, part[0], part[1]),
                           row_ranges(items, 1), blas=True))

    if not math.isfinite(scan()):  # a non-finite input: again, keeping it from the steps before it
        sizes[15] = 1
        scan()
    return y, final
