"""A checkpoint folder's weight files: found (safetensors, sharded or not, then torch ``.bin``),
checked (shard names stay inside the folder; in a Hub cache snapshot every file resolves into
the snapshot or its ``blobs/``) and read (floating tensors only, each in the shard its index
names). Shared by the Mamba-2 loader (:mod:`.pretrained`) and the hybrid families' (:mod:`.hybrid`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..backends import load
from .errors import CheckpointError
from .layouts import Tensors, shown
from .paths import allowed_roots, check_inside, regular
from .strict_json import read_file

#: The stored dtypes a weight tensor may have.
FLOATS = ("float64", "float32", "float16", "bfloat16")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_DRIVE = re.compile(r"^[A-Za-z]:")


def read_torch_bin(path: str) -> Tensors:
    """A torch state dict of tensors (``torch.load(weights_only=True)``: nothing else is unpickled)."""
    try:
        torch_backend = load("torch")
    except ImportError:
        raise ImportError(f"{path}: reading a .bin checkpoint needs torch (pip install "
                          f"'portable-ssm[torch]'), or convert it to safetensors") from None
    try:
        return torch_backend.read_state_dict(path)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None


def read_weight_file(path: str) -> Tensors:
    """Every tensor of one weight file (torch ``.bin`` or safetensors) with its stored dtype name;
    CheckpointError naming the tensor unless every one is floating."""
    if path.endswith(".bin"):
        tensors = read_torch_bin(path)
    else:
        from .safetensors import read_safetensors

        arrays, dtypes, _ = read_safetensors(path)
        tensors = {name: (value, dtypes[name]) for name, value in arrays.items()}
    for name, (_, stored) in tensors.items():
        if stored not in FLOATS:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {stored}, expected a float "
                                  f"({', '.join(FLOATS)})")
    return tensors


def shard_path(folder: str, index: str, name: Any) -> str:
    """The file a shard index names: a relative path inside ``folder``, never ``..``, an absolute
    path or a drive, nor under a directory symlinked out of ``folder``. The file itself may be a
    symlink (the Hugging Face cache links every file of a snapshot to ``../../blobs/<hash>``)."""
    parts = name.split("/") if isinstance(name, str) else []
    if (not parts or "\\" in name or "\0" in name or _DRIVE.match(name)
            or any(part in ("", ".", "..") for part in parts)):
        raise CheckpointError(f"{index}: weight_map: shard {shown(name)} is not a relative path inside the model "
                              f"directory (no '..', absolute path or drive letter)")
    path = os.path.join(folder, *parts)
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(os.path.dirname(path))]) != root:
        raise CheckpointError(f"{index}: weight_map: shard {name!r} lies in a directory outside the model "
                              f"directory (a symlinked directory)")
    return path


def weight_map_of(index: str, folder: str) -> dict[str, str]:
    """A shard index's ``weight_map``: tensor name -> shard file, every name checked."""
    raw = read_file(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map: expected a non-empty JSON object of tensor name -> "
                              f"shard file, got {type(weight_map).__name__}")
    return {tensor: shard_path(folder, index, shard) for tensor, shard in weight_map.items()}


def check_weight_file(path: str, folder: str) -> str:
    """``path``, checked: in a Hub cache snapshot every file must resolve into the snapshot or its
    repository's ``blobs/``; a local directory's weight file may link anywhere (another disk)."""
    if len(allowed_roots(folder)) > 1:
        check_inside(path, folder)
    return path


def weight_files(folder: str) -> tuple[list[str], str | None, dict[str, str]]:
    """``(weight files, shard index or None, its weight_map)`` of a checkpoint directory:
    safetensors (sharded or not) first, then torch .bin."""
    for name in _INDEXES:
        index = os.path.join(folder, name)
        if regular(index):
            weight_map = weight_map_of(index, folder)
            for path in sorted(set(weight_map.values())):
                if not regular(path):
                    raise CheckpointError(f"{index}: shard {os.path.relpath(path, folder)!r} is listed but missing")
                check_weight_file(path, folder)
            return sorted(set(weight_map.values())), index, weight_map
    for name in ("model.safetensors", "pytorch_model.bin"):
        if regular(os.path.join(folder, name)):
            return [check_weight_file(os.path.join(folder, name), folder)], None, {}
    others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if len(others) == 1 and regular(os.path.join(folder, others[0])):
        return [check_weight_file(os.path.join(folder, others[0]), folder)], None, {}
    raise CheckpointError(f"{folder}: no weights found (looked for model.safetensors[.index.json], "
                          f"pytorch_model.bin[.index.json] or a single *.safetensors file)")


def read_weights(files: list[str], index: str | None, weight_map: dict[str, str]) -> Tensors:
    """Every tensor of the weight files; with an index, each tensor must be in the shard it names."""
    out: Tensors = {}
    where: dict[str, str] = {}
    for path in files:
        for name, value in read_weight_file(path).items():
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} is also in {where[name]}")
            out[name], where[name] = value, path
    for name, path in weight_map.items():
        if where.get(name) != path:
            raise CheckpointError(f"{index}: tensor {shown(name)} is listed but not in its shard "
                                  f"{os.path.basename(path)!r}")
    return out


def default_dtype(stored: str) -> str:
    """The parameter dtype when none is asked for: float64 stays float64, anything else is float32."""
    return "float64" if stored == "float64" else "float32"
