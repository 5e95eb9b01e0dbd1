"""Safetensors files read and written with NumPy alone: the one place the byte format lives.

A file is an 8-byte little-endian header length, a JSON header (``__metadata__``: strings; per
tensor ``dtype``, ``shape`` and ``data_offsets`` into the data section) and the little-endian data.

Reading validates the whole header before any tensor data is read, with the rules of the
``safetensors`` package and a few more: only regular files are opened (a FIFO or device never
blocks); the header is at most 100 MB of UTF-8 JSON starting with ``{``, without duplicate keys,
NaN/Infinity or nesting deep enough to exhaust the stack; dtypes come from an explicit table;
shapes and offsets are lists of non-negative ints (no bool, float or string) below 2**64; the
tensors' byte ranges are in order, contiguous and cover the data section exactly (no overlap, gap
or trailing bytes). Each tensor is then read once into its own new array, so memory stays at the
arrays returned plus one tensor's raw bytes. Every failure is a
:class:`~portable_ssm.io.CheckpointError` naming the file and the tensor or key.

:func:`write_safetensors` lays files out as the ``safetensors`` package does (tensors ordered by
dtype, widest first, then by name, so each starts aligned; header padded with spaces to 8 bytes),
writes BF16 and F16 natively, and publishes the file atomically and durably
(:func:`~portable_ssm.io.atomic.replace_atomically`); neither reading nor writing needs the package.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from .atomic import replace_atomically
from .errors import CheckpointError
from .paths import open_regular
from .strict_json import SHORT, loads

#: safetensors dtype -> little-endian numpy dtype (BF16: its raw bits), in the order the
#: safetensors package writes tensors in.
_DTYPES = {"U64": "<u8", "I64": "<i8", "F64": "<f8", "F32": "<f4", "U32": "<u4", "I32": "<i4", "BF16": "<u2",
           "F16": "<f2", "U16": "<u2", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
#: numpy dtype name -> safetensors dtype, for writing (numpy has no bfloat16).
_KINDS = {np.dtype(code).name: kind for kind, code in _DTYPES.items() if kind != "BF16"}
#: The largest header the ``safetensors`` package reads.
MAX_HEADER_BYTES = 100_000_000
#: Offsets, sizes and dimensions are u64 in the format.
_U64 = 2**64
_FIELDS = ("dtype", "shape", "data_offsets")


class Contents(NamedTuple):
    """A safetensors file on the host.

    ``arrays``: numpy arrays, each freshly allocated (owned, aligned, writable, native byte order),
    BF16 widened exactly to float32; ``dtypes``: each tensor's stored dtype by name (``"bfloat16"``,
    ``"float16"``, ``"int64"``, ``"bool"``, ...); ``metadata``: the ``__metadata__`` strings.
    """

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    metadata: dict[str, str]


class _Entry(NamedTuple):
    """One checked header entry: its bytes are ``start..end`` of the data section."""

    name: str
    kind: str
    shape: tuple[int, ...]
    start: int
    end: int


def _stored_name(kind: str) -> str:
    """The dtype name of a safetensors dtype (``"BF16"`` -> ``"bfloat16"``, ``"I64"`` -> ``"int64"``)."""
    return "bfloat16" if kind == "BF16" else np.dtype(_DTYPES[kind]).name


def _read_exactly(f: BinaryIO, view: memoryview) -> int:
    """Fills ``view`` from ``f``; the number of bytes read (short only at the end of the file)."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            break
        done += got
    return done


