"""Causal depthwise conv1d over time (MAMBA2_SPEC.md step 2) and its one-token update.

The conv state keeps the last k inputs per channel, ``[b, channels, k]`` (mamba_ssm and
transformers layout). The output at t sees inputs t-k+1..t only.
"""

from __future__ import annotations

from ._array import Array, Namespace, device
from .backends import fast_op


def causal_conv1d(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                  xp: Namespace) -> tuple[Array, Array]:
    """``x [b, l, d]``, weight ``[d, k]``, bias ``[d]``, state ``[b, d, k]`` or None (zeros).

    Returns ``(y [b, l, d], new_state [b, d, k])``. A backend may provide a native version
    (``fast_op(xp, "causal_conv1d")``); this one is the reference both are tested against.
    """
    native = fast_op(xp, "causal_conv1d")
    if native is not None:
        return native(x, weight, bias, state)
    return causal_conv1d_ref(x, weight, bias, state, xp=xp)


def causal_conv1d_ref(x: Array, weight: Array, bias: Array | None, state: Array | None, *,
                      xp: Namespace) -> tuple[Array, Array]:
    """The standard-functions conv: a sum of k shifted slices (k is small, 4 by default)."""
    b, l, d = x.shape
    k = weight.shape[-1]
    if state is None:
        history = xp.zeros((b, k - 1, d), dtype=x.dtype, device=device(x))  # [b, k-1, d]
    else:
        history = xp.permute_dims(xp.astype(state[:, :, 1:], x.dtype), (0, 2, 1))  # [b, k-1, d]
    padded = xp.concat([history, x], axis=1)  # [b, k-1+l, d]
    y = padded[:, 0:l, :] * weight[:, 0]
    for j in range(1, k):
        y = y + padded[:, j:j + l, :] * weight[:, j]  # [b, l, d]
    if bias is not None:
        y = y + bias
    new_state = xp.permute_dims(padded[:, l - 1:, :], (0, 2, 1))  # last k inputs, [b, d, k]
    return y, new_state


def conv_step(x: Array, weight: Array, bias: Array | None, state: Array, *,
              xp: Namespace) -> tuple[Array, Array]:
    """One token: ``x [b, d]``, state ``[b, d, k]`` -> ``(y [b, d], new_state [b, d, k])``."""
    state = xp.concat([state[:, :, 1:], xp.astype(x, state.dtype)[:, :, None]], axis=-1)  # [b, d, k]
    y = xp.sum(state * weight, axis=-1)  # [b, d]
    if bias is not None:
        y = y + bias
    return y, state
