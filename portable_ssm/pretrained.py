"""Pretrained Mamba-2 language models from local files: ``load_pretrained`` and ``Mamba2LM``.

Three sources, never the network, never an arbitrary unpickle:

* a transformers directory: ``config.json`` (``hidden_size, num_hidden_layers, state_size, ...``)
  with ``model.safetensors`` or a sharded ``model.safetensors.index.json``;
* a state-spaces (mamba_ssm) directory: ``config.json`` (``d_model, n_layer, ssm_cfg`` with
  ``layer: "Mamba2"``) with ``pytorch_model.bin`` (``torch.load(weights_only=True)``; needs torch)
  or a ``.safetensors`` file;
* a file written by :func:`portable_ssm.checkpoint.save_params` (or :meth:`Mamba2LM.save`).

Safetensors files are read with numpy alone (bfloat16 widened to float32 exactly), so a
numpy-only install loads them. Every checkpoint quirk (the ``backbone.`` prefix, the two embedding
names, tied heads, padded vocabularies, D's shape) is fixed in :func:`sanitize`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

from ._array import Array, array_backend, device, dtype_name, namespace
from .backends import load, to_backend
from .checkpoint import CheckpointError, _parse_header, load_params, save_params
from .config import Mamba2Config
from .generation import check_token_ids, generate, stream
from .lm import logits as lm_logits
from .params import Params, check_params, param_shapes

_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
Tensors = dict[str, tuple[Any, str]]  # checkpoint name -> (host numpy array, stored dtype name)


def _read_safetensors(path: str) -> Tensors:
    import numpy as np

    header, offset = _parse_header(path)  # every entry checked against the file size
    header.pop("__metadata__", None)
    with open(path, "rb") as f:
        f.seek(offset)
        data = np.fromfile(f, dtype=np.uint8)
    out = {}
    for name, info in header.items():
        kind, (begin, end), shape = info["dtype"], info["data_offsets"], tuple(info["shape"])
        if kind not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {kind}, expected a float "
                                  f"({', '.join(_SAFETENSORS_DTYPES)})")
        raw = data[begin:end].view(_SAFETENSORS_DTYPES[kind])
        if kind == "BF16":  # bfloat16 is the top half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = (raw.reshape(shape), _NAMES[kind])  # flat bytes -> the header's shape
    return out


def _read_torch_bin(path: str) -> Tensors:
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
    return _read_torch_bin(path) if path.endswith(".bin") else _read_safetensors(path)


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


def _floats(values: Any) -> tuple[float, ...]:
    """JSON numbers as floats, also transformers 5's ``{"__float__": "Infinity"}`` and ``"inf"`` strings."""
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in values)


def _transformers_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``Mamba2Config`` keys (with its defaults) -> ``portable_ssm.Mamba2Config`` fields."""
    d, expand = raw["hidden_size"], raw.get("expand", 2)
    heads, head_dim = raw.get("num_heads", 128), raw.get("head_dim", 64)
    if heads * head_dim != expand * d:
        raise CheckpointError(f"num_heads * head_dim = {heads * head_dim} must equal expand * hidden_size "
                              f"= {expand * d}")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act: only 'silu' is supported, got {raw['hidden_act']!r}")
    limit = raw.get("time_step_limit", (0.0, math.inf))
    return dict(d_model=d, n_layer=raw["num_hidden_layers"], d_state=raw.get("state_size", 128),
                d_conv=raw.get("conv_kernel", 4), expand=int(expand), headdim=head_dim,
                ngroups=raw.get("n_groups", 8), chunk_size=raw.get("chunk_size", 256),
                dt_min=raw.get("time_step_min", 0.001), dt_max=raw.get("time_step_max", 0.1),
                dt_init_floor=raw.get("time_step_floor", 1e-4), dt_limit=_floats(limit),
                bias=raw.get("use_bias", False), conv_bias=raw.get("use_conv_bias", True),
                norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                residual_in_fp32=raw.get("residual_in_fp32", True),
                tie_embeddings=raw.get("tie_word_embeddings", False),
                vocab_size=raw["vocab_size"], pad_vocab_size_multiple=1)


def _state_spaces_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """mamba_ssm's ``MambaConfig`` keys (with its defaults) -> ``portable_ssm.Mamba2Config`` fields."""
    ssm = dict(raw.get("ssm_cfg") or {})
    checks = [("ssm_cfg.layer", ssm.get("layer", "Mamba1"), "Mamba2"),  # mamba_ssm defaults to Mamba1
              ("d_intermediate", raw.get("d_intermediate", 0), 0),  # MLP blocks
              ("attn_layer_idx", raw.get("attn_layer_idx") or [], []),  # attention layers
              ("rms_norm", raw.get("rms_norm", True), True),  # LayerNorm blocks
              ("ssm_cfg.rmsnorm", ssm.get("rmsnorm", True), True),
              ("ssm_cfg.norm_before_gate", ssm.get("norm_before_gate", False), False),
              ("ssm_cfg.d_ssm", ssm.get("d_ssm"), None)]  # an SSM on part of d_inner
    for key, value, supported in checks:
        if value != supported:
            raise CheckpointError(f"{key}: portable_ssm supports only {supported!r}, got {value!r}")
    keys = ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "dt_min", "dt_max",
            "dt_init_floor", "dt_limit", "A_init_range", "bias", "conv_bias")
    fields = {k: ssm[k] for k in keys if k in ssm}  # absent keys: Mamba2Config's defaults are mamba_ssm's
    for key in ("dt_limit", "A_init_range"):
        if key in fields:
            fields[key] = _floats(fields[key])
    return dict(fields, d_model=raw["d_model"], n_layer=raw["n_layer"], vocab_size=raw["vocab_size"],
                residual_in_fp32=raw.get("residual_in_fp32", True), norm_eps=raw.get("norm_epsilon", 1e-5),
                tie_embeddings=raw.get("tie_embeddings", True),
                pad_vocab_size_multiple=raw.get("pad_vocab_size_multiple", 8))


