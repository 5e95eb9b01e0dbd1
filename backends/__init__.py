"""Backends: one small module per array library (conversion, devices, dtypes, native fast paths).

Installed as ``portable_ssm.backends``. A framework is imported only when its backend is asked
for by name (``load("torch")``) or when an array of it already reached the core, so
``import portable_ssm`` imports no framework.

Each backend module provides ``namespace()``, ``asarray(host, dtype, device)``,
``to_numpy(x)``, ``dtype(name)`` and ``FAST_OPS`` (name -> native function; may be empty).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .._array import Array, Namespace, array_backend, backend_name
from .._checks import DTYPE_NAMES, check_dtype_name

NAMES = ("numpy", "torch", "jax", "cupy", "array_api_strict")
_INSTALL_HINT = {"torch": "pip install 'portable-ssm[torch]'", "jax": "pip install 'portable-ssm[jax]'",
                 "cupy": "pip install 'portable-ssm[cupy]'", "array_api_strict": "pip install array-api-strict"}


def load(name: str) -> ModuleType:
    """The backend module for ``name`` (``"numpy"``, ``"torch"``, ``"jax"``, ``"cupy"``,
    ``"array_api_strict"``). ValueError for an unknown name, ImportError with the install command
    when the library is missing."""
    if name not in NAMES:
        raise ValueError(f"backend: expected one of {', '.join(NAMES)}, got {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as err:
        if err.name and err.name.split(".")[0] == name:
            raise ImportError(f"backend {name!r} needs {name}: {_INSTALL_HINT[name]}") from err
        raise


def fast_op(xp: Namespace, op: str) -> Callable[..., Any] | None:
    """The native implementation of ``op`` for ``xp``'s backend, or None to use the reference.

    Reads the backend module from ``sys.modules`` once it is loaded (no import machinery on the hot
    path, which also keeps ``torch.compile`` from breaking its graph here)."""
    name = backend_name(xp)
    if name not in NAMES:
        return None
    module = sys.modules.get(f"{__name__}.{name}") or load(name)
    return module.FAST_OPS.get(op)


def compiled(fn: Callable[..., Any], xp: Namespace, name: str) -> Callable[..., Any]:
    """``fn`` as ``xp``'s backend runs a whole function by default: ``jax.jit``-compiled on JAX (once
    per shape; its traces counted under ``name`` in ``portable_ssm.backends.jax.TRACES``), as it is
    elsewhere. Its callers check their arguments eagerly first: a tracer's values cannot be."""
    jit = fast_op(xp, "jit")
    return fn if jit is None else jit(fn, name, ())


def to_backend(x: Array, backend: str, *, device: Any = None, dtype: str | None = None) -> Array:
    """Converts an array to ``backend`` (and optionally ``device`` / ``dtype`` by name).

    Returns ``x`` itself when nothing changes. Crosses libraries through host memory; bfloat16
    and float16 sources are widened to float32 on the host and narrowed again when ``dtype`` asks.
    """
    target = load(backend)
    source = array_backend(x)
    check_dtype_name("dtype", dtype, DTYPE_NAMES, allow_none=True)
    if source == backend and device is None and dtype is None:
        return x
    if source == backend:
        return target.convert(x, dtype, device)
    return target.asarray(load(source).to_numpy(x), dtype, device)
