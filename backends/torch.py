"""PyTorch: conversion, devices, the native fast paths (conv1d, SiLU and RMSNorm through torch's own
ops, quantized matmuls, the CPU kernels of :mod:`.torch_kernels`, the training scan op, and NumPy's
native scan and fused hybrid decode step (:mod:`.torch_hybrid`) on zero-copy views
(:mod:`.torch_views`) for CPU inference), and (for training) the nn.Module adapter.

The core runs unchanged on torch tensors through array_api_compat, so autograd, ``torch.compile``
and autocast see ordinary torch ops. :class:`Mamba2Module` / :class:`Mamba2LMModule` register the
core's parameters as ``nn.Parameter``s under their checkpoint names and call the core in forward;
:func:`param_groups`, :func:`detach_state` and :func:`optimizer_state` /
:func:`load_optimizer_state` are the training helpers around them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import array_api_compat.torch as xp
import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from portable_ssm import generation, lm, ssd
from portable_ssm._array import compute_dtype
from portable_ssm.config import Mamba2Config
from portable_ssm.conv import causal_conv1d_ref
from portable_ssm.mixer import mixer
from portable_ssm.model import Mamba2State
from portable_ssm.model import forward as core_forward
from portable_ssm.params import init_params
from portable_ssm.quantized import QuantizedWeight, quantized_matmul_ref

from . import torch_hybrid, torch_kernels, torch_scan
from .numpy import ops as numpy_ops
from .numpy import quant as numpy_quant
from .torch_views import host_views, plain_cpu, plain_views, records_grad


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    return getattr(torch, name)


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    host = np.asarray(host)
    out = torch.from_numpy(np.ascontiguousarray(host).reshape(host.shape))  # keeps 0-d arrays 0-d
    return out.to(device=device, dtype=None if dtype_name is None else dtype(dtype_name))


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    return x.to(device=device, dtype=None if dtype_name is None else dtype(dtype_name))


def to_numpy(x: Any) -> np.ndarray:
    x = x.detach()
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return x.cpu().numpy()


def read_state_dict(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """A ``pytorch_model.bin`` state dict as host arrays with their stored dtype names, loaded with
    ``torch.load(weights_only=True)`` (nothing but tensors and containers is unpickled).
    ValueError saying what is wrong when the file is not a plain state dict of tensors."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise ValueError(f"not a plain state dict of tensors (loaded with weights_only=True: {err})") from None
    if not isinstance(state, dict):
        raise ValueError(f"expected a state dict of tensors, got {type(state).__name__}")
    out = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"entry {name!r} is a {type(value).__name__}, expected a tensor")
        out[name] = (to_numpy(value), _dtype_name(value.dtype))
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.conv1d`` version of ``portable_ssm.conv.causal_conv1d_ref``:
    ``x [b, l, d]``, weight ``[d, k]``, state ``[b, d, k]`` -> ``(y [b, l, d], state [b, d, k])``.
    The reference itself where autograd records: the backward of a depthwise conv1d (mkldnn's on
    CPU) took 10 ms of a 130 ms training step of a 130m layer at l=512, the shifted slices' 2 ms
    (a hand-written backward, one more depthwise conv1d for the input's gradient, was slower still)."""
    if records_grad(x, weight, bias, state):
        return causal_conv1d_ref(x, weight, bias, state, xp=xp)
    b, l, d = x.shape
    k = weight.shape[-1]
    xt = x.transpose(1, 2)  # [b, d, l]
    if state is None:
        history = xt.new_zeros((b, d, k - 1))
    else:
        history = state[:, :, 1:].to(x.dtype)  # [b, d, k-1]
    padded = torch.cat([history, xt], dim=-1)  # [b, d, k-1+l]
    y = F.conv1d(padded, weight.to(x.dtype)[:, None, :], None if bias is None else bias.to(x.dtype),
                 groups=d)  # [b, d, l]
    return y.transpose(1, 2), padded[:, :, l - 1:]


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d`, then ``F.silu`` (one vectorized pass, where the core's
    ``h + h·tanh(h)`` takes four and torch's tanh is slower than its sigmoid). For float32 CPU
    tensors where :mod:`.torch_kernels` is built: the ``portable_ssm::conv1d_silu`` op instead (its
    forward and backward one kernel each, x read in place from in_proj's output; a 130m layer's
    training step at l=2048 spent about a fifth of its time in autograd of the reference's shifted
    slices, and a 130m prompt pass of 2048 tokens about a tenth in the transposing copy and
    depthwise conv1d of :func:`causal_conv1d`)."""
    if _takes_conv_kernel(x, weight, bias, state):
        k = weight.shape[-1]
        if state is None:
            history = x.new_zeros((x.shape[0], k - 1, x.shape[2]))  # [b, k-1, d]
        else:
            history = state[:, :, 1:].permute(0, 2, 1)  # [b, d, k] -> [b, k-1, d]
        l = x.shape[1]
        tail = x[:, l - k:] if l >= k else torch.cat([history[:, l - 1:], x], dim=1)  # the last k inputs, [b, k, d]
        return conv1d_silu(x, weight, bias, history), tail.permute(0, 2, 1)
    y, new_state = causal_conv1d(x, weight, bias, state)
    return F.silu(y), new_state


def _takes_conv_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       state: torch.Tensor | None) -> bool:
    """Whether :func:`causal_conv1d_silu` runs the ``portable_ssm::conv1d_silu`` op: every tensor a
    float32 CPU one, and the kernels built."""
    present = [t for t in (x, weight, bias, state) if t is not None]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in present):
        return False
    return _kernels_ready()


def _conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 history: torch.Tensor) -> torch.Tensor:
    return torch_kernels.conv_silu(x, weight, bias, history)


def _conv1d_silu_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          history: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch_kernels.conv_silu_backward(dy, x, weight, bias, history)


def _conv1d_silu_backward_shapes(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 history: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape),
            x.new_empty((x.shape[-1],)), torch.empty_like(history, memory_format=torch.contiguous_format))


def _save_conv_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _conv1d_silu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       history: torch.Tensor) -> torch.Tensor:
    """The ``portable_ssm::conv1d_silu`` op through the core's conv and ``F.silu``: the inputs
    ``history [b, k-1, d]`` before x as the conv state ``[b, d, k]`` whose first column it never reads."""
    state = F.pad(history.transpose(1, 2), (1, 0))  # [b, k-1, d] -> [b, d, k]
    return F.silu(causal_conv1d_ref(x, weight, bias, state, xp=xp)[0])


def _conv_op_backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias, history = ctx.saved_tensors
    if torch.is_grad_enabled():  # a backward that is differentiated in turn
        return _autograd_grads(_conv1d_silu_torch, (x, weight, bias, history), (dy,), create_graph=True)
    dx, dweight, dbias, dhistory = conv1d_silu_backward(dy, x, weight, bias, history)
    return dx, dweight, None if bias is None else dbias, dhistory


def split(v: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``torch.split`` along the last axis, for ``portable_ssm.mixer._split_last``: one backward
    that concatenates the parts' gradients (each slice's would zero-fill a gradient of v's size:
    the in_proj output's three took 4% of a 130m layer's training step at l=512)."""
    return torch.split(v, list(sizes), dim=-1)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, groups: int,
                   eps: float) -> torch.Tensor:
    """``portable_ssm.norm.gated_rms_norm_ref`` through ``F.silu`` and ``F.rms_norm`` (fewer passes
    and temporaries, in eager, autograd and compiled graphs alike): ``rmsnorm(y · silu(z))`` per
    group in float32 at least. ``y, z [..., d]``, weight ``[d]`` -> weight's dtype. For float32 CPU
    tensors where :mod:`.torch_kernels` is built: the ``portable_ssm::gated_rms_norm`` op instead
    (forward and backward one kernel pass each over every row, z read in place)."""
    if _takes_norm_kernel(y, z, weight):
        return gated_rms_norm_op(y, z, weight, groups, eps)
    return _gated_rms_norm_torch(y, z, weight, groups, eps)


def _gated_rms_norm_torch(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, groups: int,
                          eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm` through torch's ops alone."""
    cdtype = compute_dtype(xp, weight.dtype)
    v = y.to(cdtype)
    if z is not None:
        v = v * F.silu(z.to(cdtype))
    *lead, d = v.shape
    v = F.rms_norm(v.reshape(*lead, groups, d // groups), (d // groups,), eps=eps)  # [..., g, d/g]
    return weight * v.reshape(*lead, d).to(weight.dtype)  # [..., d]


def _takes_norm_kernel(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether :func:`gated_rms_norm` runs the ``portable_ssm::gated_rms_norm`` op: y, z and the
    weight float32 CPU tensors of one width, and the kernels built."""
    present = [t for t in (y, z, weight) if t is not None]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in present):
        return False
    if weight.ndim != 1 or y.ndim == 0 or y.shape[-1] != weight.shape[0] or (z is not None and z.shape != y.shape):
        return False
    return _kernels_ready()


def _gated_rms_norm(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, groups: int,
                    eps: float) -> torch.Tensor:
    return torch_kernels.gated_rms_norm(y, z, weight, groups, eps)


def _gated_rms_norm_backward(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor,
                             groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch_kernels.gated_rms_norm_backward(dout, y, z, weight, groups, eps)


def _save_norm_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs[:3])
    ctx.groups, ctx.eps = inputs[3:]


def _norm_op_backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    y, z, weight = ctx.saved_tensors
    if torch.is_grad_enabled():  # a backward that is differentiated in turn
        grads = _autograd_grads(_gated_rms_norm_torch, (y, z, weight), (dout,), ctx.groups, ctx.eps, create_graph=True)
        return (*grads, None, None)
    dy, dz, dweight = gated_rms_norm_backward_op(dout, y, z, weight, ctx.groups, ctx.eps)
    return dy, None if z is None else dz, dweight, None, None


def _autograd_grads(fn: Callable[..., Any], tensors: tuple[torch.Tensor | None, ...], grads: tuple[torch.Tensor, ...],
                    *args: Any, create_graph: bool) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``fn(*tensors, *args)`` (one output or a tuple, against ``grads``) for the
    tensors autograd records; None for the others. With ``create_graph`` they are recorded in turn:
    what an op's backward returns while a backward is differentiated (``create_graph=True``: a
    gradient penalty, a Hessian-vector product), since the kernels' gradients have no gradients of
    their own and autograd would treat them as constants, silently."""
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    if not wanted:
        return (None,) * len(tensors)
    with torch.enable_grad():
        outputs = fn(*tensors, *args)
        found = iter(torch.autograd.grad(outputs if isinstance(outputs, tuple) else (outputs,), wanted, grads,
                                         create_graph=create_graph, allow_unused=True))
    return tuple(next(found) if t is not None and t.requires_grad else None for t in tensors)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int | None, initial_states: torch.Tensor | None,
                seq_idx: torch.Tensor | None = None,
                D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``portable_ssm.ssd.ssd_chunked``'s scan. For CPU tensors that autograd does not record and
    ``torch.compile`` is not tracing: the C++ scan kernel for float32 (:func:`_kernel_scan`), else
    NumPy's native chunk loop (``portable_ssm.backends.numpy.ops.ssd_chunked``, its intermediates
    in cache, on NumPy's thread pool) on zero-copy views (packed rows, float64, kernels not built).
    Where autograd records, the ``portable_ssm::ssd_scan`` op (:func:`ssd_scan`, eager and
    compiled) for the CPU tensors it takes (:func:`_scan_op_takes`); the core reference otherwise
    (packed rows, other dtypes, GPUs, compiled inference). Shapes as the reference."""
    Q = ssd.chunk_length(x.shape[1], chunk_size)
    if records_grad(x, dt, A, B, C, initial_states, D):
        if _scan_op_takes(x, dt, A, B, C, initial_states, seq_idx, D):
            return ssd_scan(x, dt, A, B, C, D, initial_states, Q)
    elif seq_idx is None and not torch.compiler.is_compiling():
        out = _kernel_scan(x, dt, A, B, C, D, initial_states, Q)
        if out is not None:
            return out
    views = host_views(x, dt, A, B, C, initial_states, seq_idx, D)
    if views is None:
        return ssd.ssd_chunked_ref(x, dt, A, B, C, chunk_size=chunk_size, initial_states=initial_states,
                                   xp=xp, seq_idx=seq_idx, D=D)
    xn, dtn, An, Bn, Cn, initial, ids, Dn = views
    y, final = numpy_ops.ssd_chunked(xn, dtn, An, Bn, Cn, chunk_size, initial, seq_idx=ids, D=Dn)
    return torch.from_numpy(y), torch.from_numpy(final)


#: Rows up to which :func:`quantized_matmul` runs torch's low-precision kernels on CPU (decode); more
#: rows (prefill) dequantize tiles and multiply in float32 (:func:`_tiled_product`), faster on CPUs
#: without int8 / bf16 dot products.
CPU_KERNEL_MAX_ROWS = 16
#: The largest float16: bfloat16 weights up to it repack exactly for fbgemm's float16 kernel.
_FLOAT16_MAX = 65504.0


class PackedWeight:
    """fbgemm's prepacked copy of a quantized weight (``blob``, for the ``kind``'s kernel) with
    ``out_features`` rows, registered under an int ``key`` while it lives: compiled graphs reach it
    through the ``portable_ssm::packed_linear`` op, since torch.compile cannot take the packed
    object itself as an input."""

    def __init__(self, blob: Any, kind: str, out_features: int) -> None:
        self.blob, self.kind, self.out_features = blob, kind, out_features
        self.key = next(_PACKED_KEYS)
        _PACKED[self.key] = self


_PACKED: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()
_PACKED_KEYS = itertools.count()


def _packed_linear(rows: torch.Tensor, key: int) -> torch.Tensor:
    """``rows [m, in] @ W.T -> [m, out]`` (float32) with fbgemm on the :class:`PackedWeight` ``key``."""
    packed = _PACKED[key]
    if packed.kind == "int8":
        return torch.ops.quantized.linear_dynamic(rows.contiguous(), packed.blob, True)
    return torch.ops.quantized.linear_dynamic_fp16(rows.contiguous(), packed.blob)


def _packed_linear_shape(rows: torch.Tensor, key: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], _PACKED[key].out_features))


# Defined through torch.library's low-level registration rather than ``torch.library.custom_op``,
# whose Python wrapper costs about 13 us more a call: 0.6 ms of an int8 decode step's 49 calls.
_LIBRARY = torch.library.Library("portable_ssm", "DEF")
_LIBRARY.define("packed_linear(Tensor rows, int key) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("portable_ssm::packed_linear", _packed_linear_shape, lib=_LIBRARY)
#: The ``portable_ssm::packed_linear`` op: :func:`_packed_linear` in eager and compiled graphs.
packed_linear = torch.ops.portable_ssm.packed_linear


#: The chunk length of the training scan's backward (at least the forward's; like the forward's, the
#: result does not depend on it beyond rounding). With the C++ backward (float32), a 130m layer's
#: training step at l=2048 on 2 threads took 250.8 / 265.7 / 263.9 ms at 64 / 128 / 256 (one process,
#: the three in turn; torch ops alone, float64 or without the kernels, had been fastest at 128).
BACKWARD_CHUNK = 64


def _scan_op_takes(*tensors: torch.Tensor | None) -> bool:
    """Whether :func:`ssd_scan` takes the scan of these arguments (x, Δ, A, B, C, initial_states,
    seq_idx, D): no seq_idx, every tensor on the CPU in one dtype, float32 or float64, and plain
    (NumPy can view its data) or traced by ``torch.compile``. Rows of any length: with the scan
    kernel's forward a training step through the op took less time than autograd of the reference
    (whose ``[b, h, c, Q, Q]`` intermediates it keeps) at every shape measured, from 16 tokens of a
    130m layer to 2048 (``benchmarks/train_kernels_ab.py --only-scan-op``), and less memory."""
    x, seq_idx = tensors[0], tensors[6]
    present = [t for t in tensors if t is not None]
    if seq_idx is not None or x.dtype not in (torch.float32, torch.float64):
        return False
    if any(t.dtype != x.dtype or t.device.type != "cpu" for t in present):
        return False
    return torch.compiler.is_compiling() or plain_views(*present) is not None


def _kernel_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor | None, initial_states: torch.Tensor | None,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(y, final state)`` from the C++ scan kernel (:func:`.torch_kernels.scan_forward`) for plain
    float32 CPU tensors (:func:`plain_cpu`) where the kernels are built; None otherwise. A 130m
    layer's scan on 2 threads: 11 against NumPy's 26 ms at l=2048, 68 against 102 ms at l=8192."""
    tensors = (x, dt, A, B, C, D, initial_states)
    if not plain_cpu(*tensors) or any(t is not None and t.dtype != torch.float32 for t in tensors):
        return None
    if not _kernels_ready():
        return None
    return torch_kernels.scan_forward(x, dt, A, B, C, D, initial_states, chunk_size)


def _ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, initial_states: torch.Tensor | None,
              chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``portable_ssm::ssd_scan`` on the CPU: the scan kernel (:func:`_kernel_scan`), else NumPy's
    native chunk loop on zero-copy views."""
    out = _kernel_scan(x, dt, A, B, C, D, initial_states, chunk_size)
    if out is not None:
        return out
    xn, dtn, An, Bn, Cn, Dn, initial = plain_views(x, dt, A, B, C, D, initial_states)
    y, final = numpy_ops.ssd_chunked(xn, dtn, An, Bn, Cn, chunk_size, initial, D=Dn)
    return torch.from_numpy(y), torch.from_numpy(final)


def _ssd_scan_shapes(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor | None, initial_states: torch.Tensor | None,
                     chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, _, h, p = x.shape
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((b, h, p, B.shape[-1]))


def _ssd_scan_backward(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, initial_states: torch.Tensor | None, chunk_size: int,
                       dy: torch.Tensor, dfinal: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``portable_ssm::ssd_scan_backward`` on the CPU: the gradients of x, Δ, A, B, C, D and
    initial_states (an empty tensor for an absent D or initial_states) from the hand-written
    backward (``portable_ssm.backends.torch_scan``; float32 through :mod:`.torch_kernels`' C++
    backward where it is built), or, where they come out non-finite (a
    non-finite input or incoming gradient; one sum per gradient tells, a pass where ``isfinite``
    takes four), from autograd of the reference, which is then exact."""
    inputs = (x, dt, A, B, C, D, initial_states)
    torch_kernels.ensure()  # the C++ backward, built on first use
    backward_chunk = max(chunk_size, min(BACKWARD_CHUNK, x.shape[1]))  # the gradients do not depend on it
    with torch.no_grad():
        grads = torch_scan.ssd_chunked_grad(x, dt, A, B, C, backward_chunk, initial_states, D, dy, dfinal)
    sums = torch.stack([g.sum() for g in grads if g is not None])  # non-finite wherever an entry is
    if not bool(torch.isfinite(sums).all()):  # (or where a sum overflows: the reference is exact there too)
        grads = _reference_scan_grads(chunk_size, inputs, dy, dfinal)
    return tuple(x.new_empty((0,)) if g is None else g.contiguous() for g in grads)  # the strides of the fake


def _ssd_scan_backward_shapes(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              C: torch.Tensor, D: torch.Tensor | None, initial_states: torch.Tensor | None,
                              chunk_size: int, dy: torch.Tensor, dfinal: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (x, dt, A, B, C, D, initial_states))


def _reference_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, initial_states: torch.Tensor | None,
                    chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``portable_ssm.ssd.ssd_chunked_ref`` with the ``portable_ssm::ssd_scan`` op's arguments."""
    return ssd.ssd_chunked_ref(x, dt, A, B, C, chunk_size=chunk_size, initial_states=initial_states, xp=xp, D=D)


def _reference_scan_grads(chunk_size: int, inputs: tuple[torch.Tensor | None, ...], dy: torch.Tensor,
                          dfinal: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Autograd of ``portable_ssm.ssd.ssd_chunked_ref`` at ``inputs`` ``(x, Δ, A, B, C, D,
    initial_states)``: their gradients (None for a None input)."""
    leaves = tuple(None if t is None else t.detach().requires_grad_() for t in inputs)
    return _autograd_grads(_reference_scan, leaves, (dy, dfinal), chunk_size, create_graph=False)


def _save_scan_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs[:7])
    ctx.chunk_size = inputs[7]


def _scan_op_backward(ctx: Any, dy: torch.Tensor, dfinal: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    saved = ctx.saved_tensors
    if torch.is_grad_enabled():  # a backward that is differentiated in turn: autograd of the reference
        return (*_autograd_grads(_reference_scan, saved, (dy, dfinal), ctx.chunk_size, create_graph=True), None)
    grads = ssd_scan_backward(*saved, ctx.chunk_size, dy, dfinal)
    return (*(None if t is None else g for t, g in zip(saved, grads)), None)


def _define_with_backward(name: str, schema: str, impl: Callable[..., Any], shapes: Callable[..., Any],
                          backward_schema: str, backward_impl: Callable[..., Any],
                          backward_shapes: Callable[..., Any], backward: Callable[..., Any],
                          setup_context: Callable[..., Any]) -> None:
    """The ops ``portable_ssm::<name>`` and ``portable_ssm::<name>_backward`` (each its CPU
    implementation and its shapes for compiled graphs), the second reached by autograd of the first
    through ``backward``, with the inputs ``setup_context`` keeps."""
    for op, signature, fn, fake in ((name, schema, impl, shapes),
                                    (f"{name}_backward", backward_schema, backward_impl, backward_shapes)):
        _LIBRARY.define(op + signature)
        _LIBRARY.impl(op, fn, "CPU")
        torch.library.register_fake(f"portable_ssm::{op}", fake, lib=_LIBRARY)
    torch.library.register_autograd(f"portable_ssm::{name}", backward, setup_context=setup_context, lib=_LIBRARY)


_define_with_backward(
    "ssd_scan", "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? initial_states, "
    "int chunk_size) -> (Tensor, Tensor)", _ssd_scan, _ssd_scan_shapes,
    "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? initial_states, int chunk_size, "
    "Tensor dy, Tensor dfinal) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _ssd_scan_backward,
    _ssd_scan_backward_shapes, _scan_op_backward, _save_scan_inputs)
_define_with_backward(
    "conv1d_silu", "(Tensor x, Tensor weight, Tensor? bias, Tensor history) -> Tensor", _conv1d_silu,
    lambda x, *rest: torch.empty_like(x),
    "(Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor history) -> (Tensor, Tensor, Tensor, Tensor)",
    _conv1d_silu_backward, _conv1d_silu_backward_shapes, _conv_op_backward, _save_conv_inputs)
_define_with_backward(
    "gated_rms_norm", "(Tensor y, Tensor? z, Tensor weight, int groups, float eps) -> Tensor", _gated_rms_norm,
    lambda y, *rest: torch.empty_like(y, memory_format=torch.contiguous_format),
    "(Tensor dout, Tensor y, Tensor? z, Tensor weight, int groups, float eps) -> (Tensor, Tensor, Tensor)",
    _gated_rms_norm_backward, torch_kernels.gated_rms_norm_backward_shapes, _norm_op_backward, _save_norm_inputs)
#: The ``portable_ssm::gated_rms_norm`` op, ``(y [..., d], z [..., d] or None, weight [d], groups,
#: eps) -> weight ⊙ rmsnorm(y ⊙ silu(z)) [..., d]``: every float32 CPU norm (training, prompts and
#: the per-layer decode step; the whole-model batch-1 step has its own), in eager and compiled
#: graphs, forward and backward each one :mod:`.torch_kernels` kernel.
gated_rms_norm_op = torch.ops.portable_ssm.gated_rms_norm
gated_rms_norm_backward_op = torch.ops.portable_ssm.gated_rms_norm_backward
#: The ``portable_ssm::conv1d_silu`` op, ``(x [b, l, d], weight [d, k], bias [d] or None, history
#: [b, k-1, d]) -> silu(conv) [b, l, d]``: the float32 CPU conv in eager and compiled graphs, forward
#: and backward each one :mod:`.torch_kernels` kernel (float32; used only where they are built).
conv1d_silu = torch.ops.portable_ssm.conv1d_silu
conv1d_silu_backward = torch.ops.portable_ssm.conv1d_silu_backward

#: The ``portable_ssm::ssd_scan`` op, ``(x, Δ, A, B, C, D, initial_states, chunk_size) -> (y, final
#: state)`` (shapes as ``portable_ssm.ssd.ssd_chunked_ref``, the chunk length resolved): the CPU
#: training scan (no ``seq_idx``), in eager and compiled graphs alike. Forward:
#: the scan kernel (:func:`_kernel_scan`; NumPy's native chunk loop in float64); backward
#: (``portable_ssm::ssd_scan_backward``): the hand-written one of
#: ``portable_ssm.backends.torch_scan``, a reverse loop over the chunks, where autograd of the
#: reference keeps every segment's ``[h, Q, Q]`` products and takes each apart in a pass of its own.
#: The op keeps only its inputs for the backward (a 130m layer at l=2048, isolated: about 120
#: against 180 ms for the scan's forward and backward).
ssd_scan = torch.ops.portable_ssm.ssd_scan
ssd_scan_backward = torch.ops.portable_ssm.ssd_scan_backward


def pack_quantized(weight: Any) -> Any:
    """``weight`` (a :class:`~portable_ssm.quantized.QuantizedWeight`) with fbgemm's prepacked copy
    (:class:`PackedWeight`) for :func:`quantized_matmul` where it is on the CPU and fbgemm runs
    there; itself otherwise, and for a bfloat16 weight beyond float16's range.

    * int8: the per-channel qint8 weight for ``quantized::linear_dynamic``, which also rounds
      each call's rows to 8 bits (one scale per call, 7-bit range as fbgemm needs on AVX2) and
      accumulates the products in int32: the dynamic quantization of ``torch.ao``, and what
      llama.cpp's q8_0 does to activations (in blocks of 32).
    * bfloat16: float16 for ``quantized::linear_dynamic_fp16`` (float32 rows and sums). Exact:
      every bfloat16 of magnitude in [2^-14, 65504] is a float16 (8 significant bits in 11); smaller
      ones round to float16 subnormals, an absolute error under 2^-25.
    """
    if weight.data.device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return weight
    if weight.kind == "bfloat16":
        wide = weight.data.to(torch.float32)
        if float(wide.abs().max()) > _FLOAT16_MAX:
            return weight
        blob = torch.ops.quantized.linear_prepack_fp16(wide, None)
    else:
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes one
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(weight.data, weight.scale.to(torch.float64), zero, 0)
        blob = torch.ops.quantized.linear_prepack(qweight, None)
    return dataclasses.replace(weight, packed=PackedWeight(blob, weight.kind, weight.shape[0]))


def quantized_matmul(rows: torch.Tensor, weight: Any) -> torch.Tensor:
    """``rows [m, in]`` (float32) times a :class:`~portable_ssm.quantized.QuantizedWeight` transposed: ``[m,
    out]`` float32. One CPU row goes through :mod:`.torch_kernels`' row kernel where it is built
    (weight-only: the int8 weight times its row scales, the row kept float32; bfloat16 widened exactly).
    More CPU rows than ``CPU_KERNEL_MAX_ROWS`` (a prefill's): :func:`_tiled_product` (tiles of the
    weight widened to float32, each through the float32 GEMM). Otherwise torch's shipped low-precision
    kernels, on CPU for ``m <= CPU_KERNEL_MAX_ROWS``: fbgemm's on the weight's :func:`pack_quantized`
    copy where it has one (int8 also rounds the rows to 8 bits there), else int8 through
    ``torch._weight_int8pack_mm`` (weight-only, per-channel scales) and bfloat16 through ``F.linear`` in
    bfloat16 (also on CUDA at any ``m``; torch's bf16 GEMM rounds the rows and the result to bfloat16
    too). A bfloat16 weight times one CPU row under ``torch.compile`` is :func:`_one_row_product`
    instead (the weight widened exactly, float32 products: inductor streams the 2-byte weight faster
    than fbgemm's float16 GEMV, and the compiled graph calls no op outside it). Otherwise the core
    reference (dequantize, float32 matmul)."""
    on_cpu = rows.device.type == "cpu"
    if on_cpu and rows.shape[0] > CPU_KERNEL_MAX_ROWS:
        return _tiled_product(rows, weight)
    if _takes_row_kernel(rows, weight.data):
        return torch_kernels.row_product(rows.contiguous(), weight.data, weight.scale)
    if weight.kind == "bfloat16" and _streams_one_row(rows):
        return _one_row_product(rows, weight.data)
    if weight.packed is not None:
        return packed_linear(rows, weight.packed.key)
    if weight.kind == "bfloat16":
        return F.linear(rows.to(torch.bfloat16), weight.data).to(rows.dtype)
    if on_cpu:
        return torch._weight_int8pack_mm(rows.contiguous(), weight.data, weight.scale)
    return quantized_matmul_ref(rows, weight, xp=xp)


def _tiled_product(rows: torch.Tensor, weight: Any) -> torch.Tensor:
    """``rows [m, in] @ W.T -> [m, out]`` for a quantized CPU weight ``W``: tiles of its rows widened to
    float32 by NumPy's :func:`~portable_ssm.backends.numpy.quant.widen_rows` on zero-copy views (the
    reference's values exactly, in about a tenth of the time torch's casts took), each multiplied by
    torch's float32 GEMM; tiles as NumPy's (:func:`~portable_ssm.backends.numpy.quant.tile_ranges`:
    one for a 130m layer's projections). The core reference (one widened copy of the whole
    matrix) for float32 rows that autograd records, other row dtypes, graphs being compiled and
    weights that are not plain CPU tensors."""
    if rows.dtype != torch.float32 or records_grad(rows, weight.data):
        return quantized_matmul_ref(rows, weight, xp=xp)
    stored = weight.data.view(torch.int16) if weight.kind == "bfloat16" else weight.data  # NumPy has no bfloat16
    views = plain_views(stored, weight.scale)  # None: a graph being compiled, or not plain CPU tensors
    if views is None:
        return quantized_matmul_ref(rows, weight, xp=xp)
    data, scale = views
    data = data.view(np.uint16) if weight.kind == "bfloat16" else data
    tiles = numpy_quant.tile_ranges(*weight.shape)
    if len(tiles) == 1:
        return rows @ torch.from_numpy(numpy_quant.widen_rows(data, scale, 0, weight.shape[0])).T
    out = rows.new_empty((rows.shape[0], weight.shape[0]))
    for start, stop in tiles:
        out[:, start:stop] = rows @ torch.from_numpy(numpy_quant.widen_rows(data, scale, start, stop)).T
    return out


def _streams_one_row(rows: torch.Tensor) -> bool:
    """Whether ``rows`` is the one CPU row of a decode step ``torch.compile`` is tracing."""
    return rows.shape[0] == 1 and rows.device.type == "cpu" and torch.compiler.is_compiling()


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """``t``, stored as its own buffer in inductor's graph rather than recomputed inline by each
    consumer: inductor's ``force_stride_order`` prim (its module registers it; imported here, while
    tracing, so any torch.compile of the core gets it); ``t`` unchanged where the prim is missing."""
    from torch._inductor import inductor_prims  # noqa: F401

    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return t if force is None else force(t, t.stride())


def _one_row_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows [1, in] @ weight.T -> [1, out]`` (float32) as a multiply and a sum over ``in``, the
    weight widened to float32 first: inductor generates one vectorized loop streaming the weight
    (its external GEMV reads it at about half the memory bandwidth on CPUs where MKL takes a
    generic path). The row is materialized first, else inductor inlines its producers (the
    norm's division, the residual sums, the embedding gather) into every weight row's loop."""
    rows = _materialized(rows)
    return torch.sum(weight.to(rows.dtype) * rows, dim=-1)[None]  # [out, in] · [1, in] summed -> [1, out]


def _takes_row_kernel(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rows @ weight.T`` runs :mod:`.torch_kernels`' row kernel: one float32 CPU row, a
    contiguous float32 / int8 / bfloat16 weight, nothing autograd records, and the kernel built
    (eager calls build it on first use; a graph being traced only asks whether it was)."""
    if rows.shape[0] != 1 or rows.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if rows.dtype != torch.float32 or weight.dtype not in torch_kernels.WEIGHT_DTYPES or records_grad(rows, weight):
        return False
    if not weight.is_contiguous():
        return False
    return _kernels_ready()


def _kernels_ready() -> bool:
    """Whether :mod:`.torch_kernels` is built: eager calls build it on first use, a graph being
    traced only asks whether it was."""
    return torch_kernels.ready() if torch.compiler.is_compiling() else torch_kernels.ensure()


def decode_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows [m, in] @ weight.T -> [m, out]`` for decode's ``m < 16``: one float32 CPU row through
    :mod:`.torch_kernels`' row kernel where it is built; else ``weight @ rows.T`` as the core
    computes it, except while ``torch.compile`` traces a CPU step of one row:
    :func:`_one_row_product`."""
    if _takes_row_kernel(rows, weight):
        return torch_kernels.row_product(rows.contiguous(), weight)
    if _streams_one_row(rows):
        return _one_row_product(rows, weight)
    return torch.matmul(weight, rows.mT).mT  # [out, m] -> [m, out]


def decode_step(xBC: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_limit: tuple[float, float],
                ngroups: int, headdim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The ``decode_step`` hook: :mod:`.torch_kernels`' fused step for float32 CPU tensors autograd
    does not record, where the kernel is built (:func:`_kernels_ready`); None otherwise, and the
    core's array-API step runs."""
    tensors = (xBC, dt, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A, D)
    present = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch_kernels.DECODE_DTYPE for t in present):
        return None
    if records_grad(*present):
        return None
    if not _kernels_ready():
        return None
    return torch_kernels.decode_step(xBC, dt, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A, D,
                                     dt_limit, ngroups, headdim)


def _row_kernel_weight(w: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(storage, int8 row scales or None)`` of a projection the row kernel reads (a contiguous
    float32 tensor, or a :class:`~portable_ssm.quantized.QuantizedWeight` of int8 or bfloat16);
    None for any other."""
    data, scale = (w.data, w.scale) if isinstance(w, QuantizedWeight) else (w, None)
    if data.dtype not in torch_kernels.WEIGHT_DTYPES or data.device.type != "cpu" or not data.is_contiguous():
        return None
    return data, scale


def _model_weights(params: dict[str, Any], config: Mamba2Config) -> torch_kernels.ModelWeights | None:
    """``params`` as :func:`.torch_kernels.decode_model` reads them, or None where it cannot: a
    projection bias, a weight the row kernel does not read, or another tensor not contiguous
    float32 on the CPU."""
    leaves = ("in_proj", "out_proj")
    if any(f"layers.{i}.mixer.{leaf}.bias" in params for i in range(config.n_layer) for leaf in leaves):
        return None
    projections = [_row_kernel_weight(params[f"layers.{i}.mixer.{leaf}.weight"])
                   for i in range(config.n_layer) for leaf in leaves]
    head = _row_kernel_weight(lm.head_weight(params, config))
    if head is None or any(w is None for w in projections):
        return None
    layer = [[params[f"layers.{i}.{name}"] for i in range(config.n_layer)]
             for name in ("norm.weight", "mixer.conv1d.weight", "mixer.dt_bias", "mixer.A_log", "mixer.D",
                          "mixer.norm.weight")]
    biases = [params.get(f"layers.{i}.mixer.conv1d.bias") for i in range(config.n_layer)]
    plain = [*itertools.chain.from_iterable(layer), *(b for b in biases if b is not None), params["norm_f.weight"]]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in plain):
        return None
    norms, conv_weights, dt_biases, A_logs, Ds, gate_norms = layer
    (in_weights, in_scales), (out_weights, out_scales) = (map(list, zip(*projections[j::2])) for j in (0, 1))
    return torch_kernels.ModelWeights(norms, in_weights, in_scales, conv_weights, biases, dt_biases, A_logs, Ds,
                                      gate_norms, out_weights, out_scales, params["norm_f.weight"], *head)


#: The last params :func:`_known_model_weights` prepared: ``{(config, names, ids of the values):
#: ModelWeights of weak references}`` (weak, so a model the caller drops is freed).
_PREPARED: dict[tuple[Any, ...], torch_kernels.ModelWeights] = {}


def _strong(r: Any) -> Any:
    return None if r is None else r()


def _each(fn: Callable[[Any], Any], weights: torch_kernels.ModelWeights) -> torch_kernels.ModelWeights:
    """``weights`` with ``fn`` applied to every entry, those of the per-layer lists included."""
    return torch_kernels.ModelWeights(*(list(map(fn, f)) if isinstance(f, list) else fn(f) for f in weights))


def _entries(weights: torch_kernels.ModelWeights) -> Iterator[Any]:
    """Every entry of ``weights``, those of the per-layer lists included, in order."""
    return itertools.chain.from_iterable(f if isinstance(f, list) else [f] for f in weights)


def _known_model_weights(params: dict[str, Any], config: Mamba2Config) -> torch_kernels.ModelWeights | None:
    """:func:`_model_weights`, remembered for the params last asked about (the same names and the
    same objects): gathering and checking a 24-layer model's tensors costs about 0.3 ms, a tenth of
    an int8 step. The entry goes when any of its tensors is freed (its weak reference's callback),
    so a remembered one is used without checking each tensor per step."""
    key = (config, tuple(params), tuple(map(id, params.values())))
    refs = _PREPARED.get(key)
    if refs is not None:
        return _each(_strong, refs)
    weights = _model_weights(params, config)
    _PREPARED.clear()
    if weights is not None:
        def forget(_: weakref.ref, key: tuple[Any, ...] = key) -> None:
            _PREPARED.pop(key, None)

        _PREPARED[key] = _each(lambda v: None if v is None else weakref.ref(v, forget), weights)
    return weights


def decode_model(x: torch.Tensor, state: Mamba2State, params: dict[str, Any],
                 config: Mamba2Config) -> tuple[torch.Tensor, Mamba2State] | None:
    """The ``decode_model`` hook: one batch-1 token through the whole language model in one call of
    :mod:`.torch_kernels`' ``decode_model`` (no Python, dispatch or graph guards between the
    layers' kernels), for a float32 CPU row autograd does not record, where the kernels are built,
    and for the variant the kernel computes (no gated MLP, the gated norm after the gate, no
    projection biases, float32 / int8 / bfloat16 weights); None otherwise, and the core's per-layer
    step runs. Also None while ``torch.compile`` traces: inductor's C++ wrapper calls no op that
    returns lists of tensors, and the compiled per-layer step (with its own kernels) runs instead.
    Returns ``(logits [1, rows], new state)``."""
    c = config
    if c.d_mlp or not c.rmsnorm or c.norm_before_gate or x.shape[0] != 1 or torch.compiler.is_compiling():
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or not _kernels_ready():
        return None
    weights = _known_model_weights(params, c)
    if weights is None:
        return None
    if torch.is_grad_enabled() and records_grad(x, *_entries(weights)):
        return None
    out, convs, ssms = torch_kernels.decode_model(
        x.contiguous(), [t.contiguous() for t in state.conv], [t.contiguous() for t in state.ssm], weights,
        c.norm_eps, c.dt_limit, c.ngroups, c.headdim)
    return out, Mamba2State(conv=tuple(convs), ssm=tuple(ssms))


# --- Training: an nn.Module whose forward is the array-API core (no second implementation) ---

_NO_DECAY_LEAVES = ("A_log", "D", "dt_bias", "bias")
_NORM_MODULES = ("norm", "norm_f")


def _dtype_name(value: torch.dtype | str | None) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / None (float32) as a dtype name."""
    return "float32" if value is None else str(value).split(".")[-1]


def _attach(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Registers ``value`` as an ``nn.Parameter`` at the dotted ``name`` under ``root``, creating the
    modules on the way, so ``root.state_dict()`` keys equal the core's parameter names."""
    parts = name.split(".")
    module = root
    for i, part in enumerate(parts[:-1]):
        child = dict(module.named_children()).get(part)
        if child is None:
            child = nn.ModuleList() if parts[i + 1].isdigit() else nn.Module()  # layers[i] indexes
            module.add_module(part, child)
        module = child
    module.register_parameter(parts[-1], nn.Parameter(value))


def _checkpointed_mixer(*args: Any, **kwargs: Any) -> Any:
    """The core's ``mixer`` under ``torch.utils.checkpoint``: its activations are recomputed in backward."""
    return torch.utils.checkpoint.checkpoint(mixer, *args, use_reentrant=False, **kwargs)


def decays(name: str) -> bool:
    """Whether the parameter called ``name`` (any prefix) gets weight decay: not A_log, D, dt_bias,
    biases or norm weights (mamba_ssm's ``_no_weight_decay`` rule)."""
    parts = name.split(".")
    return parts[-1] not in _NO_DECAY_LEAVES and not any(p in _NORM_MODULES for p in parts)


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups for any module holding a Mamba-2: decayed weights, and the rest with
    ``weight_decay=0`` (see :func:`decays`). Each group also lists its parameter ``names``."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = []
    for wanted, wd in ((True, weight_decay), (False, 0.0)):
        chosen = [(n, p) for n, p in named if decays(n) is wanted]
        groups.append({"params": [p for _, p in chosen], "names": [n for n, _ in chosen], "weight_decay": wd})
    return groups


def detach_state(state: Mamba2State) -> Mamba2State:
    """The state with its history cut from the graph: truncated BPTT between segments."""
    return Mamba2State(conv=tuple(t.detach() for t in state.conv), ssm=tuple(t.detach() for t in state.ssm))


_COMPILED: dict[tuple[Callable[..., Any], bool], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any], *, cpp_wrapper: bool = False) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False)``, made once per function, so every module and call shares
    its compiled graphs: one per shape (the core picks chunk sizes and matmul forms from the shapes,
    which symbolic shapes cannot decide) and set of arguments, as torch.compile guards them.
    ``cpp_wrapper``: inductor's ``cpp_wrapper`` option, the code that calls the graph's kernels and
    ops written in C++ as well, rather than Python (a 130m decode step on CPU makes about 300
    such calls and checks: 5-10% of its time)."""
    key = (fn, cpp_wrapper)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=False, options={"cpp_wrapper": True} if cpp_wrapper else None)
    return _COMPILED[key]


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied to row-major strides unless it has them (size-1 axes included)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    return t if t.stride() == tuple(reversed(strides)) else t.clone(memory_format=torch.contiguous_format)


def compile_step(fn: Callable[..., Any], name: str, donate: tuple[int, ...]) -> Callable[..., Any]:
    """Generation's compiler on request (``compile=True``): :func:`compiled` of the decode step
    ``name`` ``(token, state, ...)``, its state made row-major first. torch.compile guards strides,
    so the prefill's state (views into its scan's buffers) and the steps' own would otherwise
    compile the step twice; once row-major, a step's output feeds the next without a copy.
    (torch.compile donates no buffers: ``donate`` is not needed.) The CPU row kernel
    (:mod:`.torch_kernels`) is built first, so the traced step can call it, and a CPU step is
    compiled with ``cpp_wrapper`` (:func:`compiled`)."""
    torch_kernels.ensure()

    def step(token: Any, state: Mamba2State, *rest: Any) -> Any:
        canonical = Mamba2State(conv=tuple(map(_canonical, state.conv)), ssm=tuple(map(_canonical, state.ssm)))
        return compiled(fn, cpp_wrapper=token.device.type == "cpu")(token, canonical, *rest)

    return step


FAST_OPS: dict[str, Any] = {"causal_conv1d": causal_conv1d, "causal_conv1d_silu": causal_conv1d_silu,
                            "compile": compile_step, "decode_hybrid": torch_hybrid.decode_hybrid,
                            "decode_linear": decode_linear, "decode_model": decode_model, "decode_step": decode_step,
                            "gated_rms_norm": gated_rms_norm,
                            "pack_quantized": pack_quantized, "quantized_matmul": quantized_matmul,
                            "split": split, "ssd_chunked": ssd_chunked}


class Mamba2Module(nn.Module):
    """The Mamba-2 backbone as an ``nn.Module``: ``x [b, l, d_model] -> [b, l, d_model]``.

    Its ``nn.Parameter``s sit under the core's names (``state_dict()`` keys are the checkpoint
    names, e.g. ``layers.0.mixer.in_proj.weight``) and start as ``init_params(config, seed=seed)``.
    ``forward`` hands them to :func:`portable_ssm.forward` as the params dict, so autograd,
    ``torch.compile`` and ``torch.autocast`` see the core's own torch ops.

    Args:
        config: the model's :class:`~portable_ssm.Mamba2Config`.
        dtype: parameter dtype (``torch.float32`` default; bf16/fp16 compute in float32 inside).
        device: where the parameters live.
        seed: the ``init_params`` seed.
        checkpoint_blocks: recompute each layer's mixer in backward (``torch.utils.checkpoint``)
            instead of keeping its activations, while gradients are being recorded.
        compile: run the core through ``torch.compile`` (inductor: on CPU it generates C++ that
            fuses the elementwise passes; the first call of each shape compiles, for minutes on
            a big model). The same math as eager; tested against it, gradients included.
    """

    def __init__(self, config: Mamba2Config, *, dtype: torch.dtype | str | None = None, device: Any = None,
                 seed: int = 0, checkpoint_blocks: bool = False, compile: bool = False) -> None:
        super().__init__()
        if not isinstance(config, Mamba2Config):
            raise TypeError(f"config: expected a Mamba2Config, got {type(config).__name__}")
        self.config = config
        self.checkpoint_blocks = bool(checkpoint_blocks)
        self.compile = bool(compile)
        params = init_params(config, seed=seed, backend="torch", dtype=_dtype_name(dtype), device=device)
        for name, value in params.items():
            _attach(self, name, value)

    def params(self) -> dict[str, torch.Tensor]:
        """The core's parameter dict: this module's own Parameters under their checkpoint names."""
        return dict(self.named_parameters())

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Optimizer groups exempting A_log, D, dt_bias, norms and biases from decay."""
        return param_groups(self, weight_decay)

    def forward(self, x: torch.Tensor, initial_state: Mamba2State | None = None, return_state: bool = False,
                seq_idx: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, Mamba2State]:
        """``x [b, l, d_model]`` (the parameters' dtype) -> ``y [b, l, d_model]``, or ``(y, state)``
        with ``return_state``. ``initial_state`` continues an earlier segment (see
        :func:`detach_state`); ``seq_idx [b, l]`` marks packed sequences (``portable_ssm.collate``)."""
        x = self._autocast_input(x)
        y, state = self._core(core_forward)(x, self.params(), config=self.config, initial_state=initial_state,
                                            return_state=True, seq_idx=seq_idx, layer=self._layer())
        return (y, self._conv_in_param_dtype(state)) if return_state else y

    def _param_dtype(self) -> torch.dtype:
        return next(iter(self.parameters())).dtype

    def _autocast_input(self, x: Any) -> Any:
        """Under ``torch.autocast`` the layer before hands over bf16/fp16 activations while the core
        wants the parameters' dtype (its SSM math runs in float32 regardless): cast them back.
        Outside autocast a dtype mismatch stays the core's TypeError."""
        dtype = self._param_dtype()
        if (torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype
                and torch.is_autocast_enabled(x.device.type)):
            return x.to(dtype)
        return x

    def _conv_in_param_dtype(self, state: Mamba2State) -> Mamba2State:
        """Conv states in the parameters' dtype: under autocast the conv saw bf16 activations, but a
        state passed back as ``initial_state`` must have x's dtype (SSM states stay float32)."""
        dtype = self._param_dtype()
        return Mamba2State(conv=tuple(c.to(dtype) for c in state.conv), ssm=state.ssm)

    def _core(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a core entry), or its ``torch.compile`` with ``compile=True``."""
        return compiled(fn) if self.compile else fn

    def _layer(self) -> Any:
        """The mixer stand-in for the core: a checkpointed mixer while gradients are recorded with
        ``checkpoint_blocks``, else None (the core's own, in token blocks)."""
        return _checkpointed_mixer if self.checkpoint_blocks and torch.is_grad_enabled() else None


class Mamba2LMModule(Mamba2Module):
    """A Mamba-2 language model: ``input_ids [b, l]`` (integers) -> logits ``[b, l, padded_vocab]``,
    with the embedding and the (tied by default) head of ``config``; forward is
    :func:`portable_ssm.lm.logits`. Arguments as :class:`Mamba2Module`."""

    def __init__(self, config: Mamba2Config, **kwargs: Any) -> None:
        if isinstance(config, Mamba2Config) and config.vocab_size is None:
            raise ValueError("config.vocab_size: a language model needs a vocabulary, got None")
        super().__init__(config, **kwargs)

    def forward(self, input_ids: torch.Tensor, initial_state: Mamba2State | None = None,
                return_state: bool = False, seq_idx: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, Mamba2State]:
        """``input_ids [b, l]`` -> logits ``[b, l, padded_vocab]`` (float32 for float32 parameters),
        or ``(logits, state)``; arguments as :meth:`Mamba2Module.forward`, ``attention_mask [b, l]``
        (left padding) as in :func:`portable_ssm.forward`."""
        out, state = self._core(lm.logits)(input_ids, self.params(), config=self.config,
                                           initial_state=initial_state, return_state=True, seq_idx=seq_idx,
                                           layer=self._layer(), attention_mask=attention_mask)
        return (out, self._conv_in_param_dtype(state)) if return_state else out

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int | None = None,
                 **options: Any) -> torch.Tensor | tuple[torch.Tensor, Mamba2State]:
        """``input_ids [b, l]`` -> ``[b, l + new]`` without gradients: the core's cached
        :func:`portable_ssm.generation.generate` on this module's parameters (same options:
        attention_mask, initial_state, return_state, sampling, stopping; ``compile`` defaults to
        the module's: its decode step through ``torch.compile``)."""
        options.setdefault("compile", self.compile)
        with torch.no_grad():
            return generation.generate(input_ids, self.params(), config=self.config,
                                       max_new_tokens=max_new_tokens, **options)


# --- Optimizer state as named tensors, for safetensors checkpoints (never pickle) ---

def _param_order(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The names of the optimizer's parameters in its ``state_dict`` index order."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("optimizer: it holds a parameter that is not one of the module's")
            order.append(names[id(p)])
    return order


def optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The optimizer's state as ``{"{param name}/{key}": tensor}`` plus string metadata (groups'
    hyper-parameters and non-tensor state as JSON), ready for ``checkpoint.save_arrays``."""
    order = _param_order(optimizer, module)
    saved = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, fields in saved["state"].items():
        for key, value in fields.items():
            if torch.is_tensor(value):
                tensors[f"{order[index]}/{key}"] = value
            else:
                scalars.setdefault(order[index], {})[key] = value
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]
    return tensors, {"optimizer_groups": json.dumps(groups), "optimizer_scalars": json.dumps(scalars)}


def load_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, tensors: dict[str, Any],
                         metadata: dict[str, str]) -> None:
    """Restores what :func:`optimizer_state` returned (e.g. read back with ``load_arrays``).
    ValueError naming the tensor when one belongs to no parameter of ``module``."""
    order = _param_order(optimizer, module)
    index = {name: i for i, name in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise ValueError(f"optimizer state: tensor {key!r} belongs to no parameter of the module")
        state.setdefault(index[name], {})[field] = value
    for name, fields in json.loads(metadata.get("optimizer_scalars", "{}")).items():
        state.setdefault(index[name], {}).update(fields)
    groups = json.loads(metadata["optimizer_groups"])
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
