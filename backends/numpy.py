"""NumPy: the host backend. It also owns the random generator ``init_params`` draws from, so
every backend starts from the same numbers for the same seed, plus two native fast paths: a tiled
causal conv and in-place state passing."""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as xp
import numpy as np

#: Time steps per tile of the native conv: every tap of a tile stays in cache while it is summed.
CONV_TILE_STEPS = 32


def namespace() -> Any:
    return xp


def dtype(name: str) -> Any:
    if name == "bfloat16":
        raise TypeError("dtype: numpy has no bfloat16; use float32 or float64 (or torch/jax for bf16)")
    return getattr(np, name)


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    if device not in (None, "cpu"):
        raise ValueError(f"device: numpy arrays live on 'cpu', got {device!r}")
    out = np.asarray(host)
    return out if dtype_name is None else out.astype(dtype(dtype_name), copy=False)


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    return asarray(x, dtype_name, device)


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(x)


def rng(seed: int) -> np.random.Generator:
    """The generator behind ``init_params(seed=...)``."""
    return np.random.default_rng(seed)


def causal_conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                  state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Tiled version of ``portable_ssm.conv.causal_conv1d_ref``: the same sum of k shifted slices,
    accumulated in place tile by tile of CONV_TILE_STEPS steps, so a tile's taps are read from
    cache rather than memory (about 2x on a 1024-step block of a 130m layer).
    ``x [b, l, d]``, weight ``[d, k]``, state ``[b, d, k]`` or None -> ``(y [b, l, d], state [b, d, k])``."""
    b, l, d = x.shape
    k = weight.shape[-1]
    dtype = np.result_type(x, weight, *(() if bias is None else (bias,)))
    if state is None:
        history = np.zeros((b, k - 1, d), dtype=x.dtype)
    else:
        history = np.swapaxes(state[:, :, 1:], 1, 2).astype(x.dtype, copy=False)  # [b, k-1, d]
    padded = np.concatenate([history, x], axis=1)  # [b, k-1+l, d]
    taps = np.ascontiguousarray(weight.T)  # [k, d]
    y = np.empty((b, l, d), dtype=dtype)
    scratch = np.empty((b, min(CONV_TILE_STEPS, l), d), dtype=dtype)
    for start in range(0, l, CONV_TILE_STEPS):
        stop = min(start + CONV_TILE_STEPS, l)
        out, term = y[:, start:stop], scratch[:, :stop - start]
        np.multiply(padded[:, start:stop], taps[0], out=out)
        for j in range(1, k):
            np.multiply(padded[:, start + j:stop + j], taps[j], out=term)
            out += term
        if bias is not None:
            out += bias
    return y, np.swapaxes(padded[:, l - 1:], 1, 2)  # last k inputs, [b, d, k]


def pass_states(state: np.ndarray, chunk_decay: np.ndarray, Bt: np.ndarray, X: np.ndarray,
                C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """In-place version of ``portable_ssm.ssd.pass_states_ref``: each chunk's ``C_c S_in[c]`` is
    written straight into one output array and the state is updated in place (in a copy: the
    caller's state is never modified), so no per-chunk temporaries or final stack are allocated
    (about 10% of a 130m layer's forward at l=2048). Shapes as the reference: state
    ``[b, g, n, r, p]``, chunk_decay ``[b, c, g, 1, r, 1]``, Bt ``[b, c, g, n, Q]``, X ``[b, c, g, Q, r·p]``,
    C ``[b, c, g, Q, n]`` -> ``(outputs [b, c, g, Q, r·p], final state [b, g, n, r, p])``."""
    b, g, n, r, p = state.shape
    c, Q = C.shape[1], C.shape[3]
    dtype = np.result_type(state, chunk_decay, Bt, X, C)
    outputs = np.empty((b, c, g, Q, r * p), dtype=dtype)
    final = np.array(state, dtype=dtype, order="C")  # [b, g, n, r, p], updated in place
    flat = final.reshape(b, g, n, r * p)  # a view of it
    added = np.empty((b, g, n, r * p), dtype=dtype)
    for i in range(c):
        np.matmul(C[:, i], flat, out=outputs[:, i])  # the state entering chunk i, read by its C
        np.matmul(Bt[:, i], X[:, i], out=added)  # what chunk i adds
        final *= chunk_decay[:, i]
        flat += added
    return outputs, final


FAST_OPS: dict[str, Any] = {"causal_conv1d": causal_conv1d, "pass_states": pass_states}
