"""The cross-backend test matrix: one ``xp`` fixture over every backend, crossed with dtypes.

Backends: numpy, array_api_strict, torch-cpu, jax, torch-cuda, cupy. Each is set up in its own
``try: import`` with its numerics fixed (x64 on jax, highest float32 matmul precision on torch);
a missing library or GPU skips its rows with the reason. ``PORTABLE_SSM_BACKENDS=numpy,jax``
narrows the matrix.

The ``xp`` fixture is a :class:`Backend`: it behaves as the array namespace (``xp.float32``,
``xp.zeros``) and adds ``xp.asarray_from(host_numpy, dtype)``, ``xp.numpy(array)``,
``xp.name`` (portable_ssm's backend name) and ``xp.device``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

MATRIX = ("numpy", "array_api_strict", "torch-cpu", "jax", "torch-cuda", "cupy")


def _setup(row: str) -> tuple[str, Any]:
    """``(portable_ssm backend name, device)`` for a matrix row; raises pytest.skip when absent."""
    if row == "numpy":
        return "numpy", None
    if row == "array_api_strict":
        pytest.importorskip("array_api_strict")
        return "array_api_strict", None
    if row.startswith("torch"):
        torch = pytest.importorskip("torch")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        if row == "torch-cuda" and not torch.cuda.is_available():
            pytest.skip("torch-cuda: torch.cuda.is_available() is False (no GPU)")
        return "torch", "cuda" if row == "torch-cuda" else "cpu"
    if row == "jax":
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
        jax.config.update("jax_default_matmul_precision", "highest")
        return "jax", None
    if row == "cupy":
        try:
            import cupy
        except ImportError:
            pytest.skip("cupy: not installed (needs an NVIDIA GPU and pip install cupy-cuda12x)")
        if not cupy.cuda.is_available():
            pytest.skip("cupy: cupy.cuda.is_available() is False (no GPU)")
        return "cupy", None
    raise ValueError(row)


def selected_rows() -> tuple[str, ...]:
    wanted = os.environ.get("PORTABLE_SSM_BACKENDS")
    if not wanted:
        return MATRIX
    rows = tuple(r.strip() for r in wanted.split(",") if r.strip())
    unknown = [r for r in rows if r not in MATRIX]
    if unknown:
        raise ValueError(f"PORTABLE_SSM_BACKENDS: unknown rows {unknown}; choose from {MATRIX}")
    return rows


_JITTED: dict[tuple, Any] = {}


@dataclass
class Backend:
    """One matrix row: the namespace plus conversion helpers for tests."""

    row: str
    name: str
    device: Any

    @property
    def namespace(self) -> Any:
        from portable_ssm.backends import load

        return load(self.name).namespace()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.namespace, attr)

    def asarray_from(self, host: Any, dtype: str | None = None) -> Any:
        """A numpy array (or list) converted to this backend, device and dtype name."""
        from portable_ssm import to_backend

        return to_backend(np.asarray(host), self.name, device=self.device, dtype=dtype)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; on jax under ``jax.jit`` (array-valued arguments traced, the rest
        static), which proves the code traces with static shapes and is far quicker than eager jax."""
        if self.name != "jax":
            return fn(*args, **kwargs)
        import jax

        def has_array(v: Any) -> bool:
            return any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(v))

        dynamic = {k: v for k, v in kwargs.items() if has_array(v)}
        static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in dynamic))
        key = (fn, static)
        if key not in _JITTED:
            _JITTED[key] = jax.jit(lambda a, kw: fn(*a, **kw, **dict(static)))
        return _JITTED[key](args, dynamic)

    def numpy(self, a: Any) -> np.ndarray:
        from portable_ssm.backends import load

        return load(self.name).to_numpy(a)


@pytest.fixture(params=selected_rows())
def xp(request: pytest.FixtureRequest) -> Backend:
    name, device = _setup(request.param)
    return Backend(request.param, name, device)


@pytest.fixture(params=["ufuncs", "kernels"])
def numpy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which of NumPy's native paths a test runs: its ufuncs (the compiled kernels turned off) or its
    compiled kernels (``portable_ssm.backends.numpy.kernels``; skipped where they cannot be used)."""
    from portable_ssm.backends.cpu_source import ENV
    from portable_ssm.backends.numpy import kernels

    if request.param == "ufuncs":
        monkeypatch.setenv(ENV, "0")
    elif kernels.library() is None:
        pytest.skip("NumPy's CPU kernels: not usable here (an x86-64 CPU with AVX2 and FMA and a C++ compiler)")
    return request.param


@pytest.fixture(params=["avx2", "avx512"])
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each build of NumPy's compiled kernels ``PORTABLE_SSM_CPU_ISA`` picks: the AVX2 one on every
    machine, the AVX-512 one where the CPU has it (skipped elsewhere), so both code paths are tested
    on an AVX-512 machine."""
    from portable_ssm.backends import cpu_source

    missing = [f for f in cpu_source.ISA_FEATURES[request.param] if not cpu_source.cpu_features().get(f)]
    if missing:
        pytest.skip(f"the {request.param} build of the CPU kernels: this CPU lacks {', '.join(missing)}")
    monkeypatch.setenv(cpu_source.ISA_ENV, request.param)
    return request.param


@pytest.fixture
def library(cpu_isa: str):
    """NumPy's compiled CPU kernels of the ``cpu_isa`` build (skipped where they cannot be built)."""
    from portable_ssm.backends.numpy import kernels

    lib = kernels.library()
    if lib is None:
        pytest.skip("NumPy's CPU kernels: not usable here (an x86-64 CPU with AVX2 and FMA and a C++ compiler)")
    return lib


@pytest.fixture(params=["float32", "float64"])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max|a - e| / max|e|`` (0 when both are 0)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale > 0 else diff


def assert_close(xp: Backend, actual: Any, expected: np.ndarray, *, rtol: float, dtype: str | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
    """Asserts ``actual`` is an array of ``xp``'s backend (not silently numpy), with the dtype and
    shape asked for, and within ``rtol`` of ``expected`` in :func:`rel_err`'s sense."""
    from portable_ssm._array import array_backend, dtype_name

    assert array_backend(actual) == xp.name, f"result is a {array_backend(actual)} array, expected {xp.name}"
    if dtype is not None:
        assert dtype_name(actual.dtype) == dtype, f"dtype {dtype_name(actual.dtype)} != {dtype}"
    expected = np.asarray(expected)
    want_shape = expected.shape if shape is None else shape
    assert tuple(actual.shape) == tuple(want_shape), f"shape {tuple(actual.shape)} != {want_shape}"
    err = rel_err(xp.numpy(actual), expected)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


def tol(dtype: str) -> float:
    """Agreement expected between two exact algorithms in ``dtype``."""
    return {"float64": 1e-10, "float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}[dtype]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (README's test command: ``-n 2 --dist worksteal``) every worker starts on
    its own contiguous share of the run and takes from the tail of another's once done. The ``slow``
    tests are dealt alternately to the front and the back of the run, so the two longest (the
    selective-copy trainings of tests/test_examples.py, minutes each) start on different workers
    instead of one after the other on the same one. Every worker collects and orders the run
    itself (xdist's ``workerinput`` marks a worker); without xdist the order is pytest's."""
    if not hasattr(config, "workerinput"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    rest = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = slow[0::2] + rest + slow[1::2]
