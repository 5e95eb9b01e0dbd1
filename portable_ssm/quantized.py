"""Low-precision weights for inference: :func:`quantize` and :class:`QuantizedWeight`.

The projections (``in_proj``, ``out_proj``), the embedding and the LM head (and, for hybrid
models, the stacked MoE experts ``[E, out, in]``) are stored as

* ``"int8"``: symmetric int8 with one float32 scale per output channel (row; per expert in a
  stack): ``w ≈ q · scale[..., None]``,
  ``scale = max|w_row| / 127``, ``q = round(w / scale)``. Per-channel, not llama.cpp's blocks of
  32, because that is the layout PyTorch's shipped weight-only kernel (``_weight_int8pack_mm``)
  multiplies; a row of the embedding is a row of the (tied) head, so one table serves both.
* ``"bfloat16"``: the weight rounded to bfloat16 (nearest, ties to even); native ``bfloat16``
  on torch and JAX, the same 16 bits as ``uint16`` elsewhere (NumPy, CuPy, array-api-strict).

Everything else (conv, Δ, A, D, norms, biases), the activations and the states stay float32. A
:class:`QuantizedWeight` stands for the float32 ``[out, in]`` matrix it approximates: its
``shape``, ``dtype`` (float32), ``device`` and array namespace are that matrix's, so
:func:`portable_ssm.check_params`, the model's dtype checks and generation take quantized params
as they are; only the matrix multiply (:func:`quantized_matmul`, matrices only), the embedding
lookup and the MoE block's choice of experts (:func:`take_rows`) and :func:`dequantize` read its
storage. The reference (:func:`quantized_matmul_ref`) dequantizes
with standard array-API functions and multiplies in float32; backends replace it through
``fast_op(xp, "quantized_matmul")``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ._array import Array, Namespace, array_backend, device, dtype_name, namespace
from .backends import fast_op, load, to_backend

#: Storage kinds :func:`quantize` accepts; ``"float32"`` leaves the params as they are.
KINDS = ("float32", "bfloat16", "int8")
#: Backends whose arrays hold bfloat16 natively (the others store its bits as uint16).
NATIVE_BFLOAT16 = ("torch", "jax")
#: Parameter names (their last two parts) stored in low precision.
QUANTIZED_LEAVES = ("in_proj.weight", "out_proj.weight", "embedding.weight", "lm_head.weight")
_INT8_MAX = 127
#: The float32 from which rounding to bfloat16 (nearest, ties to even) gives infinity: 0x7F7F8000.
BFLOAT16_OVERFLOW = float.fromhex("0x1.ff0000p+127")
#: The smallest normal float32: an int8 row scale is never below it (``max|row| / 127`` of a row of
#: subnormals may round to 0, and ``row / 0`` is NaN: such a row is stored as zeros instead).
_SMALLEST_SCALE = float.fromhex("0x1p-126")
#: The largest float32 scale whose 127 multiple is finite in float32: a row holding values near the
#: float32 maximum gets it (``max|row| / 127`` rounds up there, and ``127 · scale`` to infinity).
_LARGEST_SCALE = float.fromhex("0x1.020406p+121")


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A float32 ``[out, in]`` weight, or a stack ``[E, out, in]`` of them (MoE experts), stored
    in low precision.

    Attributes:
        data: ``int8 [..., out, in]`` for ``kind="int8"``; ``bfloat16`` (torch, JAX) or its bits
            as ``uint16 [..., out, in]`` (other backends) for ``kind="bfloat16"``.
        scale: ``float32 [..., out]``, the per-row scale of ``"int8"`` (one per output row of each
            expert in a stack); None for ``"bfloat16"``.
        kind: ``"int8"`` or ``"bfloat16"``.
        dtype: the dtype the weight computes in (float32): the one activations must have.
        packed: the backend's kernel-ready copy of ``data``, which its ``quantized_matmul``
            reads instead (``fast_op(xp, "pack_quantized")`` adds it in :func:`quantize`; torch
            on CPU: fbgemm's prepacked weight); None where the backend has none. It is held
            beside ``data``, which the embedding lookup and the reference read; a stack has none.
    """

    data: Array
    scale: Array | None
    kind: str
    dtype: Any
    packed: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("int8", "bfloat16"):
            raise ValueError(f"kind: expected 'int8' or 'bfloat16', got {self.kind!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def device(self) -> Any:
        return device(self.data)

    @property
    def nbytes(self) -> int:
        """Bytes held: 1 (int8) or 2 (bfloat16) per element, plus 4 per row scale."""
        per_element = 1 if self.kind == "int8" else 2
        return math.prod(self.shape) * per_element + (0 if self.scale is None else 4 * math.prod(self.shape[:-1]))

    def __array_namespace__(self, api_version: str | None = None) -> Namespace:
        """The storage's array namespace, so ``namespace(...)`` checks see the weight's backend."""
        return namespace(data=self.data)

    def __repr__(self) -> str:
        return f"QuantizedWeight(kind={self.kind!r}, shape={self.shape}, backend={array_backend(self.data)})"


def _quantize_int8(w: Array, *, xp: Namespace) -> QuantizedWeight:
    """``w [..., out, in]`` as int8 with one scale per row (of each matrix in a stack)."""
    absmax = xp.max(xp.abs(w), axis=-1)  # [..., out]
    scale = xp.clip(absmax / _INT8_MAX, _SMALLEST_SCALE, _LARGEST_SCALE)  # never 0, never 127·scale = inf
    scale = xp.where(absmax > 0, scale, xp.full_like(absmax, 1 / _INT8_MAX))  # all-zero rows: scale 1/127
    q = xp.clip(xp.round(w / scale[..., None]), -_INT8_MAX, _INT8_MAX)  # [..., out, in]
    return QuantizedWeight(xp.astype(q, xp.int8), scale, "int8", w.dtype)


def _quantize_bfloat16(w: Array, *, xp: Namespace) -> QuantizedWeight:
    backend = array_backend(w)
    if backend in NATIVE_BFLOAT16:
        return QuantizedWeight(xp.astype(w, load(backend).dtype("bfloat16")), None, "bfloat16", w.dtype)
    host = load("numpy").bfloat16_bits(load(backend).to_numpy(w))  # uint16 [..., out, in]
    return QuantizedWeight(to_backend(host, backend, device=device(w)), None, "bfloat16", w.dtype)


def quantize(params: dict[str, Array], kind: str, *, names: Collection[str] | None = None) -> dict[str, Any]:
    """A copy of ``params`` whose projections, embedding and LM head are stored as ``kind``.

    Args:
        params: a float32 parameter dict (core names), e.g. from :func:`portable_ssm.init_params`
            or a trained model (detached: quantized weights carry no gradient).
        names: the keys to convert (each a float32 matrix ``[out, in]``, or a stack ``[E, out,
            in]`` of them such as a MoE block's experts: int8 scales per row of each); None: the
            Mamba-2 model's, every key whose last two parts are one of :data:`QUANTIZED_LEAVES`.
        kind: ``"int8"`` (per-output-channel scales), ``"bfloat16"``, or ``"float32"`` (a plain
            copy of the dict, nothing converted).

    Returns:
        A dict with the same keys: :class:`QuantizedWeight` under every ``*in_proj.weight``,
        ``*out_proj.weight``, ``embedding.weight`` and ``lm_head.weight``; the other arrays are
        the same objects. Forward, logits and generation accept it like the float32 dict; move
        or cast params (:func:`portable_ssm.cast_params`, ``backend=``) before quantizing them.

    Raises:
        TypeError: ``params`` not a dict of str -> arrays, ``kind`` not a str, a weight to convert
            that is not a float32 matrix or stack or is already a :class:`QuantizedWeight` (naming
            the key).
        ValueError: an unknown ``kind``; a weight with inf or NaN (naming the key and the row: its
            int8 scale would be NaN or infinite and poison the row); for ``"bfloat16"`` a magnitude
            of :data:`BFLOAT16_OVERFLOW` or more, which would round to infinity.
    """
    _check_params(params)
    if not isinstance(kind, str):
        raise TypeError(f"kind: expected one of {', '.join(map(repr, KINDS))} as a str, got {type(kind).__name__}")
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if kind == "float32":
        return dict(params)
    convert = _quantize_int8 if kind == "int8" else _quantize_bfloat16
    out: dict[str, Any] = {}
    for name, value in params.items():
        if (".".join(name.split(".")[-2:]) not in QUANTIZED_LEAVES if names is None else name not in names):
            out[name] = value
            continue
        xp = namespace(**{f"params[{name!r}]": value})
        weight = convert(_checked_weight(name, value, kind), xp=xp)
        pack = fast_op(xp, "pack_quantized") if weight.ndim == 2 else None  # the fast matmuls take matrices
        out[name] = weight if pack is None else pack(weight)
    return out


def _check_params(params: Any) -> None:
    """TypeError naming the key unless ``params`` is a dict of str -> array (or QuantizedWeight)."""
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of arrays, got {type(params).__name__}")
    for name, value in params.items():
        if not isinstance(name, str):
            raise TypeError(f"params: expected str keys, got {type(name).__name__} {name!r}")
        if not isinstance(value, QuantizedWeight):
            namespace(**{f"params[{name!r}]": value})  # TypeError naming the key for a non-array (None too)
            if value is None:
                raise TypeError(f"params[{name!r}]: expected an array, got None")


def _first_row(mask: Array, *, xp: Namespace) -> str:
    """The first row of a boolean ``[..., out, in]`` mask that holds a true, as ``"row r"`` (a
    matrix) or ``"expert e row r"`` (a stack)."""
    rows = xp.reshape(xp.any(mask, axis=-1), (-1,))  # [..., out] -> [E·out]
    first = int(xp.argmax(xp.astype(rows, xp.int32)))
    return f"row {first}" if mask.ndim == 2 else f"expert {first // mask.shape[-2]} row {first % mask.shape[-2]}"


def _checked_weight(name: str, w: Any, kind: str) -> Array:
    """``w`` when it is a finite float32 matrix (or stack) that ``kind`` can hold; TypeError / ValueError naming
    the key (and the first bad row) otherwise: a non-finite weight would make its row's int8 scale
    NaN or infinite and poison the whole row, and bfloat16 rounds magnitudes from
    :data:`BFLOAT16_OVERFLOW` up to infinity."""
    if isinstance(w, QuantizedWeight):
        raise TypeError(f"params[{name!r}]: already quantized ({w.kind}); quantize float32 params")
    xp = namespace(**{f"params[{name!r}]": w})
    if w.dtype != xp.float32 or w.ndim not in (2, 3):
        raise TypeError(f"params[{name!r}]: expected a float32 [out, in] matrix, got {dtype_name(w.dtype)} "
                        f"of shape {tuple(w.shape)} (portable_ssm.cast_params(params, 'float32') first; a stack "
                        f"[E, out, in] of matrices is taken too)")
    finite = xp.isfinite(w)  # [..., out, in]
    if not bool(xp.all(finite)):
        raise ValueError(f"params[{name!r}]: expected finite values, got inf or nan in "
                         f"{_first_row(xp.logical_not(finite), xp=xp)}")
    if kind == "bfloat16":
        beyond = xp.abs(w) >= BFLOAT16_OVERFLOW  # [..., out, in]
        if bool(xp.any(beyond)):
            raise ValueError(f"params[{name!r}]: {_first_row(beyond, xp=xp)} holds a magnitude of at least "
                             f"{BFLOAT16_OVERFLOW:.7g}, which bfloat16 rounds to infinity; use 'int8' or "
                             f"scale the weight")
    return w


#: ``2^(max(e, 1) - 134)`` for every bfloat16 exponent field ``e`` in 0..255: ``(128 + mantissa)``
#: times it is a normal number's value, ``mantissa`` times it a subnormal's.
_BFLOAT16_POWERS = [2.0 ** (max(e, 1) - 134) for e in range(256)]


def _bfloat16_powers(like: Array, *, xp: Namespace) -> Array:
    """:data:`_BFLOAT16_POWERS` as float32 ``[256]`` on ``like``'s device."""
    return xp.asarray(_BFLOAT16_POWERS, dtype=xp.float32, device=device(like))


def widen_bfloat16_bits(bits: Array, *, xp: Namespace) -> Array:
    """The float32 values of bfloat16 numbers given as their ``uint16`` bits (finite ones), with
    standard integer arithmetic only (no bit casts): sign, exponent and mantissa fields."""
    b = xp.astype(bits, xp.int32)
    exponent, mantissa = (b >> 7) & 255, b & 127
    significand = xp.where(exponent > 0, mantissa + 128, mantissa)
    powers = xp.take(_bfloat16_powers(bits, xp=xp), xp.reshape(exponent, (-1,)))  # [size]
    magnitude = xp.astype(significand, xp.float32) * xp.reshape(powers, exponent.shape)  # [...]
    return xp.where((b >> 15) > 0, -magnitude, magnitude)


def _widen_rows(w: QuantizedWeight, data: Array, scale: Array | None, *, xp: Namespace) -> Array:
    """Rows ``data [..., in]`` of ``w``'s storage (with their ``scale [...]``) as float32."""
    if w.kind == "int8":
        return xp.astype(data, xp.float32) * scale[..., None]
    if data.dtype == xp.uint16:
        return widen_bfloat16_bits(data, xp=xp)
    return xp.astype(data, xp.float32)


def dequantize(w: QuantizedWeight, *, xp: Namespace) -> Array:
    """The float32 ``[..., out, in]`` weight ``w`` stores (``q · scale`` or the widened bfloat16)."""
    return _widen_rows(w, w.data, w.scale, xp=xp)


def take_rows(w: QuantizedWeight, ids: Array, *, xp: Namespace) -> Array:
    """Entries ``ids [k]`` along the first axis of the weight ``w`` stores, float32, widening only
    those: rows ``[k, in]`` of a matrix (the embedding lookup), or matrices ``[k, out, in]`` of a
    stack (the MoE block's chosen experts). A backend may widen them natively
    (``fast_op(xp, "take_rows")``, NumPy's bit shift: a decode step's embedding in one pass where
    the standard functions take a dozen); :func:`take_rows_ref` is the reference it equals."""
    native = fast_op(xp, "take_rows")
    return take_rows_ref(w, ids, xp=xp) if native is None else native(w, ids)


def take_rows_ref(w: QuantizedWeight, ids: Array, *, xp: Namespace) -> Array:
    """:func:`take_rows` with the standard functions."""
    scale = None if w.scale is None else xp.take(w.scale, ids, axis=0)  # [k] or [k, out]
    return _widen_rows(w, xp.take(w.data, ids, axis=0), scale, xp=xp)


def quantized_matmul_ref(rows: Array, w: QuantizedWeight, *, xp: Namespace) -> Array:
    """``rows [m, in] @ dequantize(w).T -> [m, out]`` in float32: the reference every fast path matches."""
    return xp.matmul(rows, xp.matrix_transpose(dequantize(w, xp=xp)))  # [m, out]


def quantized_matmul(rows: Array, w: QuantizedWeight, *, xp: Namespace) -> Array:
    """``rows [m, in]`` (float32) times the quantized ``w [out, in]`` transposed: ``[m, out]``,
    through the backend's ``fast_op(xp, "quantized_matmul")`` where it has one."""
    native = fast_op(xp, "quantized_matmul")
    return quantized_matmul_ref(rows, w, xp=xp) if native is None else native(rows, w)


def params_nbytes(params: dict[str, Any]) -> int:
    """Bytes held by a parameter dict, quantized weights counted by their storage (TypeError naming
    the key for a value that is no array)."""
    _check_params(params)
    total = 0
    for name, value in params.items():
        if isinstance(value, QuantizedWeight):
            total += value.nbytes
            continue
        xp = namespace(**{f"params[{name!r}]": value})
        total += math.prod(value.shape) * _itemsize(value.dtype, xp=xp)
    return total


def _itemsize(dtype: Any, *, xp: Namespace) -> int:
    """Bytes per element of an array-API dtype (bool: 1)."""
    if dtype == xp.bool:
        return 1
    info = xp.finfo(dtype) if xp.isdtype(dtype, "real floating") or xp.isdtype(dtype, "complex floating") \
        else xp.iinfo(dtype)
    return info.bits // 8 * (2 if xp.isdtype(dtype, "complex floating") else 1)
