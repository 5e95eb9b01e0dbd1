"""PyTorch's batch-1 decode step of the hybrid stack on the CPU (``HybridLM.step`` of Granite-4.0-H,
Bamba, Nemotron-H and Falcon-H1 models): NumPy's fused step
(:func:`portable_ssm.backends.numpy.hybrid.decode_hybrid_hook`, one call of the compiled library)
on zero-copy NumPy views of the torch tensors (:mod:`.torch_views`), its results handed back as
torch tensors sharing their memory (``torch.from_numpy``). One kernel for both backends.

- The model is planned (:func:`portable_ssm.backends.numpy.hybrid.plan` on views of its float32
  tensors and int8 / bfloat16 :class:`~portable_ssm.quantized.QuantizedWeight`) once per params
  dict, remembered as NumPy remembers its own (:class:`~.numpy.decode.LastPlan`) under the
  tensors' data addresses too: a tensor given new memory (``param.data = ...``) is planned again,
  so the step never reads memory the model let go of.
- :func:`decode_hybrid` declines (None: the array-API step runs) wherever NumPy's hook does, and
  for tensors not on the CPU or of other dtypes, subclasses, while ``torch.compile`` traces, and
  where autograd would record the step (grad mode on and a tensor requires grad).
- KV caches are written in place as on NumPy: the copy the first fused step makes is handed out
  as a tensor over its memory, and NumPy's frontier knows that buffer by its memory when the
  tensor comes back as a new view; a state stepped twice still branches into a copy.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np
import torch

from portable_ssm.blocks.attention import KVCache, Positions
from portable_ssm.quantized import QuantizedWeight
from portable_ssm.stack import HybridConfig, HybridState

from .numpy import hybrid, kernels
from .numpy.decode import LastPlan, referenced
from .torch_views import host_views, numpy_views, records_grad


def _addresses(params: dict[str, Any]) -> tuple[int, ...] | None:
    """The data address of every tensor of ``params``' values (a QuantizedWeight's data and scale),
    the plan's key beside the values themselves; None where a value is not a tensor or such a
    weight, or autograd would record an op on one (grad mode on and it requires grad)."""
    tensors = [t for v in params.values() for t in ((v.data, v.scale) if isinstance(v, QuantizedWeight) else (v,))
               if t is not None]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or records_grad(*tensors):
        return None
    return tuple(t.data_ptr() for t in tensors)


def _plan(params: dict[str, Any], keyed: tuple[HybridConfig, tuple[int, ...]]) -> hybrid.HybridPlan:
    """NumPy's plan of ``params`` (torch) through zero-copy views, for the config ``keyed[0]``
    (``keyed[1]``: the tensors' addresses, part of the key only). ValueError for what it refuses."""
    views = numpy_views(list(params.values()))
    if views is None:
        raise ValueError("decode_hybrid: params must be plain CPU float32 tensors or int8 / bfloat16 "
                         "QuantizedWeights of them")
    return hybrid.plan(dict(zip(params, views)), keyed[0])


#: :func:`_plan`, remembered for the params :func:`decode_hybrid` last stepped.
known_plan = LastPlan(_plan)


def _tensor(out: np.ndarray, given: np.ndarray, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where the step wrote ``out`` in place of its view ``given``, else a tensor over ``out``."""
    return tensor if out is given else torch.from_numpy(out)


#: The state tensors the last fused step handed out and the NumPy arrays under them (weak
#: references; one tuple, replaced whole): a decode loop handing them back gives NumPy's hook those
#: very arrays, which it takes without a check or an address per array, instead of new views.
_HANDED_OUT: tuple[tuple[weakref.ref, ...], tuple[weakref.ref, ...]] = ((), ())


def _handed_back(tensors: tuple[torch.Tensor, ...]) -> list[np.ndarray] | None:
    """The arrays under ``tensors`` where they are the very state tensors the last step handed out
    (in order, all alive); None otherwise."""
    tensor_refs, array_refs = _HANDED_OUT
    if not referenced(tensor_refs, tensors):
        return None
    arrays = [r() for r in array_refs]
    return None if any(a is None for a in arrays) else arrays


def decode_hybrid(x: torch.Tensor, state: HybridState, positions: Positions, params: dict[str, Any],
                  config: HybridConfig) -> tuple[torch.Tensor, HybridState] | None:
    """The torch backend's ``decode_hybrid`` fast op (``HybridLM.step``): NumPy's
    :func:`~portable_ssm.backends.numpy.hybrid.decode_hybrid_hook` for one float32 CPU token ``x [1,
    d_model]`` after ``state``, ``positions`` the slots after it: ``(logits [1, rows] before
    logits_scaling, new state)``, torch tensors sharing the step's memory (the KV caches the
    state's own where written in place). None where that hook declines, where a tensor is not a
    plain CPU one of the dtypes it reads, and where autograd would record the step."""
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu"
            or torch.compiler.is_compiling() or kernels.library() is None or not isinstance(state, HybridState)):
        return None  # (before planning: a plan refused while tracing would stay refused)
    addresses = _addresses(params)
    if addresses is None:
        return None
    old = state.positions
    caches = [t for kv in state.kv for t in (kv.k, kv.v)]
    mamba, rest = (*state.conv, *state.ssm), (*caches, old.valid, old.length, old.seen, *positions)
    if not all(isinstance(t, torch.Tensor) for t in (x, *mamba, *rest)) or any(kv.conv is not None for kv in state.kv):
        return None
    known = None if records_grad(*mamba) else _handed_back(mamba)  # a decode loop's state: its arrays
    views = host_views(x, *(mamba if known is None else ()), *rest)
    if views is None:
        return None
    x_np, *rest_np = views
    parts = iter(rest_np if known is None else (*known, *rest_np))  # the views in the order of (mamba, rest)
    convs, ssms, kvs, before = (tuple(itertools.islice(parts, n)) for n in (len(state.conv), len(state.ssm),
                                                                             len(caches), 3))
    old_np, new_np = Positions(*before), Positions(*parts)
    given = HybridState(convs, ssms, tuple(KVCache(k, v) for k, v in zip(kvs[::2], kvs[1::2])), old_np)
    out = hybrid.decode_hybrid_hook(x_np, given, new_np, params, config,
                                    plans=lambda p, c: known_plan(p, (c, addresses)))
    if out is None:
        return None
    logits, stepped = out
    written = [t for kv in stepped.kv for t in (kv.k, kv.v)]
    new_caches = [_tensor(o, g, t) for o, g, t in zip(written, kvs, caches)]
    new_convs, new_ssms = tuple(map(torch.from_numpy, stepped.conv)), tuple(map(torch.from_numpy, stepped.ssm))
    global _HANDED_OUT
    _HANDED_OUT = (tuple(map(weakref.ref, (*new_convs, *new_ssms))),
                   tuple(map(weakref.ref, (*stepped.conv, *stepped.ssm))))
    return torch.from_numpy(logits), HybridState(
        new_convs, new_ssms, tuple(KVCache(k, v) for k, v in zip(new_caches[::2], new_caches[1::2])), positions)
