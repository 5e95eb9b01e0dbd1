"""Safetensors files read and written with NumPy alone: the one place the byte format lives.

A file is an 8-byte little-endian header length, a JSON header (``__metadata__``: strings; per
tensor ``dtype``, ``shape`` and ``data_offsets`` into the data section) and the little-endian data.
:func:`read_header` parses the header and checks every entry against the file size before any
data is read, so a truncated or corrupt file raises :class:`~portable_ssm.io.CheckpointError`
naming the file and the first tensor that is cut or malformed.

:func:`write_safetensors` lays files out as the ``safetensors`` package does (tensors ordered by
dtype, widest first, then by name, so each starts aligned; header padded with spaces to 8 bytes),
and that package reads them back; neither reading nor writing needs it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from .errors import CheckpointError

#: safetensors dtype -> little-endian numpy dtype (BF16: its raw bits), in the order the
#: safetensors package writes tensors in.
_DTYPES = {"U64": "<u8", "I64": "<i8", "F64": "<f8", "F32": "<f4", "U32": "<u4", "I32": "<i4", "BF16": "<u2",
           "F16": "<f2", "U16": "<u2", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
#: numpy dtype name -> safetensors dtype, for writing (numpy has no bfloat16).
_KINDS = {np.dtype(code).name: kind for kind, code in _DTYPES.items() if kind != "BF16"}


class Contents(NamedTuple):
    """A safetensors file on the host.

    ``arrays``: numpy arrays, each freshly allocated (owned, aligned, writable, native byte order),
    BF16 widened exactly to float32; ``dtypes``: each tensor's stored dtype by name (``"bfloat16"``,
    ``"float16"``, ``"int64"``, ``"bool"``, ...); ``metadata``: the ``__metadata__`` strings.
    """

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    metadata: dict[str, str]


def _stored_name(kind: str) -> str:
    """The dtype name of a safetensors dtype (``"BF16"`` -> ``"bfloat16"``, ``"I64"`` -> ``"int64"``)."""
    return "bfloat16" if kind == "BF16" else np.dtype(_DTYPES[kind]).name


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file at ``path``, checked against the file size:
    ``(header, data_start)``. CheckpointError naming the file (and the tensor) otherwise."""
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
    _check_metadata(path, header.get("__metadata__") or {})
    data_size = size - 8 - length
    tensors = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: _offsets(kv[1]))
    for key, info in tensors:
        _check_entry(path, key, info, data_size)
    return header, 8 + length


def _offsets(info: Any) -> tuple[int, ...]:
    """An entry's ``data_offsets`` to check the entries in file order (malformed ones sort first)."""
    try:
        return tuple(int(v) for v in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        return ()


def _check_metadata(path: str, metadata: Any) -> None:
    """CheckpointError unless ``__metadata__`` maps strings to strings."""
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: not a safetensors file: '__metadata__' is not a map of strings")


def _check_entry(path: str, key: str, info: Any, data_size: int) -> None:
    """CheckpointError naming ``key`` when its entry is malformed or its bytes lie past the end."""
    try:
        start, end = (int(v) for v in info["data_offsets"])
        shape = [int(v) for v in info["shape"]]
        kind = info["dtype"]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: tensor {key!r} has a malformed header entry {info!r}") from err
    if not isinstance(kind, str) or kind not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {key!r} has dtype {kind!r}; readable are {', '.join(_DTYPES)}")
    itemsize = np.dtype(_DTYPES[kind]).itemsize
    if start < 0 or min(shape, default=0) < 0 or end - start != math.prod(shape) * itemsize:
        raise CheckpointError(f"{path}: tensor {key!r} is corrupt: {end - start} bytes for shape "
                              f"{shape} of {kind}")
    if end > data_size:
        raise CheckpointError(f"{path}: truncated: tensor {key!r} needs bytes {start}..{end} of the "
                              f"data section but the file holds only {data_size}")


def read_safetensors(path: str | os.PathLike) -> Contents:
    """Every tensor of the safetensors file at ``path``, with its stored dtype and the metadata.

    Reads every dtype the format defines but the 8- and 4-bit floats: F64, F32, F16, BF16, the
    signed and unsigned integers and BOOL. Raises CheckpointError naming the file and the tensor
    when the file is truncated or corrupt.
    """
    path = os.fspath(path)
    header, data_start = read_header(path)
    arrays, dtypes = {}, {}
    with open(path, "rb") as f:
        for key, info in header.items():
            if key != "__metadata__":
                arrays[key] = _read_tensor(f, path, key, info, data_start)
                dtypes[key] = _stored_name(info["dtype"])
    return Contents(arrays, dtypes, dict(header.get("__metadata__") or {}))


def _read_tensor(f: BinaryIO, path: str, key: str, info: dict[str, Any], data_start: int) -> np.ndarray:
    """One checked header entry's tensor, read into a new array (BF16 widened to float32)."""
    dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(int(n) for n in info["shape"])
    f.seek(data_start + int(info["data_offsets"][0]))
    flat = np.fromfile(f, dtype=dtype, count=math.prod(shape))
    if flat.size != math.prod(shape):  # the file shrank after its header was checked
        raise CheckpointError(f"{path}: truncated: tensor {key!r} ends past the end of the file")
    if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
        return (flat.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return flat.astype(dtype.newbyteorder("="), copy=False).reshape(shape)


def write_safetensors(path: str | os.PathLike, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Writes numpy ``arrays`` and string ``metadata`` as a safetensors file at ``path`` (overwriting it).

    TypeError naming the array whose dtype safetensors cannot hold (numpy has no bfloat16: widen
    it first) or the metadata key whose value is not a string.
    """
    kinds = {key: _kind(key, value) for key, value in arrays.items()}
    wrong = sorted(k for k, v in metadata.items() if not isinstance(v, str))
    if wrong:
        raise TypeError(f"metadata: values must be strings, got {type(metadata[wrong[0]]).__name__} "
                        f"for {wrong[0]!r}")
    order = sorted(arrays, key=lambda k: (list(_DTYPES).index(kinds[k]), k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for key in order:
        size = arrays[key].size * np.dtype(_DTYPES[kinds[key]]).itemsize
        header[key] = {"dtype": kinds[key], "shape": list(arrays[key].shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in order:
            np.ascontiguousarray(arrays[key], dtype=_DTYPES[kinds[key]]).tofile(f)


def _kind(key: str, value: np.ndarray) -> str:
    """The safetensors dtype of a numpy array; TypeError naming ``key`` when there is none."""
    if key == "__metadata__":
        raise TypeError("arrays: the name '__metadata__' is reserved by the safetensors format")
    if value.dtype.name not in _KINDS:
        raise TypeError(f"{key}: safetensors holds no {value.dtype.name} arrays; expected one of "
                        f"{', '.join(_KINDS)}")
    return _KINDS[value.dtype.name]