def _header(path: str, f: BinaryIO, size: int) -> tuple[dict[str, Any], list[_Entry], int]:
    """The checked header of the open file ``f`` of ``size`` bytes: ``(header, entries in file order,
    data_start)``."""
    head = bytearray(8)
    if _read_exactly(f, memoryview(head)) < 8:
        raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte "
                              f"safetensors header length")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: not a safetensors file: the header length {length} exceeds the "
                              f"{MAX_HEADER_BYTES}-byte limit")
    if 8 + length > size:
        raise CheckpointError(f"{path}: truncated or not a safetensors file: the header claims {length} "
                              f"bytes but the file has {size}")
    raw = bytearray(length)
    if _read_exactly(f, memoryview(raw)) < length:
        raise CheckpointError(f"{path}: truncated: the file ends inside its header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path}: not a safetensors file: the header is not UTF-8 ({err})") from None
    if not text.startswith("{"):
        raise CheckpointError(f"{path}: not a safetensors file: the header does not start with '{{'")
    header = loads(text, f"{path}: not a safetensors file: the header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: the header is not a JSON object")
    _check_metadata(path, header.get("__metadata__"))
    entries = sorted((_entry(path, k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda e: (e.start, e.end))
    _check_layout(path, entries, size - 8 - length)
    return header, entries, 8 + length


def _check_metadata(path: str, metadata: Any) -> None:
    """CheckpointError naming the key unless ``__metadata__`` is absent, null or maps strings to strings."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: '__metadata__' is {type(metadata).__name__}, expected a map of strings")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise CheckpointError(f"{path}: '__metadata__' entry {SHORT.repr(key)} is "
                                  f"{type(value).__name__}, expected a string")


def _u64s(path: str, name: str, field: str, value: Any, length: int | None = None) -> tuple[int, ...]:
    """``value`` as a tuple of ints in ``[0, 2**64)`` (of ``length`` items); CheckpointError otherwise."""
    ok = isinstance(value, list) and (length is None or len(value) == length)
    if ok and all(type(v) is int and 0 <= v < _U64 for v in value):
        return tuple(value)
    count = "two" if length == 2 else "a list of"
    raise CheckpointError(f"{path}: tensor {SHORT.repr(name)}: '{field}' must be {count} non-negative "
                          f"integers below 2**64, got {SHORT.repr(value)}")


def _entry(path: str, name: str, info: Any) -> _Entry:
    """One tensor's header entry, type-checked field by field; CheckpointError naming ``name``."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {SHORT.repr(name)}: the header entry is "
                              f"{type(info).__name__}, expected an object with {', '.join(_FIELDS)}")
    missing = [k for k in _FIELDS if k not in info]
    if missing:
        raise CheckpointError(f"{path}: tensor {SHORT.repr(name)}: the header entry has no {missing[0]!r}")
    kind = info["dtype"]
    if not isinstance(kind, str) or kind not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {SHORT.repr(name)} has dtype {SHORT.repr(kind)}; this reader "
                              f"reads {', '.join(_DTYPES)}")
    shape = _u64s(path, name, "shape", info["shape"])
    start, end = _u64s(path, name, "data_offsets", info["data_offsets"], length=2)
    nbytes = np.dtype(_DTYPES[kind]).itemsize
    for n in shape:
        nbytes *= n
        if nbytes >= _U64:
            raise CheckpointError(f"{path}: tensor {SHORT.repr(name)} is corrupt: shape "
                                  f"{SHORT.repr(list(shape))} of {kind} holds 2**64 bytes or more")
    if end < start or end - start != nbytes:
        raise CheckpointError(f"{path}: tensor {SHORT.repr(name)} is corrupt: data_offsets [{start}, {end}] "
                              f"for shape {list(shape)} of {kind}, which takes {nbytes} bytes")
    return _Entry(name, kind, shape, start, end)


