"""PyTorch: conversion, devices, the native conv1d fast path, and (for training) the nn.Module adapter.

The core runs unchanged on torch tensors through array_api_compat, so autograd, ``torch.compile``
and autocast see ordinary torch ops.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.torch as xp
import numpy as np
import torch
import torch.nn.functional as F


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    return getattr(torch, name)


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    out = torch.from_numpy(np.ascontiguousarray(host))
    return out.to(device=device, dtype=None if dtype_name is None else dtype(dtype_name))


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    return x.to(device=device, dtype=None if dtype_name is None else dtype(dtype_name))


def to_numpy(x: Any) -> np.ndarray:
    x = x.detach()
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    return x.cpu().numpy()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.conv1d`` version of ``portable_ssm.conv.causal_conv1d_ref``:
    ``x [b, l, d]``, weight ``[d, k]``, state ``[b, d, k]`` -> ``(y [b, l, d], state [b, d, k])``."""
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


FAST_OPS: dict[str, Any] = {"causal_conv1d": causal_conv1d}
