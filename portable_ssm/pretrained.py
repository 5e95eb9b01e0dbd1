"""Pretrained Mamba-2 language models from local files: ``load_pretrained`` and ``Mamba2LM``.

Three sources, never the network, never an arbitrary unpickle:

* a transformers directory: ``config.json`` (``hidden_size, num_hidden_layers, state_size, ...``)
  with ``model.safetensors`` or a sharded ``model.safetensors.index.json``;
* a state-spaces (mamba_ssm) directory: ``config.json`` (``d_model, n_layer, ssm_cfg`` with
  ``layer: "Mamba2"``) with ``pytorch_model.bin`` (``torch.load(weights_only=True)``; needs torch)
  or a ``.safetensors`` file;
* a file written by :func:`portable_ssm.checkpoint.save_params` (or :meth:`Mamba2LM.save`).

Safetensors files are read with numpy alone (bfloat16 widened to float32 exactly, by
:mod:`portable_ssm.backends.safetensors_io`), so a numpy-only install loads them. Every checkpoint
quirk is fixed in :func:`portable_ssm.layouts.sanitize`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

from ._array import Array, array_backend, device, dtype_name, namespace
from .backends import load, to_backend
from .checkpoint import CheckpointError, load_params, save_params
from .config import Mamba2Config
from .generation import check_token_ids, generate, stream
from .layouts import Tensors, config_fields, sanitize
from .lm import logits as lm_logits
from .params import Params, check_params

_FLOATS = ("float64", "float32", "float16", "bfloat16")


def _read_torch_bin(path: str) -> Tensors:
    """A torch state dict of tensors, loaded with ``weights_only=True`` (nothing else is unpickled)."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"{path}: reading a .bin checkpoint needs torch (pip install "
                          f"'portable-ssm[torch]'), or convert it to safetensors") from None
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path}: not a plain state dict of tensors (loaded with "
                              f"weights_only=True: {err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict of tensors, got {type(state).__name__}")
    host = load("torch")
    out = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(value).__name__}, expected a tensor")
        out[name] = (host.to_numpy(value), dtype_name(value.dtype))
    return out


def _read(path: str) -> Tensors:
    """Every tensor of one weight file (torch ``.bin`` or safetensors) with its stored dtype name."""
    if path.endswith(".bin"):
        return _read_torch_bin(path)
    from .backends.safetensors_io import read_safetensors

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


class Mamba2LM:
    """A Mamba-2 language model on one backend: ``config``, ``params`` (core names) and helpers.

    Attributes: ``vocab_size`` (the real vocabulary; generation never picks the padding rows
    above it), ``eos_token_id`` (from the checkpoint's config, or None), ``layout``
    (``"transformers" | "state-spaces" | "portable_ssm"``), ``checkpoint_dtype`` (as stored).
    """

    def __init__(self, params: Params, config: Mamba2Config, *, vocab_size: int | None = None,
                 eos_token_id: int | None = None, layout: str = "portable_ssm",
                 checkpoint_dtype: str | None = None) -> None:
        check_params(params, config)
        if config.vocab_size is None:
            raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
        self.config, self.params = config, params
        self.vocab_size = config.vocab_size if vocab_size is None else vocab_size
        if not 0 < self.vocab_size <= config.padded_vocab_size:
            raise ValueError(f"vocab_size: expected an int in [1, {config.padded_vocab_size}] (the "
                             f"embedding rows), got {vocab_size!r}")
        self.eos_token_id, self.layout = eos_token_id, layout
        self.checkpoint_dtype = checkpoint_dtype or self.dtype

    @property
    def backend(self) -> str:
        return array_backend(self.params["embedding.weight"])

    @property
    def device(self) -> Any:
        return device(self.params["embedding.weight"])

    @property
    def dtype(self) -> str:
        return dtype_name(self.params["embedding.weight"].dtype)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.params.values())

    def _ids(self, input_ids: Any) -> Array:
        """Lists of ints become arrays on the model's backend; arrays must already be there."""
        if isinstance(input_ids, (list, tuple)):
            import numpy as np

            input_ids = to_backend(np.asarray(input_ids, dtype=np.int64), self.backend, device=self.device)
        namespace(input_ids=input_ids, params=self.params["embedding.weight"])
        return input_ids

    def logits(self, input_ids: Any) -> Array:
        """``input_ids [b, l]`` (array or nested list of ints) -> ``[b, l, rows]``, rows being the
        checkpoint's embedding rows (``config.padded_vocab_size``)."""
        ids = self._ids(input_ids)
        xp = namespace(input_ids=ids)
        check_token_ids("input_ids", ids, self.config.padded_vocab_size, xp=xp)
        return lm_logits(ids, self.params, config=self.config)

    def generate(self, input_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | None = None) -> Array:
        """``input_ids [b, l]`` -> ``[b, l + new]`` ids, greedy at temperature 0; see
        :func:`portable_ssm.generation.generate` (cached prefill + one step per token)."""
        return generate(self._ids(input_ids), self.params, config=self.config, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_token_id=eos_token_id, vocab_size=self.vocab_size)

    def stream(self, input_ids: Any, max_new_tokens: int, **sampling: Any) -> Iterator[Array]:
        """The new tokens ``[b]`` one at a time (arguments as :meth:`generate`)."""
        return stream(self._ids(input_ids), self.params, config=self.config, max_new_tokens=max_new_tokens,
                      vocab_size=self.vocab_size, **sampling)

    def save(self, path: str | os.PathLike) -> None:
        """Writes a :func:`portable_ssm.checkpoint.save_params` file that :func:`load_pretrained` reads."""
        meta = {"vocab_size": str(self.vocab_size)}
        if self.eos_token_id is not None:
            meta["eos_token_id"] = str(self.eos_token_id)
        save_params(path, self.params, self.config, metadata=meta)


def _default_dtype(stored: str) -> str:
    """The parameter dtype when none is asked for: float64 stays float64, anything else is float32."""
    return "float64" if stored == "float64" else "float32"


def _load_file(path: str, backend: str, dtype: str | None, device: Any) -> Mamba2LM:
    """A :func:`save_params` file (its metadata carries the config, vocab size and eos id)."""
    from .backends.safetensors_io import read_header

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
                    device: Any = None) -> Mamba2LM:
    """A :class:`Mamba2LM` from a transformers or state-spaces directory or a save_params file.

    Args:
        path: a checkpoint directory (with ``config.json``) or a :func:`save_params` file.
        backend: ``"numpy" | "torch" | "jax" | "cupy" | "array_api_strict"``.
        dtype: parameter dtype by name; ``None`` is float32 (float64 checkpoints stay float64),
            whatever the stored dtype (bf16 checkpoints are widened exactly).
        device: target device (``"cuda:0"``, ...).

    Raises :class:`portable_ssm.checkpoint.CheckpointError` naming the file and the tensor for
    missing, unexpected or misshapen tensors and unsupported configs; FileNotFoundError when
    nothing is at ``path``.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return _load_file(path, backend, dtype, device)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path}: expected a checkpoint directory with config.json or a file "
                                f"written by portable_ssm.checkpoint.save_params")
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
                    layout=layout, checkpoint_dtype=stored)
