"""The one module that touches ``array_api_compat``: namespaces, backend names and small helpers.

Every public entry point calls :func:`namespace` once on its array arguments and passes the
resulting ``xp`` down; private helpers take ``xp`` keyword-only. No framework is imported here:
``array_api_compat`` inspects arrays by their type and only touches frameworks already loaded.

Helpers below fill gaps in the standard (``softplus``, ``silu``) and are written only with
standard functions so they run on array-api-strict.
"""

from __future__ import annotations

import sys
from typing import Any

import array_api_compat

Array = Any
Namespace = Any

_BACKEND_PREDICATES = (
    ("numpy", array_api_compat.is_numpy_namespace),
    ("torch", array_api_compat.is_torch_namespace),
    ("cupy", array_api_compat.is_cupy_namespace),
    ("jax", array_api_compat.is_jax_namespace),
    ("array_api_strict", array_api_compat.is_array_api_strict_namespace),
)


def backend_name(xp: Namespace) -> str:
    """The short backend name (``"numpy"``, ``"torch"``, ...) of an array namespace."""
    for name, predicate in _BACKEND_PREDICATES:
        if predicate(xp):
            return name
    return getattr(xp, "__name__", repr(xp))


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array (any object of the array API, a QuantizedWeight included)."""
    return array_api_compat.is_array_api_obj(x)


def array_backend(x: Array) -> str:
    """The short backend name of one array, or its type name when it is not an array."""
    if not is_array(x):
        return type(x).__name__
    return backend_name(array_api_compat.array_namespace(x))


#: The namespace of each library's array types seen so far: for them ``array_namespace`` depends on
#: the type alone, and asking it again for every parameter was most of a decode step's checks.
#: Other array objects (a QuantizedWeight answers with its storage's namespace) are asked each time.
_NAMESPACE_OF_TYPE: dict[type, Namespace] = {}
_LIBRARY_ARRAYS = (array_api_compat.is_numpy_array, array_api_compat.is_torch_array, array_api_compat.is_cupy_array,
                   array_api_compat.is_jax_array)


def _is_library_array(value: Any) -> bool:
    """Whether ``value`` is one of the five libraries' own arrays (not a wrapper like QuantizedWeight)."""
    return any(check(value) for check in _LIBRARY_ARRAYS) or type(value).__module__.startswith("array_api_strict")


def _namespace_of(name: str, value: Any) -> Namespace:
    """``array_namespace(value)``, remembered by type for the libraries' own arrays (not while
    ``torch.compile`` traces: it would guard on the cache and recompile as it fills); TypeError
    naming ``name`` for a non-array."""
    torch = sys.modules.get("torch")
    tracing = torch is not None and torch.compiler.is_compiling()
    xp = None if tracing else _NAMESPACE_OF_TYPE.get(type(value))
    if xp is None:
        if not is_array(value):
            raise TypeError(f"{name}: expected an array (numpy, torch, cupy, jax, array_api_strict), "
                            f"got {type(value).__name__}")
        xp = array_api_compat.array_namespace(value)
        if not tracing and _is_library_array(value):
            _NAMESPACE_OF_TYPE[type(value)] = xp
    return xp


def namespace(**arrays: Array | None) -> Namespace:
    """The array namespace shared by the named arrays (``None`` values are skipped).

    Raises ``TypeError`` naming the argument when a value is not an array, and naming both
    arguments and both backends when two arrays come from different libraries.
    """
    first_name, first_xp = None, None
    for name, value in arrays.items():
        if value is None:
            continue
        xp = _namespace_of(name, value)
        if first_xp is None:
            first_name, first_xp = name, xp
        elif backend_name(xp) != backend_name(first_xp):
            raise TypeError(f"{name} is a {backend_name(xp)} array but {first_name} is a "
                            f"{backend_name(first_xp)} array; pass arrays from one backend "
                            f"(convert with portable_ssm.to_backend)")
    if first_xp is None:
        raise TypeError(f"expected at least one array among {', '.join(arrays)}")
    return first_xp


def device(x: Array) -> Any:
    """The device an array lives on."""
    return array_api_compat.device(x)


def same_device(x: Array, y: Array) -> bool:
    """Whether two arrays live on the same device; true when either has no concrete device (a JAX
    tracer under ``jax.grad``/``jax.vmap`` is placed only when the transform runs)."""
    dx, dy = device(x), device(y)
    return dx is None or dy is None or str(dx) == str(dy)


def is_traced(x: Array) -> bool:
    """Whether ``x`` stands for values not known yet, so none can be read on the host: a JAX tracer
    (under ``jit``/``grad``/``vmap``), or any tensor while ``torch.compile`` traces. Reads only
    frameworks already loaded."""
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.core.Tracer):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def dtype_name(dtype: Any) -> str:
    """A readable dtype name (``float32``) across backends (``torch.float32``, ``dtype('float32')``)."""
    return str(getattr(dtype, "name", dtype)).split(".")[-1].strip("'<>)")


def is_floating(xp: Namespace, x: Array) -> bool:
    """Whether ``x`` has a real floating dtype (bf16 and fp16 included)."""
    return xp.isdtype(x.dtype, "real floating")


def compute_dtype(xp: Namespace, dtype: Any) -> Any:
    """The dtype the SSM math runs in for inputs of ``dtype``: float64 stays, all else float32."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def softplus(x: Array, *, xp: Namespace) -> Array:
    """``log(1 + exp(x))`` without overflow: ``max(x, 0) + log1p(exp(-|x|))``, with
    ``max(x, 0) = (x + |x|) / 2`` (operators only: no Python scalar reaches a namespace function,
    which ``torch.compile(fullgraph=True)`` cannot trace through array_api_compat)."""
    magnitude = xp.abs(x)
    return 0.5 * (x + magnitude) + xp.log1p(xp.exp(-magnitude))


def silu(x: Array, *, xp: Namespace) -> Array:
    """``x * sigmoid(x)``, as ``h + h·tanh(h)`` with ``h = x/2`` (sigmoid(x) = (1 + tanh(x/2)) / 2):
    finite for every finite input, and four passes over x instead of five."""
    half = 0.5 * x
    return half + half * xp.tanh(half)


def row_major(v: Array, *, xp: Namespace) -> Array:
    """``v`` laid out row-major. The standard has no layouts, but reshaping through one flat axis
    copies a permuted view in logical order on strided backends, so the [Q, Q] blocks of the scan
    built from it are contiguous (their matmuls run as BLAS calls instead of strided loops), and a
    weight's column read as a row broadcasts at full speed."""
    return xp.reshape(xp.reshape(v, (-1,)), v.shape)  # [...] -> [prod] -> [...]


def constant(value: float, like: Array, *, xp: Namespace) -> Array:
    """``value`` as a 0-d array of ``like``'s dtype and device, for ``where``/``maximum`` operands:
    Python scalars there go through array_api_compat's promotion, which ``torch.compile`` with
    ``fullgraph=True`` cannot trace."""
    return xp.asarray(value, dtype=like.dtype, device=device(like))


def zeros_like_shape(xp: Namespace, shape: tuple[int, ...], like: Array, dtype: Any = None) -> Array:
    """Zeros of ``shape`` on ``like``'s device, in ``dtype`` (default: ``like``'s)."""
    return xp.zeros(shape, dtype=like.dtype if dtype is None else dtype, device=device(like))
