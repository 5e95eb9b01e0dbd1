"""Checkpoints: safetensors files in core names with the config as JSON metadata. Never pickle.

``save_params(path, params, config)`` writes every parameter and ``load_params(path)`` reads
them back on any backend, numpy-only machines included, bit-exact. ``save_arrays``/``load_arrays``
do the same for any named arrays (optimizer state, task heads), without a config.

NumPy has no bfloat16, so bf16/fp16 arrays are stored widened to float32 (exact) and the
``dtypes`` metadata entry narrows them again on load unless ``dtype=`` says otherwise.

Files are read and written by :mod:`portable_ssm.io.safetensors` with NumPy alone (the
``safetensors`` package is not needed): the header is checked against the file size before any
data is read, so a truncated or corrupt file raises :class:`CheckpointError` naming the file and
the first tensor that is cut or malformed.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .._array import Array, array_backend, dtype_name
from ..backends import load, to_backend
from ..config import Mamba2Config
from ..params import Params, check_params, param_shapes
from .errors import CheckpointError

if TYPE_CHECKING:
    from .safetensors import Contents

FORMAT = "portable_ssm.v1"
_RESERVED = ("format", "config", "dtype", "dtypes")


def save_arrays(path: str | os.PathLike, arrays: dict[str, Array], *,
                metadata: dict[str, str] | None = None) -> None:
    """Writes named arrays (any backend; floating, integer or bool) to a safetensors file.

    The file is written next to ``path`` and renamed over it, so a crash never leaves half a file
    under the final name. ``metadata`` values must be strings.
    """
    from .safetensors import write_safetensors

    host, narrowed = {}, {}
    for key, value in arrays.items():
        host[key] = load(array_backend(value)).to_numpy(value)
        if dtype_name(value.dtype) != host[key].dtype.name:
            narrowed[key] = dtype_name(value.dtype)
    meta = dict(metadata or {})
    if narrowed:
        meta["dtypes"] = json.dumps(narrowed)
    tmp = f"{os.fspath(path)}.tmp"
    write_safetensors(tmp, host, meta)
    os.replace(tmp, path)


def load_arrays(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                device: Any = None) -> tuple[dict[str, Array], dict[str, str]]:
    """Reads a safetensors file: ``(arrays on backend, metadata)``. Arrays come back in the dtype
    they were saved from (``dtype=`` casts every floating one instead; BF16 tensors of files not
    written here come back float32). Raises :class:`CheckpointError` naming the file and the
    tensor when it is truncated or corrupt."""
    path = os.fspath(path)
    return _on_backend(path, _read(path), backend, dtype, device)


def _read(path: str) -> Contents:
    """The safetensors file at ``path`` on the host (numpy arrays); numpy is imported here, not on import."""
    from .safetensors import read_safetensors

    return read_safetensors(path)


def _on_backend(path: str, contents: Contents, backend: str, dtype: str | None,
                device: Any) -> tuple[dict[str, Array], dict[str, str]]:
    """``contents`` on ``backend``: each array narrowed back to the dtype it was saved from (or its
    floating ones cast to ``dtype``), and the metadata less the ``dtypes`` entry."""
    meta = contents.metadata
    try:
        narrowed = json.loads(meta.get("dtypes", "{}"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: the 'dtypes' metadata is corrupt ({err})") from err
    out = {}
    for key, value in contents.arrays.items():
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
    contents = _read(path)
    config = _config(path, contents.metadata)
    expected = param_shapes(config)
    _check_shapes(path, contents.arrays, expected)
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
    try:
        return Mamba2Config.from_dict(json.loads(metadata["config"]))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the config in the metadata is corrupt ({err})") from err


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
