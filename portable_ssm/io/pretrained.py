"""Pretrained Mamba-2 language models from files: ``load_pretrained`` -> :class:`~portable_ssm.Mamba2LM`.

Three kinds of source, never an arbitrary unpickle:

* a transformers directory: ``config.json`` (``hidden_size, num_hidden_layers, state_size, ...``)
  with ``model.safetensors`` or a sharded ``model.safetensors.index.json``;
* a state-spaces (mamba_ssm) directory: ``config.json`` (``d_model, n_layer, ssm_cfg`` with
  ``layer: "Mamba2"``) with ``pytorch_model.bin`` (``torch.load(weights_only=True)``; needs torch)
  or a ``.safetensors`` file;
* a file written by :func:`portable_ssm.save_params` (or :meth:`Mamba2LM.save`);

and a Hub id (``"org/name"``) is a directory of the local Hugging Face cache, downloaded first
only when it is not cached and ``huggingface_hub`` is installed.

Files are hostile until checked: JSON is type-checked key by key, the config is bounded against
the weight files' sizes before a tensor is read, and shard names stay inside the directory. Only
regular files are read (a FIFO or directory in a file's place is a CheckpointError naming it);
JSON files must resolve inside the directory, and in a Hub cache snapshot every file must resolve
into the snapshot or its repository's ``blobs/`` (:mod:`portable_ssm.io.paths`); a cache ref must
be a small regular file holding a commit hash. No error quotes a refused file's bytes.

Safetensors files are read with numpy alone (bfloat16 widened to float32 exactly, by
:mod:`portable_ssm.io.safetensors`), so a numpy-only install loads them. Every checkpoint
quirk is fixed in :func:`portable_ssm.io.layouts.sanitize`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..backends import NAMES, to_backend
from ..language_model import Mamba2LM
from ..quantized import KINDS
from .checkpoint import load_params
from .errors import CheckpointError
from .generation_config import FILE_NAME as GENERATION_CONFIG
from .generation_config import read_generation_config
from .layouts import config_fields, eos_token_ids, minimum_bytes, sanitize, shown
from .paths import as_path, check_inside, read_regular, regular
from .strict_json import loads, read_file
from .weights import FLOATS as _FLOATS
from .weights import default_dtype, read_weights, weight_files

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REF_LIMIT = 1024  # a ref is a 40-digit hash (and maybe a newline)


def _check_sizes(config_path: str, fields: dict[str, Any], files: list[str]) -> None:
    """CheckpointError before any tensor is read when the config needs more parameters than the
    weight files can hold (a hostile ``n_layer`` or ``d_model`` never allocates)."""
    need = minimum_bytes(fields, os.path.dirname(config_path))
    held = sum(os.path.getsize(path) for path in files)
    if need > held:
        raise CheckpointError(f"{config_path}: the config needs at least {need} bytes of weights (n_layer "
                              f"{fields['n_layer']}, d_model {fields['d_model']}, vocab_size "
                              f"{fields['vocab_size']}) but the weight files hold {held}")


def _metadata_json(path: str, meta: dict[str, str], key: str) -> Any:
    """A metadata entry :meth:`Mamba2LM.save` wrote as JSON (None when absent)."""
    if key not in meta:
        return None
    return loads(meta[key], f"{path}: metadata {key!r}")


def _load_file(path: str, backend: str, dtype: str | None, device: Any) -> Mamba2LM:
    """A :func:`save_params` file (its metadata carries the config, vocab size and eos id)."""
    from .safetensors import read_header

    header = read_header(path)[0]
    meta = header.get("__metadata__") or {}
    if "config" not in meta:
        raise CheckpointError(f"{path}: not written by portable_ssm (no config in its metadata); for a "
                              f"transformers or state-spaces checkpoint pass the directory with config.json")
    stored = meta.get("dtype", "float32")
    if stored not in _FLOATS:
        raise CheckpointError(f"{path}: metadata 'dtype': expected one of {', '.join(_FLOATS)}, got {shown(stored)}")
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] not in ("F64", "F32", "F16", "BF16"):
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, expected a float "
                                  f"(F64, F32, F16, BF16)")
    params, config = load_params(path, backend=backend, dtype=dtype or default_dtype(stored), device=device)
    vocab = _metadata_json(path, meta, "vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)):
        raise CheckpointError(f"{path}: metadata 'vocab_size': expected an int, got {shown(vocab)}")
    eos = eos_token_ids(_metadata_json(path, meta, "eos_token_id"), f"{path}: metadata")
    try:
        return Mamba2LM(params, config, vocab_size=vocab, eos_token_id=eos, checkpoint_dtype=stored)
    except ValueError as err:
        raise CheckpointError(f"{path}: metadata: {err}") from None


def hub_cache() -> str:
    """The local Hugging Face cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _cached_snapshot(repo_id: str, revision: str) -> str | None:
    """The snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit hash) in the local
    Hugging Face cache (``models--org--name/refs/<revision>`` holds the commit hash, and
    ``snapshots/<hash>/`` the files), or None when it is not there."""
    repo = os.path.join(hub_cache(), "models--" + repo_id.replace("/", "--"))
    commit = revision
    if not _COMMIT.match(revision):
        if any(part in ("", ".", "..") for part in revision.split("/")):
            return None
        commit = _read_ref(repo, os.path.join(repo, "refs", *revision.split("/")))
        if commit is None:
            return None
    snapshot = os.path.join(repo, "snapshots", commit)
    if not os.path.lexists(snapshot):
        return None
    if os.path.realpath(snapshot) != os.path.join(os.path.realpath(repo), "snapshots", commit) \
            or not os.path.isdir(snapshot):
        raise CheckpointError(f"{snapshot}: a Hugging Face cache snapshot must be a directory of that cache, "
                              f"not a symlink or a file")
    return snapshot if regular(os.path.join(snapshot, "config.json")) else None


