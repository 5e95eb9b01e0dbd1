"""portable_ssm: Mamba-2 written once against the Python array API.

Runs unchanged on NumPy, CuPy, PyTorch, JAX and array-api-strict. ``import portable_ssm``
imports no array framework beyond what is already loaded.

Public API:
    discretize                               Δ and Ā = exp(Δ·A) per head and step
    ssd_scan, selective_scan, ssd_step       the chunked scan, the sequential oracle, one token
    Mamba2Config, init_params, param_shapes  the model's configuration and parameters
    forward, step, Mamba2State, empty_state  the full stack over a sequence / one token
    to_backend, cast_params                  moving arrays between libraries, devices, dtypes
    collate, unpack, to_padded, Batch        padded or packed batches of variable-length sequences
    load_pretrained, Mamba2LM                pretrained checkpoints (transformers / state-spaces), generation
    HybridLM                                 hybrid families (Granite-4.0-H, Bamba, Nemotron-H, Falcon-H1, Zamba2)
    save_params, load_params                 safetensors checkpoints in core names (never pickle)
    quantize, QuantizedWeight, params_nbytes int8 / bfloat16 projection, embedding and head weights
    retain_freed_memory                      keep freed host memory for reuse (glibc; faster CPU calls)
"""

from .backends import to_backend
from .config import Mamba2Config, default_config
from .data import Batch, collate, to_padded, unpack
from .discretize import discretize
from .host import retain_freed_memory
from .hybrid_lm import HybridLM
from .io import CheckpointError, load_arrays, load_params, load_pretrained, save_arrays, save_params
from .language_model import Mamba2LM
from .model import Mamba2State, empty_state, forward, step
from .params import cast_params, check_params, init_params, param_shapes
from .quantized import QuantizedWeight, params_nbytes, quantize
from .recurrence import selective_scan, ssd_step
from .ssd import choose_chunk_size, ssd_scan

__version__ = "0.1.0"

__all__ = [
    "Batch", "CheckpointError", "HybridLM", "Mamba2Config", "Mamba2LM", "Mamba2State", "QuantizedWeight", "cast_params",
    "check_params", "choose_chunk_size", "collate", "default_config", "discretize", "empty_state", "forward",
    "init_params", "load_arrays", "load_params", "load_pretrained", "param_shapes", "params_nbytes", "quantize",
    "retain_freed_memory", "save_arrays", "save_params", "selective_scan", "ssd_scan", "ssd_step", "step",
    "to_backend", "to_padded", "unpack",
]
