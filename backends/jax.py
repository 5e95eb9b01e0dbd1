"""JAX: runs the core as written (no in-place ops, static shapes), on CPU, GPU or TPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


def pass_states(state: Any, decay: Any, S: Any) -> tuple[Any, Any]:
    """``jax.lax.scan`` version of ``portable_ssm.ssd.pass_states_ref``: the chunk recurrence
    ``S_in[c+1] = decay[c] · S_in[c] + S[c]`` traced once instead of unrolled per chunk."""

    def body(carry: Any, inputs: tuple[Any, Any]) -> tuple[Any, Any]:
        decay_c, S_c = inputs
        return decay_c * carry + S_c, carry

    final, entering = jax.lax.scan(body, state, (jnp.moveaxis(decay, 1, 0), jnp.moveaxis(S, 1, 0)))
    return jnp.moveaxis(entering, 0, 1), final  # [c, b, ...] -> [b, c, ...]


FAST_OPS: dict[str, Any] = {"pass_states": pass_states}
