"""Checkpoints: safetensors files in core names with the config as JSON metadata. Never pickle.

``save_params(path, params, config)`` writes every parameter and ``load_params(path)`` reads
them back on any backend, numpy-only machines included, bit-exact. NumPy has no bfloat16, so
bf16/fp16 parameters are stored widened to float32 (exact) and the stored ``dtype`` entry
narrows them again on load unless ``dtype=`` says otherwise.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ._array import array_backend, dtype_name
from .backends import load, to_backend
from .config import Mamba2Config
from .params import Params, check_params, param_shapes

FORMAT = "portable_ssm.v1"


class CheckpointError(ValueError):
    """A checkpoint file that is corrupt, truncated or does not match its config."""


def save_params(path: str | os.PathLike, params: Params, config: Mamba2Config, *,
                metadata: dict[str, str] | None = None) -> None:
    """Writes ``params`` (validated against ``config``) to a safetensors file at ``path``.

    ``metadata`` adds string entries (e.g. a training step) next to the config; they come back
    from :func:`load_params` with ``return_metadata=True``.
    """
    from safetensors.numpy import save_file

    check_params(params, config)
    host = {k: load(array_backend(v)).to_numpy(v) for k, v in params.items()}
    first = next(iter(params.values()))
    meta = {"format": FORMAT, "config": json.dumps(config.to_dict()), "dtype": dtype_name(first.dtype)}
    meta.update(metadata or {})
    tmp = f"{os.fspath(path)}.tmp"
    save_file({k: v.copy(order="C") for k, v in host.items()}, tmp, metadata=meta)
    os.replace(tmp, path)


def load_params(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                device: Any = None, return_metadata: bool = False
                ) -> tuple[Params, Mamba2Config] | tuple[Params, Mamba2Config, dict[str, str]]:
    """Reads a :func:`save_params` file: ``(params, config)`` on ``backend`` (optionally cast to
    ``dtype`` and moved to ``device``). Raises :class:`CheckpointError` naming the file and the
    tensor for truncated, corrupt or mismatched files."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            if "config" not in meta:
                raise CheckpointError(f"{path}: no portable_ssm config in the metadata (not written by "
                                      f"save_params; for pretrained directories use load_pretrained)")
            config = Mamba2Config.from_dict(json.loads(meta["config"]))
            expected = param_shapes(config)
            host = {}
            for key in f.keys():
                if key not in expected:
                    raise CheckpointError(f"{path}: unexpected tensor {key!r} for this config")
                try:
                    host[key] = f.get_tensor(key)
                except SafetensorError as err:
                    raise CheckpointError(f"{path}: tensor {key!r} cannot be read ({err})") from err
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    except (json.JSONDecodeError, TypeError) as err:
        raise CheckpointError(f"{path}: the config in the metadata is corrupt ({err})") from err
    for key, shape in expected.items():
        if key not in host:
            raise CheckpointError(f"{path}: tensor {key!r} is missing")
        if tuple(host[key].shape) != shape:
            raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(host[key].shape)}, "
                                  f"expected {list(shape)} for this config")
    dtype = dtype or meta.get("dtype")
    params = {k: to_backend(host[k], backend, device=device, dtype=dtype) for k in expected}
    if return_metadata:
        extra = {k: v for k, v in meta.items() if k not in ("format", "config", "dtype")}
        return params, config, extra
    return params, config