def _core_name(name: str) -> str:
    name = name[len("backbone."):] if name.startswith("backbone.") else name
    return "embedding.weight" if name == "embeddings.weight" else name


def config_fields(raw_config: dict[str, Any], where: str) -> dict[str, Any]:
    """Either ``config.json`` layout (transformers: ``hidden_size``; state-spaces: ``d_model``) as
    :class:`Mamba2Config` fields plus ``pad_vocab_size_multiple``; unsupported variants raise
    :class:`CheckpointError` naming the key."""
    try:
        return (_transformers_fields if "hidden_size" in raw_config else _state_spaces_fields)(raw_config)
    except KeyError as err:
        raise CheckpointError(f"{where}: config.json misses the key {err.args[0]!r}") from None
    except CheckpointError as err:
        raise CheckpointError(f"{where}: config.json: {err}") from None


def sanitize(fields: dict[str, Any], tensors: Tensors, where: str) -> tuple[Mamba2Config, Tensors, int]:
    """The one place checkpoint quirks are fixed: ``(config, tensors in core names, real vocab size)``
    from :func:`config_fields` and the checkpoint's tensors.

    Strips ``backbone.``; reads both embedding names; drops ``lm_head.weight`` when tied; takes
    ``D``'s shape from the file; keeps the embedding's row count (vocab padded or not) as the
    logits' width. Errors name ``where`` and the tensor as the checkpoint spells it.
    """
    fields = dict(fields)
    renamed: Tensors = {}
    origin: dict[str, str] = {}
    for name, value in tensors.items():
        core = _core_name(name)
        if core in renamed:
            raise CheckpointError(f"{where}: tensors {origin[core]!r} and {name!r} are the same parameter")
        renamed[core], origin[core] = value, name
    if "embedding.weight" not in renamed:
        raise CheckpointError(f"{where}: tensor 'backbone.embeddings.weight' (or "
                              f"'backbone.embedding.weight') is missing")
    vocab, rows = fields["vocab_size"], renamed["embedding.weight"][0].shape[0]
    multiple = fields.pop("pad_vocab_size_multiple")
    if vocab > rows:
        raise CheckpointError(f"{where}: config vocab_size {vocab} exceeds the {rows} rows of "
                              f"{origin['embedding.weight']!r}")
    if -(-vocab // multiple) * multiple != rows:  # the rows are the padded vocabulary
        fields["vocab_size"], multiple = rows, 1
    D = renamed.get("layers.0.mixer.D")
    fields["D_has_hdim"] = D is not None and D[0].ndim == 2
    if fields["tie_embeddings"]:
        renamed.pop("lm_head.weight", None)
    try:
        config = Mamba2Config(**fields, pad_vocab_size_multiple=multiple)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: config.json: {err}") from None
    expected = param_shapes(config)
    for key, shape in expected.items():
        if key not in renamed:
            spelled = key if key == "lm_head.weight" else f"backbone.{key}"
            raise CheckpointError(f"{where}: tensor {spelled!r} is missing")
        got = tuple(renamed[key][0].shape)
        if got != shape:
            raise CheckpointError(f"{where}: tensor {origin[key]!r} has shape {got}, expected {list(shape)} "
                                  f"for this config")
    extra = sorted(origin[k] for k in set(renamed) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} for this config")
    return config, {k: renamed[k] for k in expected}, vocab


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
    return "float64" if stored == "float64" else "float32"


def _load_file(path: str, backend: str, dtype: str | None, device: Any) -> Mamba2LM:
    """A :func:`save_params` file (its metadata carries the config, vocab size and eos id)."""
    meta = _parse_header(path)[0].get("__metadata__") or {}
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
