"""Left-padded batches (``attention_mask``): masked positions leave the conv window and the SSM state untouched.

transformers' semantics: ``attention_mask [b, l]`` holds 1 (or True) for real tokens and 0 for
padding. Only left padding is supported, every row ``0 ... 0 1 ... 1`` (an all-ones row is
unpadded, an all-zeros row passes its state through): a mask with a hole or right padding is a
ValueError. With left padding every row gives, at its real positions and in its returned state,
exactly what it gives alone without the padding, from the same initial state:

* conv: each row's incoming conv state is placed right before its first real token, so the taps
  never read a padded input (:func:`padded_conv`);
* SSM: Δ is 0 at masked positions, so the state neither decays nor takes input there.

Outputs at masked positions are finite but meaningless. A mask of all ones is dropped at the door,
so it costs nothing and gives bit for bit the unmasked result.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from ._array import Array, Namespace, device, dtype_name, namespace
from ._checks import Shapes, check_same_device


def check_attention_mask(mask: Array, shapes: Shapes, ref_name: str, ref: Array, *, xp: Namespace) -> Array | None:
    """The padding length of each row ``[b]`` (int64) for a left-padding ``mask [b, l]`` (bool or
    0/1 integers), checked against ``ref``; None when nothing is masked. One host sync."""
    namespace(attention_mask=mask, **{ref_name: ref})
    shapes.check("attention_mask", mask, ("b", "l"))
    check_same_device("attention_mask", mask, ref_name, ref)
    if mask.dtype == xp.bool:
        valid = mask
    elif xp.isdtype(mask.dtype, "integral"):
        if bool(xp.any((mask != 0) & (mask != 1))):
            raise ValueError("attention_mask: expected 0 (padding) or 1 (token) entries, got other values")
        valid = mask == 1
    else:
        raise TypeError(f"attention_mask: expected a bool or integer dtype, got {dtype_name(mask.dtype)}")
    if mask.shape[1] > 1 and bool(xp.any(valid[:, :-1] & xp.logical_not(valid[:, 1:]))):
        raise ValueError("attention_mask: only left padding is supported (each row 0 ... 0 then 1 ... 1); "
                         "got a row where a token is followed by padding")
    pad = xp.sum(xp.astype(xp.logical_not(valid), xp.int64), axis=1)  # [b]
    return pad if bool(xp.any(pad > 0)) else None


def padded_layer(layer: Callable[..., Any], mask: Array | None, seq_idx: Array | None, shapes: Shapes,
                 ref_name: str, ref: Array, *, xp: Namespace, cu_seqlens: Array | None = None) -> Callable[..., Any]:
    """``layer`` given the checked padding lengths as ``pad=`` (``layer`` itself without a mask or
    when nothing is masked)."""
    if mask is None:
        return layer
    for name, packed in (("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)):
        if packed is not None:
            raise ValueError(f"attention_mask: not supported together with {name} (packed rows); pass one of them")
    pad = check_attention_mask(mask, shapes, ref_name, ref, xp=xp)
    return layer if pad is None else partial(layer, pad=pad)


def _tokens_after_state(x: Array, state: Array, pad: Array, *, xp: Namespace) -> Array:
    """``x [b, l, d]`` and a conv state ``[b, d, k]`` as one ``[b, k + l, d]`` input per row: zeros,
    then the k state columns, then the row's real tokens (its last ``l - pad`` ones)."""
    b, l, d = x.shape
    k = state.shape[-1]
    rel = xp.arange(k + l, device=device(x))[None, :] - pad[:, None]  # position from each row's state, [b, k + l]
    shifted = xp.concat([xp.zeros((b, k, d), dtype=x.dtype, device=device(x)), x], axis=1)  # [b, k + l, d]
    wide = xp.where((rel >= k)[..., None], shifted, xp.zeros_like(shifted))
    for i in range(k):
        wide = xp.where((rel == i)[..., None], xp.astype(state[:, None, :, i], x.dtype, copy=False), wide)
    return wide


def padded_conv(conv: Callable[..., Any], x: Array, weight: Array, bias: Array | None, state: Array | None,
                pad: Array, *, xp: Namespace) -> tuple[Array, Array]:
    """``conv`` (:func:`portable_ssm.conv.causal_conv1d_silu`'s signature) over the left-padded
    ``x [b, l, d]`` as if each row's padding were absent: ``(y [b, l, d], new_state [b, d, k])``."""
    k = weight.shape[-1]
    if state is None:
        state = xp.zeros((x.shape[0], x.shape[2], k), dtype=x.dtype, device=device(x))
    y, new_state = conv(_tokens_after_state(x, state, pad, xp=xp), weight, bias, None, xp=xp)  # [b, k + l, d]
    return y[:, k:, :], new_state


def unpadded_delta(dt: Array, pad: Array, *, xp: Namespace) -> Array:
    """Δ ``[b, l, h]`` set to 0 at each row's first ``pad`` positions: the state passes them unchanged."""
    valid = xp.arange(dt.shape[1], device=device(dt))[None, :] >= pad[:, None]  # [b, l]
    return xp.where(valid[..., None], dt, xp.zeros_like(dt))
