"""JAX: runs the core as written (no in-place ops, static shapes), on CPU, GPU or TPU."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from portable_ssm.quantized import QuantizedWeight


def namespace() -> Any:
    return jnp


def dtype(name: str) -> Any:
    if name == "float64" and not jax.config.jax_enable_x64:
        raise TypeError("dtype: float64 on jax needs jax.config.update('jax_enable_x64', True)")
    return getattr(jnp, name)


def _device(device: Any) -> Any:
    if device is None or not isinstance(device, str):
        return device
    platform, _, index = device.partition(":")
    return jax.devices(platform)[int(index or 0)]


def asarray(host: Any, dtype_name: str | None, device: Any) -> Any:
    out = jnp.asarray(np.asarray(host), dtype=None if dtype_name is None else dtype(dtype_name))
    return out if device is None else jax.device_put(out, _device(device))


def convert(x: Any, dtype_name: str | None, device: Any) -> Any:
    out = x if dtype_name is None else x.astype(dtype(dtype_name))
    return out if device is None else jax.device_put(out, _device(device))


def to_numpy(x: Any) -> np.ndarray:
    if x.dtype in (jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    return np.asarray(x)


def pass_states(state: Any, chunk_decay: Any, Bt: Any, X: Any, C: Any, inject: Any = None,
                carried: Any = None) -> tuple[Any, Any]:
    """``jax.lax.scan`` version of ``portable_ssm.ssd.pass_states_ref``: per chunk, the entering
    state read by C, then ``S_in[c+1] = chunk_decay[c] · S_in[c] + B_cᵀ X_c`` (``+ inject[c]``, and
    then the stack of those states comes back instead of the last; the first term selected out
    where ``carried[c]`` is False); traced once instead of unrolled per chunk."""
    b, g, n, r, p = state.shape

    def body(carry: Any, chunk: dict[str, Any]) -> tuple[Any, Any]:
        out = jnp.matmul(chunk["C"], jnp.reshape(carry, (b, g, n, r * p)))  # [b, g, Q, r·p]
        added = jnp.reshape(jnp.matmul(chunk["Bt"], chunk["X"]), carry.shape)  # [b, g, n, r·p] -> [b, g, n, r, p]
        kept = chunk["decay"] * carry
        if "carried" in chunk:  # the entering sequence ended in the chunk: its state is dropped
            kept = jnp.where(chunk["carried"], kept, jnp.zeros_like(kept))
        leaving = kept + added
        if "inject" not in chunk:
            return leaving, out
        leaving = leaving + chunk["inject"]
        return leaving, (out, leaving)

    inputs = {"decay": chunk_decay, "Bt": Bt, "X": X, "C": C, "inject": inject, "carried": carried}
    chunks = {k: jnp.moveaxis(v, 1, 0) for k, v in inputs.items() if v is not None}  # [b, c, ...] -> [c, b, ...]
    final, stacked = jax.lax.scan(body, state, chunks)
    if inject is None:
        return jnp.moveaxis(stacked, 0, 1), final  # [c, b, g, Q, r·p] -> [b, c, g, Q, r·p]
    return tuple(jnp.moveaxis(v, 0, 1) for v in stacked)  # outputs, states leaving each chunk [b, c, ...]


# Quantized weights pass through jax.jit and the other transforms as their arrays (data, scale),
# kind and dtype being static.
jax.tree_util.register_pytree_node(
    QuantizedWeight, lambda w: ((w.data, w.scale), (w.kind, w.dtype)),
    lambda static, arrays: QuantizedWeight(arrays[0], arrays[1], *static))


#: How often each function compiled by :func:`jit` was traced (once per new shape or structure).
TRACES: Counter[str] = Counter()


def jit(fn: Callable[..., Any], name: str, donate: tuple[int, ...] = ()) -> Callable[..., Any]:
    """``jax.jit(fn)``, counting its traces under ``name`` in :data:`TRACES` (generation's decode
    step); the positional arguments in ``donate`` give their buffers to the outputs (a decode step's
    state: XLA updates it where it lies instead of allocating a new one per token)."""

    def traced(*args: Any) -> Any:
        TRACES[name] += 1
        return fn(*args)

    return jax.jit(traced, donate_argnums=donate)


FAST_OPS: dict[str, Any] = {"pass_states": pass_states, "jit": jit}
