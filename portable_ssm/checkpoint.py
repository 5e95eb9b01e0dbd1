"""Checkpoints: safetensors files in core names with the config as JSON metadata. Never pickle.

``save_params(path, params, config)`` writes every parameter and ``load_params(path)`` reads
them back on any backend, numpy-only machines included, bit-exact. ``save_arrays``/``load_arrays``
do the same for any named arrays (optimizer state, task heads), without a config.

NumPy has no bfloat16, so bf16/fp16 arrays are stored widened to float32 (exact) and the
``dtypes`` metadata entry narrows them again on load unless ``dtype=`` says otherwise.

Before safetensors reads a file, its header is parsed here (8-byte little-endian length, JSON
header with ``dtype``, ``shape`` and ``data_offsets`` per tensor), so a truncated or corrupt file
raises :class:`CheckpointError` naming the file and the first tensor that is cut or malformed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

from ._array import Array, array_backend, dtype_name
from .backends import load, to_backend
from .config import Mamba2Config
from .params import Params, check_params, param_shapes

FORMAT = "portable_ssm.v1"
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
_RESERVED = ("format", "config", "dtype", "dtypes")


class CheckpointError(ValueError):
    """A checkpoint file that is corrupt, truncated or does not match its config."""


def save_arrays(path: str | os.PathLike, arrays: dict[str, Array], *,
                metadata: dict[str, str] | None = None) -> None:
    """Writes named arrays (any backend, any floating or integer dtype) to a safetensors file.

    The file is written next to ``path`` and renamed over it, so a crash never leaves half a file
    under the final name. ``metadata`` values must be strings.
    """
    from safetensors.numpy import save_file

    host, narrowed = {}, {}
    for key, value in arrays.items():
        host[key] = load(array_backend(value)).to_numpy(value).copy(order="C")
        if dtype_name(value.dtype) != host[key].dtype.name:
            narrowed[key] = dtype_name(value.dtype)
    meta = dict(metadata or {})
    if narrowed:
        meta["dtypes"] = json.dumps(narrowed)
    tmp = f"{os.fspath(path)}.tmp"
    save_file(host, tmp, metadata=meta)
    os.replace(tmp, path)


def load_arrays(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                device: Any = None) -> tuple[dict[str, Array], dict[str, str]]:
    """Reads a safetensors file: ``(arrays on backend, metadata)``. Arrays come back in the dtype
    they were saved from (``dtype=`` casts every floating one instead). Raises
    :class:`CheckpointError` naming the file and the tensor when it is truncated or corrupt."""
    path = os.fspath(path)
    host, meta = _read_host(path)
    try:
        narrowed = json.loads(meta.get("dtypes", "{}"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: the 'dtypes' metadata is corrupt ({err})") from err
    out = {}
    for key, value in host.items():
        want = dtype if dtype is not None and value.dtype.kind == "f" else narrowed.get(key)
        out[key] = to_backend(value, backend, device=device, dtype=want)
    return out, {k: v for k, v in meta.items() if k != "dtypes"}


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
    save_arrays(path, params, metadata={**meta, **(metadata or {})})


def load_params(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                device: Any = None, return_metadata: bool = False
                ) -> tuple[Params, Mamba2Config] | tuple[Params, Mamba2Config, dict[str, str]]:
    """Reads a :func:`save_params` file: ``(params, config)`` on ``backend`` (optionally cast to
    ``dtype`` and moved to ``device``). Raises :class:`CheckpointError` naming the file and the
    tensor for truncated, corrupt or mismatched files."""
    path = os.fspath(path)
    header, _ = _parse_header(path)
    meta = header.get("__metadata__") or {}
    if "config" not in meta:
        raise CheckpointError(f"{path}: no portable_ssm config in the metadata (not written by "
                              f"save_params; for pretrained directories use load_pretrained)")
    try:
        config = Mamba2Config.from_dict(json.loads(meta["config"]))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the config in the metadata is corrupt ({err})") from err
    expected = param_shapes(config)
    for key in header:
        if key != "__metadata__" and key not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {key!r} for this config")
    for key, shape in expected.items():
        if key not in header:
            raise CheckpointError(f"{path}: tensor {key!r} is missing")
        if tuple(header[key]["shape"]) != shape:
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(header[key]['shape'])}, "
                                  f"expected {list(shape)} for this config")
    arrays, meta = load_arrays(path, backend=backend, dtype=dtype, device=device)
    params = {k: arrays[k] for k in expected}
    if return_metadata:
        return params, config, {k: v for k, v in meta.items() if k not in _RESERVED}
    return params, config


def _parse_header(path: str) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header, checked against the file size: ``(header, data_start)``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte "
                                      f"safetensors header length")
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                raise CheckpointError(f"{path}: truncated or not a safetensors file: the header "
                                      f"claims {length} bytes but the file has {size}")
            header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a safetensors file: the header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: the header is not a JSON object")
    data_size = size - 8 - length
    tensors = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: tuple(kv[1].get("data_offsets", (0, 0))))
    for key, info in tensors:
        _check_entry(path, key, info, data_size)
    return header, 8 + length


def _check_entry(path: str, key: str, info: Any, data_size: int) -> None:
    """CheckpointError naming ``key`` when its entry is malformed or its bytes lie past the end."""
    try:
        start, end = (int(v) for v in info["data_offsets"])
        shape = [int(v) for v in info["shape"]]
        itemsize = _ITEMSIZE[info["dtype"]]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: tensor {key!r} has a malformed header entry {info!r}") from err
    if end - start != math.prod(shape) * itemsize:
        raise CheckpointError(f"{path}: tensor {key!r} is corrupt: {end - start} bytes for shape "
                              f"{shape} of {info['dtype']}")
    if end > data_size:
        raise CheckpointError(f"{path}: truncated: tensor {key!r} needs bytes {start}..{end} of the "
                              f"data section but the file holds only {data_size}")


def _read_host(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Every tensor of a checked safetensors file as numpy arrays, and its metadata."""
    from safetensors import SafetensorError, safe_open

    header, _ = _parse_header(path)
    host = {}
    try:
        with safe_open(path, framework="numpy") as f:
            for key in header:
                if key != "__metadata__":
                    host[key] = _get(f, path, key)
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    return host, dict(header.get("__metadata__") or {})


def _get(f: Any, path: str, key: str) -> Any:
    from safetensors import SafetensorError

    try:
        return f.get_tensor(key)
    except (SafetensorError, TypeError) as err:
        raise CheckpointError(f"{path}: tensor {key!r} cannot be read ({err})") from err
