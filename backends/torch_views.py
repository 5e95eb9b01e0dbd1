"""Zero-copy NumPy views of PyTorch CPU tensors: how NumPy's native paths and compiled steps read
torch's memory (the torch backend's float64 scan and tiled quantized products, the market stream's
:class:`~portable_ssm.backends.numpy.rows.RowsStep`, the hybrid decode step of :mod:`.torch_hybrid`).

- :func:`plain_views` / :func:`host_views`: plain CPU tensors as ndarrays (the latter only where
  autograd does not record an op on them);
- :func:`numpy_views`: a model's values as NumPy's plans read them: float32 tensors as float32
  arrays, a :class:`~portable_ssm.quantized.QuantizedWeight` as one over views of its int8 data and
  float32 scales or of its bfloat16 data's bits (uint16).

A view shares the tensor's memory and keeps the tensor alive (its ``base``); nothing is copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from portable_ssm.quantized import QuantizedWeight

#: Tensor types whose ``numpy()`` is their data (subclasses may hold other things behind it).
_PLAIN = (torch.Tensor, nn.Parameter)


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def host_views(*tensors: torch.Tensor | None) -> tuple[np.ndarray | None, ...] | None:
    """Zero-copy NumPy views of CPU tensors (None stays None) where NumPy's native paths may read
    them: plain tensors autograd does not record and ``torch.compile`` is not tracing; None otherwise."""
    return None if records_grad(*tensors) else plain_views(*tensors)


def plain_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor (None aside) is a plain CPU one whose memory holds its values: no
    subclass, no lazy conjugate or negative bit. What native code may read through its pointer."""
    return all(t is None or (type(t) in _PLAIN and t.device.type == "cpu" and not t.is_conj() and not t.is_neg())
               for t in tensors)


def plain_views(*tensors: torch.Tensor | None) -> tuple[np.ndarray | None, ...] | None:
    """:func:`host_views` whether or not autograd records: the tensors' data as zero-copy NumPy
    views (detached), or None where ``torch.compile`` is tracing or a tensor is not a plain CPU one."""
    if torch.compiler.is_compiling() or not plain_cpu(*tensors):
        return None
    try:
        return tuple(None if t is None else t.detach().numpy() for t in tensors)
    except RuntimeError:  # no plain storage behind it (a torch.func transform's wrapper, e.g. under vmap)
        return None


def _quantized_parts(w: QuantizedWeight) -> list[torch.Tensor] | None:
    """The tensors a NumPy view of the torch ``w`` reads: its int8 data and float32 scales, or its
    bfloat16 data reinterpreted as int16 (the same bits); None where its data is neither."""
    if not isinstance(w.data, torch.Tensor):
        return None
    if w.kind == "int8" and w.data.dtype == torch.int8 and getattr(w.scale, "dtype", None) == torch.float32:
        return [w.data, w.scale]
    if w.kind == "bfloat16" and w.data.dtype == torch.bfloat16:
        return [w.data.view(torch.int16)]
    return None


def numpy_views(values: list[Any]) -> list[Any] | None:
    """``values`` as NumPy sees their memory, without a copy: each float32 tensor as an ndarray, each
    :class:`~portable_ssm.quantized.QuantizedWeight` as one over views of its int8 data and scales
    (``kind="int8"``) or of its bfloat16 data's bits as uint16 (``kind="bfloat16"``); None where
    one is anything else (another dtype or device, a subclass) or ``torch.compile`` is tracing."""
    plain, spans = [], []  # the tensors to view; per value, its slice of them
    for v in values:
        parts = _quantized_parts(v) if isinstance(v, QuantizedWeight) else [v]
        if parts is None or not isinstance(v, QuantizedWeight) and not (isinstance(v, torch.Tensor)
                                                                         and v.dtype == torch.float32):
            return None  # bfloat16 arrays (no NumPy dtype to view them as): the other paths take them
        spans.append(slice(len(plain), len(plain) + len(parts)))
        plain += parts
    views = plain_views(*plain)
    if views is None:
        return None
    return [QuantizedWeight(views[s][0].view(np.uint16) if v.kind == "bfloat16" else views[s][0],
                            views[s][1] if v.kind == "int8" else None, v.kind, np.dtype(np.float32))
            if isinstance(v, QuantizedWeight) else views[s][0] for v, s in zip(values, spans)]
