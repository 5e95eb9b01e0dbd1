"""PyTorch interop: the CuPy kernels on CUDA torch tensors, zero-copy through DLPack.

:func:`fast_ops` gives the three hooks (``causal_conv1d``, ``ssd_chunked``, ``decode_step``, with
the core's signatures) for torch tensors: CUDA tensors run the CuPy kernels on torch's current
stream (bfloat16 travels as int16 bits), other tensors run the array-API reference. The conv and
the scan are ``torch.autograd.Function``s whose backward recomputes the forward with the array-API
core on torch and differentiates that (a first step: no backward kernels yet), so a torch module on
CUDA can train with them; the decode step is inference only (with gradients wanted it runs the
reference). :func:`use_kernels` installs the hooks into the torch backend's ``FAST_OPS`` for a
block of code: the opt-in for ``Mamba2Module``. Not yet verified on a GPU, so it asks for
``PORTABLE_SSM_CUPY_KERNELS=1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cupy
import torch
from portable_ssm.backends import torch as torch_backend

from portable_ssm.ssm_inputs import skip_and_gate

from . import KERNELS
from .reference import causal_conv1d_ref, decode_step_ref, ssd_chunked_ref
from .sources import SWITCH, kernels_enabled

_XP = torch_backend.namespace()


def _cupy(t: torch.Tensor | None) -> Any:
    """A CuPy view of a CUDA tensor (bfloat16 as int16 bits), without a copy when contiguous."""
    if t is None:
        return None
    t = t.detach().contiguous()
    return cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def _torch(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """The tensor viewing a CuPy result, reinterpreted as ``dtype`` (bfloat16 from int16 bits)."""
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


@contextlib.contextmanager
def _torch_stream(t: torch.Tensor) -> Iterator[None]:
    """CuPy on ``t``'s device and on torch's current stream there, so kernels queue behind torch's work
    (tensors go to CuPy and results come back inside it, so DLPack needs no cross-stream wait)."""
    stream = torch.cuda.current_stream(t.device)
    with cupy.cuda.Device(t.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        yield


def _reference_grads(ctx: Any, reference: Callable[..., Sequence[torch.Tensor]],
                     grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """Backward by recomputation: the gradients of the array-API ``reference`` at the saved inputs."""
    inputs = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:len(inputs)]
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(inputs, wanted)]
        outputs = reference(*leaves)
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if out.requires_grad]
        wrt = [leaf for leaf, need in zip(leaves, wanted) if need]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                         allow_unused=True))
    return tuple(next(found) if need else None for need in wanted)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: torch.Tensor | None, seq_idx: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        with _torch_stream(x):
            y, new_state = KERNELS.causal_conv1d(_cupy(x), _cupy(weight), _cupy(bias), _cupy(state),
                                                 _cupy(seq_idx))
            outputs = _torch(y, x.dtype), _torch(new_state, x.dtype)
        ctx.save_for_backward(x, weight, bias, state, seq_idx)
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, grad_state: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        def reference(x: Any, weight: Any, bias: Any, state: Any, seq_idx: Any) -> Any:
            return causal_conv1d_ref(x, weight, bias, state, xp=_XP, seq_idx=seq_idx)

        return _reference_grads(ctx, reference, (grad_y, grad_state))


class _SsdChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, initial_states: torch.Tensor | None, seq_idx: torch.Tensor | None,
                chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        with _torch_stream(x):
            y, final = KERNELS.ssd_chunked(_cupy(x), _cupy(dt), _cupy(A), _cupy(B), _cupy(C), chunk_size,
                                           _cupy(initial_states), seq_idx=_cupy(seq_idx))
            outputs = _torch(y, x.dtype), _torch(final, x.dtype)
        ctx.save_for_backward(x, dt, A, B, C, initial_states, seq_idx)
        ctx.chunk_size = chunk_size
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, grad_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        def reference(x: Any, dt: Any, A: Any, B: Any, C: Any, initial_states: Any, seq_idx: Any) -> Any:
            return ssd_chunked_ref(x, dt, A, B, C, chunk_size=ctx.chunk_size, initial_states=initial_states,
                               xp=_XP, seq_idx=seq_idx)

        return (*_reference_grads(ctx, reference, (grad_y, grad_final)), None)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None,
                  seq_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``causal_conv1d`` hook on torch: the CuPy kernel for CUDA tensors (differentiable), else
    the torch backend's conv (or the reference with ``seq_idx``)."""
    if x.is_cuda:
        return _CausalConv1d.apply(x, weight, bias, state, seq_idx)
    if seq_idx is None:
        return torch_backend.causal_conv1d(x, weight, bias, state)
    return causal_conv1d_ref(x, weight, bias, state, xp=_XP, seq_idx=seq_idx)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int | None, initial_states: torch.Tensor | None,
                seq_idx: torch.Tensor | None = None,
                D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ssd_chunked`` hook on torch: the CuPy kernels for CUDA tensors (differentiable; the D
    skip is added by torch, so autograd reaches D), else the array-API scan. Inputs in the compute
    dtype; returns ``(y, final_states)`` with the D skip but without the gate."""
    if not x.is_cuda:
        return ssd_chunked_ref(x, dt, A, B, C, chunk_size=chunk_size, initial_states=initial_states,
                               xp=_XP, seq_idx=seq_idx, D=D)
    y, final = _SsdChunked.apply(x, dt, A, B, C, initial_states, seq_idx, chunk_size)
    return skip_and_gate(y, x, D, None, xp=_XP), final


def decode_step(xBC: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_limit: tuple[float, float],
                ngroups: int, headdim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``decode_step`` hook on torch: the fused kernel for CUDA tensors when no gradient is
    wanted, else :func:`~.reference.decode_step_ref` (arguments documented there)."""
    tensors = (xBC, dt, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A, D)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not xBC.is_cuda or wants_grad:
        return decode_step_ref(*tensors, dt_limit, ngroups, headdim)
    with _torch_stream(xBC):
        y, conv, ssm = KERNELS.decode_step(*(_cupy(t) for t in tensors), dt_limit, ngroups, headdim)
        return _torch(y, xBC.dtype), _torch(conv, conv_state.dtype), _torch(ssm, ssm_state.dtype)


def fast_ops() -> dict[str, Callable[..., Any]]:
    """The three hooks on torch tensors, keyed as in the backends' ``FAST_OPS``."""
    return {"causal_conv1d": causal_conv1d, "ssd_chunked": ssd_chunked, "decode_step": decode_step}


@contextlib.contextmanager
def use_kernels() -> Iterator[None]:
    """Within the block, the core on CUDA torch tensors runs the CuPy kernels (``forward``, ``step``
    and training through autograd); the torch backend's ``FAST_OPS`` is restored on exit.

    Raises RuntimeError unless ``PORTABLE_SSM_CUPY_KERNELS=1``: the kernels are not yet verified on a GPU.
    """
    if not kernels_enabled():
        raise RuntimeError(f"the CuPy kernels are not yet verified on a GPU; set {SWITCH}=1 to use them")
    saved = dict(torch_backend.FAST_OPS)
    torch_backend.FAST_OPS.update(fast_ops())
    try:
        yield
    finally:
        torch_backend.FAST_OPS.clear()
        torch_backend.FAST_OPS.update(saved)