def _read_ref(repo: str, ref: str) -> str | None:
    """The commit hash in the cache's ref file ``ref`` (None when there is none); CheckpointError
    naming it when it is a FIFO, directory or device, a symlink out of ``repo/refs``, larger than a
    hash, or holds anything but 40 hex digits (whose bytes the message never quotes)."""
    if not regular(ref):
        return None
    check_inside(ref, os.path.join(repo, "refs"), "the cache's refs/ folder")
    text = read_regular(ref, _REF_LIMIT)
    commit = text.strip().decode("ascii", errors="replace")
    if not _COMMIT.match(commit):
        raise CheckpointError(f"{ref}: a Hugging Face cache ref must hold a 40-hex-digit commit hash; this one "
                              f"({len(text)} bytes) does not")
    return commit


def _from_hub(repo_id: str, revision: str | None, local_files_only: bool) -> str:
    """The local folder of Hub model ``repo_id``: its cached snapshot, else (with ``huggingface_hub``
    installed and downloads allowed) a fresh ``snapshot_download``; FileNotFoundError saying what
    to run otherwise."""
    revision = revision or "main"
    cached = _cached_snapshot(repo_id, revision)
    if cached is not None:
        return cached
    if not local_files_only:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            pass
        else:
            return snapshot_download(repo_id, revision=revision,
                                     allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt", "*.model"])
    raise FileNotFoundError(
        f"{repo_id}: no such local path, and the Hugging Face cache {hub_cache()} holds no snapshot of it "
        f"at revision {revision!r}; download it with: pip install 'portable-ssm[hub]' && "
        f"hf download {repo_id} --revision {revision}")


def _check_arguments(path: Any, revision: Any, local_files_only: Any, weights: Any, dtype: Any,
                     backend: Any) -> str:
    """``path`` as a str after checking the arguments that say where and how to load (before any
    file is read); TypeError or ValueError naming the argument otherwise."""
    path = as_path(path)
    if not isinstance(backend, str) or backend not in NAMES:
        raise ValueError(f"backend: expected one of {', '.join(NAMES)}, got {backend!r}")
    if dtype is not None and (not isinstance(dtype, str) or dtype not in _FLOATS):
        raise ValueError(f"dtype: expected None or one of {', '.join(_FLOATS)}, got {dtype!r}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision: expected a branch, tag or commit hash as a str, got {type(revision).__name__}")
    if revision is not None and (not revision or "\0" in revision or "\\" in revision or len(revision) > 255):
        raise ValueError(f"revision: expected a branch, tag or commit hash (1 to 255 characters, no NUL or "
                         f"backslash), got {revision[:80]!r}")
    if not isinstance(local_files_only, bool):
        raise TypeError(f"local_files_only: expected True or False, got {type(local_files_only).__name__}")
    if not isinstance(weights, str):
        raise TypeError(f"weights: expected one of {', '.join(map(repr, KINDS))} as a str, got "
                        f"{type(weights).__name__}")
    if weights not in KINDS:
        raise ValueError(f"weights: expected one of {', '.join(map(repr, KINDS))}, got {weights!r}")
    if weights != "float32" and dtype not in (None, "float32"):
        raise ValueError(f"weights: {weights!r} stores float32 params in low precision; got dtype={dtype!r} "
                         f"(pass dtype=None or 'float32')")
    return path


def _hybrid_family(raw: Any, path: str, weights: str, backend: str, dtype: str | None, device: Any) -> Any:
    """The hybrid families' hook (:mod:`portable_ssm.io.hybrid`): their model, or None for Mamba-2."""
    from .hybrid import family_of, load_hybrid

    if family_of(raw) is None:
        return None
    model = load_hybrid(path, raw, backend=backend, dtype=dtype, device=device)
    try:
        return model.quantize(weights)
    except ValueError as err:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {err}") from None


def load_pretrained(path: str | os.PathLike, *, backend: str = "numpy", dtype: str | None = None,
                    device: Any = None, revision: str | None = None,
                    local_files_only: bool = False, weights: str = "float32") -> Mamba2LM:
    """A :class:`Mamba2LM` from a transformers or state-spaces directory, a save_params file, or a
    Hugging Face Hub id (``"org/name"``) found in the local Hugging Face cache.

    Args:
        path: a checkpoint directory (with ``config.json``), a :func:`save_params` file, or a Hub
            model id when no such path exists: its snapshot in the local cache (``HF_HUB_CACHE``,
            else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) is read without the network;
            when it is not cached and ``huggingface_hub`` is installed (``pip install
            'portable-ssm[hub]'``) it is downloaded with ``snapshot_download``.
        backend: ``"numpy" | "torch" | "jax" | "cupy" | "array_api_strict"``.
        dtype: parameter dtype by name; ``None`` is float32 (float64 checkpoints stay float64),
            whatever the stored dtype (bf16 checkpoints are widened exactly).
        device: target device (``"cuda:0"``, ...).
        revision: for a Hub id: a branch, tag or commit hash (default ``"main"``).
        local_files_only: for a Hub id: never download, only read the cache.
        weights: ``"float32"`` (as loaded), or ``"int8"`` / ``"bfloat16"`` storage of the
            projections, embedding and head (:func:`portable_ssm.quantize`; float32 params only).

    Raises :class:`portable_ssm.CheckpointError` naming the file and the tensor or key for
    missing, unexpected, misshapen or non-floating tensors, malformed or unsupported configs and
    shard indexes naming files outside the directory; FileNotFoundError when nothing is at
    ``path`` (for a Hub id: saying what to run to download it).
    """
    path = _check_arguments(path, revision, local_files_only, weights, dtype, backend)
    if not os.path.lexists(path) and _REPO_ID.match(path):
        path = _from_hub(path, revision, local_files_only)
    elif revision is not None:
        raise ValueError(f"revision: only for a Hugging Face Hub id, but {path!r} is a local path")
    if not os.path.isdir(path) and regular(path):
        return _load_file(path, backend, dtype, device).quantize(weights)
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not regular(config_path):
        raise FileNotFoundError(f"{path}: expected a checkpoint directory with config.json or a file "
                                f"written by portable_ssm.save_params")
    raw = read_file(config_path)
    hybrid = _hybrid_family(raw, path, weights, backend, dtype, device)
    if hybrid is not None:
        return hybrid
    fields = config_fields(raw, path)
    eos = eos_token_ids(raw.get("eos_token_id"), f"{path}: config.json")
    regular(os.path.join(path, GENERATION_CONFIG))  # a FIFO or directory in its place is an error, not "none"
    files, index, weight_map = weight_files(path)
    _check_sizes(config_path, fields, files)
    config, host, vocab = sanitize(fields, read_weights(files, index, weight_map), path)
    stored = host["embedding.weight"][1]
    dtype = dtype or default_dtype(stored)
    params = {k: to_backend(v, backend, device=device, dtype=dtype) for k, (v, _) in host.items()}
    layout = "transformers" if "hidden_size" in raw else "state-spaces"
    try:
        model = Mamba2LM(params, config, vocab_size=vocab, eos_token_id=eos, layout=layout, checkpoint_dtype=stored)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    model.generation_config = read_generation_config(path, vocab_size=model.vocab_size,
                                                     rows=config.padded_vocab_size)  # a CheckpointError naming it
    try:
        return model.quantize(weights)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
