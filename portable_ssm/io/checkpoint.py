"""Checkpoints: safetensors files in core names with the config as JSON metadata. Never pickle.

``save_params(path, params, config)`` writes every parameter and ``load_params(path)`` reads
them back on any backend, numpy-only machines included, bit-exact. ``save_arrays``/``load_arrays``
do the same for any named arrays (optimizer state, task heads), without a config.

bfloat16 and float16 arrays are stored as BF16 and F16 and come back in their dtype (on numpy,
which has no bfloat16, BF16 comes back widened to float32 exactly). Files of older versions, which
stored them as F32 with a ``dtypes`` metadata entry, still load.

Files are read and written by :mod:`portable_ssm.io.safetensors` with NumPy alone (the
``safetensors`` package is not needed): every file is validated before any tensor is read, and
every save is atomic and durable. Failures are :class:`CheckpointError` naming the file and the
tensor or key.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .._array import Array, array_backend, dtype_name, is_array
from ..backends import load, to_backend
from ..config import Mamba2Config
from ..params import Params, check_params, param_shapes
from ..quantized import QuantizedWeight
from .errors import CheckpointError
from .paths import as_path
from .strict_json import SHORT, loads

if TYPE_CHECKING:
    from .safetensors import Contents

FORMAT = "portable_ssm.v1"
_RESERVED = ("format", "config", "dtype", "dtypes")
_FLOATS = ("float64", "float32", "float16", "bfloat16")
_NARROW = ("bfloat16", "float16")


def save_arrays(path: str | os.PathLike, arrays: dict[str, Array], *,
                metadata: dict[str, str] | None = None) -> None:
    """Writes named arrays (any backend; floating, integer or bool) to a safetensors file, each in
    its own dtype (bfloat16 as BF16, float16 as F16). ``metadata`` values must be strings.

    The file is written to a fresh temporary file beside ``path``, fsynced and renamed over it:
    readers (and a crash at any moment) see the old file or the new one, never a mix, also when
    several processes save to ``path`` at once. OSError naming ``path`` when it cannot be written;
    TypeError naming the entry for a value that is not a plain array (a quantized weight included).
    """
    _write(path, arrays, metadata, "arrays")


def _write(path: str | os.PathLike, arrays: dict[str, Array], metadata: dict[str, str] | None, name: str) -> None:
    """:func:`save_arrays` for ``arrays`` passed as the argument ``name``: TypeError naming
    ``name[key]`` unless every value is a plain array. A
    :class:`~portable_ssm.quantized.QuantizedWeight` (what :func:`portable_ssm.quantize` gives) has no
    safetensors form here, so checkpoints keep the float weights and quantize after loading."""
    from .safetensors import write_safetensors

    path = as_path(path)
    _check_names(name, arrays)
    if metadata is not None:
        _check_names("metadata", metadata)
    for key, value in arrays.items():
        if isinstance(value, QuantizedWeight):
            raise TypeError(f"{name}[{key!r}]: a QuantizedWeight ({value.kind}, from portable_ssm.quantize) cannot be "
                            "saved; save the float params and quantize after loading (portable_ssm.quantize, or "
                            "load_pretrained(..., weights=...))")
        if not is_array(value):
            raise TypeError(f"{name}[{key!r}]: expected an array, got {type(value).__name__}")
    host, narrow = {}, {}
    for key, value in arrays.items():
        host[key] = load(array_backend(value)).to_numpy(value)
        if dtype_name(value.dtype) != host[key].dtype.name:
            narrow[key] = dtype_name(value.dtype)
    write_safetensors(path, host, dict(metadata or {}), narrow=narrow)


def _check_names(name: str, mapping: Any) -> None:
    """TypeError naming ``name`` unless ``mapping`` is a dict with str keys (an int key would be
    written as its decimal string and come back as one)."""
    if not isinstance(mapping, dict):
        raise TypeError(f"{name}: expected a dict with str keys, got {type(mapping).__name__}")
    for key in mapping:
        if not isinstance(key, str):
            raise TypeError(f"{name}: expected str keys, got {type(key).__name__} {key!r}")


def load_arrays(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                device: Any = None) -> tuple[dict[str, Array], dict[str, str]]:
    """Reads a safetensors file: ``(arrays on backend, metadata)``. Arrays come back in their stored
    dtype (``dtype=`` casts every floating one instead; BF16 comes back float32 on backends without
    bfloat16). Raises :class:`CheckpointError` naming the file and the
    tensor when it is truncated or corrupt."""
    path = as_path(path)
    _check_dtype(dtype)
    return _on_backend(path, _read(path), backend, dtype, device)


def _check_dtype(dtype: str | None) -> None:
    """ValueError unless ``dtype`` is None or a floating dtype name."""
    if dtype is not None and dtype not in _FLOATS:
        raise ValueError(f"dtype: expected None or one of {', '.join(_FLOATS)}, got {dtype!r}")


def _read(path: str) -> Contents:
    """The safetensors file at ``path`` on the host (numpy arrays); numpy is imported here, not on import."""
    from .safetensors import read_safetensors

    return read_safetensors(path)


def _on_backend(path: str, contents: Contents, backend: str, dtype: str | None,
                device: Any) -> tuple[dict[str, Array], dict[str, str]]:
    """``contents`` on ``backend``: each array in its stored dtype (or its floating ones cast to
    ``dtype``), and the metadata less the ``dtypes`` entry."""
    meta = contents.metadata
    stored = {**contents.dtypes, **_legacy_dtypes(path, meta, contents.dtypes)}
    keep_bf16 = _has_bfloat16(backend)
    out = {}
    for key, value in contents.arrays.items():
        want = stored[key] if stored[key] != value.dtype.name else None
        if dtype is not None and value.dtype.kind == "f":
            want = dtype
        elif want == "bfloat16" and not keep_bf16:
            want = None
        out[key] = to_backend(value, backend, device=device, dtype=want)
    return out, {k: v for k, v in meta.items() if k != "dtypes"}


def _legacy_dtypes(path: str, metadata: dict[str, str], stored: dict[str, str]) -> dict[str, str]:
    """The ``dtypes`` entry of files from older versions (bf16/fp16 tensors stored as F32): a JSON
    map from tensors of the file to ``"bfloat16"`` or ``"float16"``; CheckpointError naming the key."""
    if "dtypes" not in metadata:
        return {}
    narrowed = loads(metadata["dtypes"], f"{path}: the 'dtypes' metadata")
    if not isinstance(narrowed, dict):
        raise CheckpointError(f"{path}: the 'dtypes' metadata is {type(narrowed).__name__}, expected a map "
                              f"from tensor names to dtype names")
    for key, name in narrowed.items():
        if stored.get(key) != "float32":
            raise CheckpointError(f"{path}: the 'dtypes' metadata names {SHORT.repr(key)}, which is no "
                                  f"float32 tensor of the file")
        if name not in _NARROW:
            raise CheckpointError(f"{path}: the 'dtypes' metadata gives tensor {SHORT.repr(key)} the dtype "
                                  f"{SHORT.repr(name)}, expected one of {', '.join(_NARROW)}")
    return narrowed


def _has_bfloat16(backend: str) -> bool:
    """Whether ``backend`` has a bfloat16 dtype (numpy and array-api-strict have none)."""
    try:
        load(backend).dtype("bfloat16")
    except (TypeError, AttributeError):
        return False
    return True


def save_params(path: str | os.PathLike, params: Params, config: Mamba2Config, *,
                metadata: dict[str, str] | None = None) -> None:
    """Writes ``params`` (validated against ``config``) to a safetensors file at ``path``.

    ``metadata`` adds string entries (e.g. a training step) next to the config; they come back
    from :func:`load_params` with ``return_metadata=True``.
    """
    check_params(params, config)
    clash = sorted(set(metadata or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"metadata: the keys {clash} are reserved by the checkpoint format")
    first = next(iter(params.values()))
    meta = {"format": FORMAT, "config": json.dumps(config.to_dict()), "dtype": dtype_name(first.dtype)}
    _write(path, params, {**meta, **(metadata or {})}, "params")


def load_params(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                device: Any = None, return_metadata: bool = False
                ) -> tuple[Params, Mamba2Config] | tuple[Params, Mamba2Config, dict[str, str]]:
    """Reads a :func:`save_params` file: ``(params, config)`` on ``backend`` (optionally cast to
    ``dtype`` and moved to ``device``). Raises :class:`CheckpointError` naming the file and the
    tensor for truncated, corrupt or mismatched files."""
    path = as_path(path)
    _check_dtype(dtype)
    contents = _read(path)
    config = _config(path, contents.metadata)
    expected = param_shapes(config)
    _check_shapes(path, contents.arrays, expected)
    for key, stored in contents.dtypes.items():
        if stored not in _FLOATS:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {stored}; parameters are floating "
                                  f"({', '.join(_FLOATS)})")
    arrays, meta = _on_backend(path, contents, backend, dtype, device)
    params = {k: arrays[k] for k in expected}
    if return_metadata:
        return params, config, {k: v for k, v in meta.items() if k not in _RESERVED}
    return params, config


def _config(path: str, metadata: dict[str, str]) -> Mamba2Config:
    """The config a :func:`save_params` file carries in its metadata."""
    if "config" not in metadata:
        raise CheckpointError(f"{path}: no portable_ssm config in the metadata (not written by "
                              f"save_params; for pretrained directories use load_pretrained)")
    fields = loads(metadata["config"], f"{path}: the config in the metadata")
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}: the config in the metadata is {type(fields).__name__}, expected an object")
    try:
        return Mamba2Config.from_dict(fields)
    except (TypeError, ValueError, OverflowError) as err:
        raise CheckpointError(f"{path}: the config in the metadata is corrupt ({err})") from None


def _check_shapes(path: str, arrays: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """CheckpointError naming the first tensor that is unexpected, missing or misshapen."""
    for key in arrays:
        if key not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {key!r} for this config")
    for key, shape in expected.items():
        if key not in arrays:
            raise CheckpointError(f"{path}: tensor {key!r} is missing")
        if tuple(arrays[key].shape) != shape:
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(arrays[key].shape)}, "
                                  f"expected {list(shape)} for this config")