def _check_layout(path: str, entries: list[_Entry], data_size: int) -> None:
    """CheckpointError naming the tensor unless the entries (in file order) tile the data section
    exactly: each starts where the previous ends, none past the end, nothing after the last."""
    position, previous = 0, None
    for entry in entries:
        if entry.start < position:
            raise CheckpointError(f"{path}: tensor {SHORT.repr(entry.name)} is corrupt: its bytes "
                                  f"{entry.start}..{entry.end} overlap those of {SHORT.repr(previous)}")
        if entry.start > position:
            raise CheckpointError(f"{path}: tensor {SHORT.repr(entry.name)} is corrupt: it starts at byte "
                                  f"{entry.start} of the data section but the tensor before ends at {position}")
        if entry.end > data_size:
            raise CheckpointError(f"{path}: truncated: tensor {SHORT.repr(entry.name)} needs bytes "
                                  f"{entry.start}..{entry.end} of the data section but the file holds only "
                                  f"{data_size}")
        position, previous = entry.end, entry.name
    if position != data_size:
        raise CheckpointError(f"{path}: corrupt: {data_size - position} bytes after the last tensor "
                              f"(the data section holds {data_size}, the tensors {position})")


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file at ``path``, fully validated (see the module
    docstring): ``(header, data_start)``. CheckpointError naming the file and the tensor otherwise."""
    path = os.fspath(path)
    f, size = open_regular(path, what="safetensors file", buffering=0)
    with f:
        header, _, data_start = _header(path, f, size)
    return header, data_start


def read_safetensors(path: str | os.PathLike) -> Contents:
    """Every tensor of the safetensors file at ``path``, with its stored dtype and the metadata.

    Reads every dtype the format defines but the 8-, 6- and 4-bit floats: F64, F32, F16, BF16, the
    signed and unsigned integers and BOOL. Raises CheckpointError naming the file and the tensor
    or key when the file is truncated, corrupt or hostile (see the module docstring).
    """
    path = os.fspath(path)
    f, size = open_regular(path, what="safetensors file", buffering=0)
    arrays, dtypes = {}, {}
    with f:
        header, entries, data_start = _header(path, f, size)
        f.seek(data_start)
        for entry in entries:
            arrays[entry.name] = _read_tensor(f, path, entry)
            dtypes[entry.name] = _stored_name(entry.kind)
    return Contents(arrays, dtypes, dict(header.get("__metadata__") or {}))


def _read_tensor(f: BinaryIO, path: str, entry: _Entry) -> np.ndarray:
    """The next tensor of ``f`` (positioned at its first byte), read into a new array (BF16 widened to
    float32)."""
    dtype = np.dtype(_DTYPES[entry.kind])
    flat = np.empty(math.prod(entry.shape), dtype)
    if _read_exactly(f, memoryview(flat.view(np.uint8))) < flat.nbytes:  # the file shrank meanwhile
        raise CheckpointError(f"{path}: truncated: tensor {SHORT.repr(entry.name)} ends past the end of the file")
    if entry.kind == "BF16":  # bfloat16 is the top half of a float32
        return np.left_shift(flat, 16, dtype=np.uint32).view(np.float32).reshape(entry.shape)
    return flat.astype(dtype.newbyteorder("="), copy=False).reshape(entry.shape)


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` as bfloat16 bit patterns (little-endian uint16), as ``torch`` narrows them:
    rounded to nearest even. Values that are bfloat16 already (the low 16 bits zero: anything widened
    from bfloat16) keep their bits exactly, NaN payloads included; other NaNs become 0x7FC0."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    top = (bits >> 16).astype(np.uint16)
    rounded = ((bits + (np.uint32(0x7FFF) + (top & 1))) >> 16).astype(np.uint16)
    exact = (bits & 0xFFFF) == 0
    return np.where(exact, top, np.where(np.isnan(values), np.uint16(0x7FC0), rounded)).astype("<u2")


def write_safetensors(path: str | os.PathLike, arrays: dict[str, np.ndarray], metadata: dict[str, str], *,
                      narrow: Mapping[str, str] | None = None) -> None:
    """Writes numpy ``arrays`` and string ``metadata`` as a safetensors file at ``path``, replacing it
    atomically and durably.

    ``narrow`` maps names of floating arrays to ``"bfloat16"`` or ``"float16"``: they are stored as
    BF16 (see :func:`bfloat16_bits`) or F16 (numpy's round to nearest even), so bf16/fp16 arrays
    widened to float32 on the host are written in their own dtype, bit-exact. TypeError naming the
    array whose dtype safetensors cannot hold or the metadata key whose value is not a string;
    OSError naming ``path`` when it cannot be written (nothing is left behind then).
    """
    narrow = dict(narrow or {})
    stored = {key: _stored(key, value, narrow.get(key)) for key, value in arrays.items()}
    wrong = sorted(k for k, v in metadata.items() if not isinstance(v, str))
    if wrong:
        raise TypeError(f"metadata: values must be strings, got {type(metadata[wrong[0]]).__name__} "
                        f"for {wrong[0]!r}")
    order = sorted(arrays, key=lambda k: (list(_DTYPES).index(stored[k]), k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for key in order:
        size = arrays[key].size * np.dtype(_DTYPES[stored[key]]).itemsize
        header[key] = {"dtype": stored[key], "shape": list(arrays[key].shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in order:
            value = arrays[key]
            data = bfloat16_bits(value) if stored[key] == "BF16" else np.ascontiguousarray(value, _DTYPES[stored[key]])
            f.write(memoryview(data.reshape(-1).view(np.uint8)))

    replace_atomically(path, write)


def _stored(key: str, value: np.ndarray, narrow: str | None) -> str:
    """The safetensors dtype ``value`` is stored as; TypeError naming ``key`` when there is none."""
    if key == "__metadata__":
        raise TypeError("arrays: the name '__metadata__' is reserved by the safetensors format")
    if narrow is not None:
        if narrow not in ("bfloat16", "float16") or value.dtype.kind != "f":
            raise TypeError(f"{key}: only floating arrays narrow, and only to bfloat16 or float16; got "
                            f"{value.dtype.name} to {narrow!r}")
        return "BF16" if narrow == "bfloat16" else "F16"
    if value.dtype.name not in _KINDS:
        raise TypeError(f"{key}: safetensors holds no {value.dtype.name} arrays; expected one of "
                        f"{', '.join(_KINDS)}")
    return _KINDS[value.dtype.name]
