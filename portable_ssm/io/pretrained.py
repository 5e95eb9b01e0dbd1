"""Pretrained Mamba-2 language models from local files: ``load_pretrained`` -> :class:`~portable_ssm.Mamba2LM`.

Three sources, never the network, never an arbitrary unpickle:

* a transformers directory: ``config.json`` (``hidden_size, num_hidden_layers, state_size, ...``)
  with ``model.safetensors`` or a sharded ``model.safetensors.index.json``;
* a state-spaces (mamba_ssm) directory: ``config.json`` (``d_model, n_layer, ssm_cfg`` with
  ``layer: "Mamba2"``) with ``pytorch_model.bin`` (``torch.load(weights_only=True)``; needs torch)
  or a ``.safetensors`` file;
* a file written by :func:`portable_ssm.save_params` (or :meth:`Mamba2LM.save`).

Safetensors files are read with numpy alone (bfloat16 widened to float32 exactly, by
:mod:`portable_ssm.io.safetensors`), so a numpy-only install loads them. Every checkpoint
quirk is fixed in :func:`portable_ssm.io.layouts.sanitize`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..backends import load, to_backend
from ..language_model import Mamba2LM
from ..quantized import KINDS
from .checkpoint import load_params
from .errors import CheckpointError
from .layouts import Tensors, config_fields, sanitize

_FLOATS = ("float64", "float32", "float16", "bfloat16")


def _read_torch_bin(path: str) -> Tensors:
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


def _read(path: str) -> Tensors:
    """Every tensor of one weight file (torch ``.bin`` or safetensors) with its stored dtype name."""
    if path.endswith(".bin"):
        return _read_torch_bin(path)
    from .safetensors import read_safetensors

    arrays, dtypes, _ = read_safetensors(path)
    for name, stored in dtypes.items():
        if stored not in _FLOATS:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {stored}, expected a float "
                                  f"({', '.join(_FLOATS)})")
    return {name: (value, dtypes[name]) for name, value in arrays.items()}


def _read_weights(folder: str) -> Tensors:
    """Every tensor of a checkpoint directory: safetensors (sharded or not) first, then torch .bin."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            with open(path) as f:
                weight_map = json.load(f).get("weight_map", {})
            out: Tensors = {}
            for shard in sorted(set(weight_map.values())):
                out.update(_read(os.path.join(folder, shard)))
            missing = sorted(set(weight_map) - set(out))
            if missing:
                raise CheckpointError(f"{path}: tensor {missing[0]!r} is listed but not in its shard")
            return out
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(folder, name)):
            return _read(os.path.join(folder, name))
    others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if len(others) == 1:
        return _read(os.path.join(folder, others[0]))
    raise CheckpointError(f"{folder}: no weights found (looked for model.safetensors[.index.json], "
                          f"pytorch_model.bin[.index.json] or a single *.safetensors file)")


def _default_dtype(stored: str) -> str:
    """The parameter dtype when none is asked for: float64 stays float64, anything else is float32."""
    return "float64" if stored == "float64" else "float32"


def _load_file(path: str, backend: str, dtype: str | None, device: Any) -> Mamba2LM:
    """A :func:`save_params` file (its metadata carries the config, vocab size and eos id)."""
    from .safetensors import read_header

    meta = read_header(path)[0].get("__metadata__") or {}
    if "config" not in meta:
        raise CheckpointError(f"{path}: not written by portable_ssm (no config in its metadata); for a "
                              f"transformers or state-spaces checkpoint pass the directory with config.json")
    stored = meta.get("dtype", "float32")
    params, config = load_params(path, backend=backend, dtype=dtype or _default_dtype(stored), device=device)
    eos = meta.get("eos_token_id")
    return Mamba2LM(params, config, vocab_size=int(meta.get("vocab_size", config.vocab_size)),
                    eos_token_id=None if eos is None else int(eos), checkpoint_dtype=stored)


def load_pretrained(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                    device: Any = None, weights: str = "float32") -> Mamba2LM:
    """A :class:`Mamba2LM` from a transformers or state-spaces directory or a save_params file.

    Args:
        path: a checkpoint directory (with ``config.json``) or a :func:`save_params` file.
        backend: ``"numpy" | "torch" | "jax" | "cupy" | "array_api_strict"``.
        dtype: parameter dtype by name; ``None`` is float32 (float64 checkpoints stay float64),
            whatever the stored dtype (bf16 checkpoints are widened exactly).
        device: target device (``"cuda:0"``, ...).
        weights: ``"float32"`` (as loaded), or ``"int8"`` / ``"bfloat16"`` storage of the
            projections, embedding and head (:func:`portable_ssm.quantize`; float32 params only).

    Raises :class:`portable_ssm.CheckpointError` naming the file and the tensor for
    missing, unexpected or misshapen tensors and unsupported configs; FileNotFoundError when
    nothing is at ``path``.
    """
    path = os.fspath(path)
    if weights not in KINDS:
        raise ValueError(f"weights: expected one of {', '.join(map(repr, KINDS))}, got {weights!r}")
    if os.path.isfile(path):
        return _load_file(path, backend, dtype, device).quantize(weights)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: expected a checkpoint directory with config.json or a file "
                                f"written by portable_ssm.save_params")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    fields = config_fields(raw, path)
    config, host, vocab = sanitize(fields, _read_weights(path), path)
    stored = host["embedding.weight"][1]
    dtype = dtype or _default_dtype(stored)
    params = {k: to_backend(v, backend, device=device, dtype=dtype) for k, (v, _) in host.items()}
    eos = raw.get("eos_token_id")
    layout = "transformers" if "hidden_size" in raw else "state-spaces"
    return Mamba2LM(params, config, vocab_size=vocab, eos_token_id=eos if isinstance(eos, int) else None,
                    layout=layout, checkpoint_dtype=stored).quantize(weights)
