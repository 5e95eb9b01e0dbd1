"""Model parameters: their names and shapes, mamba_ssm's initialisation, and checks at the door.

Parameters are a flat ``dict[str, array]`` keyed by the state-spaces checkpoint names without the
``backbone.`` prefix: ``layers.{i}.mixer.in_proj.weight``, ``layers.{i}.norm.weight``,
``norm_f.weight`` and, with a vocabulary, ``embedding.weight`` and ``lm_head.weight``.

Dtype rule: every parameter has one floating dtype, and ``forward`` wants x in that dtype too
(a TypeError says so otherwise); convert with :func:`cast_params` rather than mixing silently.
"""

from __future__ import annotations

import math
from typing import Any

from ._array import Array, Namespace, array_backend, dtype_name, namespace
from ._checks import check_dtype_name, check_floating, check_int
from .backends import load, to_backend
from .config import Mamba2Config, check_config

Params = dict[str, Array]


#: Every name a layer's mixer parameter can have, after ``layers.{i}.mixer.`` (:func:`param_shapes`
#: gives the ones a config has).
MIXER_LEAVES = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                "norm.weight", "out_proj.weight", "out_proj.bias")


def param_shapes(config: Mamba2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name with its shape, in checkpoint order. With ``D_has_hdim`` D is
    ``[nheads, headdim]`` (mamba_ssm stores it flat, ``[nheads·headdim]``; the loader reshapes it);
    ``rmsnorm=False`` has no ``mixer.norm.weight``; with ``d_ssm`` the conv, Δ, A, D and the norm
    cover the SSM channels only while in_proj / out_proj keep d_inner's width."""
    check_config(config)
    c = config
    shapes: dict[str, tuple[int, ...]] = {}
    if c.vocab_size is not None:
        shapes["embedding.weight"] = (c.padded_vocab_size, c.d_model)
    for i in range(c.n_layer):
        m = f"layers.{i}.mixer."
        shapes[m + "in_proj.weight"] = (c.d_in_proj, c.d_model)
        if c.bias:
            shapes[m + "in_proj.bias"] = (c.d_in_proj,)
        shapes[m + "conv1d.weight"] = (c.conv_dim, 1, c.d_conv)
        if c.conv_bias:
            shapes[m + "conv1d.bias"] = (c.conv_dim,)
        shapes[m + "dt_bias"] = (c.nheads,)
        shapes[m + "A_log"] = (c.nheads,)
        shapes[m + "D"] = (c.nheads, c.headdim) if c.D_has_hdim else (c.nheads,)
        if c.rmsnorm:
            shapes[m + "norm.weight"] = (c.ssm_dim,)  # the gated norm runs on the SSM channels only
        shapes[m + "out_proj.weight"] = (c.d_model, c.d_inner)
        if c.bias:
            shapes[m + "out_proj.bias"] = (c.d_model,)
        shapes[f"layers.{i}.norm.weight"] = (c.d_model,)
    shapes["norm_f.weight"] = (c.d_model,)
    if c.vocab_size is not None and not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.padded_vocab_size, c.d_model)
    return shapes


def init_params(config: Mamba2Config, *, seed: int = 0, backend: str = "numpy", dtype: str = "float32",
                device: Any = None) -> Params:
    """Fresh parameters initialised as mamba_ssm does, identical on every backend for one seed.

    Linear and conv weights: PyTorch's default ``U(±1/sqrt(fan_in))``; out_proj further divided by
    ``sqrt(n_layer)`` (rescale_prenorm_residual); ``dt_bias = softplus⁻¹(dt)`` with
    ``dt ~ exp(U(log dt_min, log dt_max))`` floored at dt_init_floor; ``A_log = log U(A_init_range)``;
    D, norm weights 1; biases 0; embedding ``N(0, initializer_range²)``.
    """
    check_config(config)
    check_int("seed", seed, minimum=0)
    load(backend)
    check_dtype_name("dtype", dtype)
    host = load("numpy")
    np_xp, rng = host.namespace(), host.rng(seed)
    out = {}
    for name, shape in param_shapes(config).items():
        out[name] = _init_one(name, shape, config, rng, xp=np_xp)
    return {k: to_backend(v, backend, device=device, dtype=dtype) for k, v in out.items()}


def _uniform_fan_in(rng: Any, shape: tuple[int, ...], fan_in: int) -> Any:
    bound = 1.0 / math.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape)


def _init_one(name: str, shape: tuple[int, ...], c: Mamba2Config, rng: Any, *, xp: Namespace) -> Array:
    leaf = name.split("mixer.")[-1]
    if leaf in ("in_proj.weight", "out_proj.weight", "embedding.weight", "lm_head.weight"):
        if leaf == "embedding.weight":
            return rng.normal(0.0, c.initializer_range, size=shape)
        w = _uniform_fan_in(rng, shape, shape[1])
        if leaf == "out_proj.weight" and c.rescale_prenorm_residual:
            w = w / math.sqrt(c.n_layer)
        return w
    if leaf == "conv1d.weight":
        return _uniform_fan_in(rng, shape, shape[1] * shape[2])
    if leaf == "conv1d.bias":
        return _uniform_fan_in(rng, shape, c.d_conv)
    if leaf == "dt_bias":
        log_lo, log_hi = math.log(c.dt_min), math.log(c.dt_max)
        dt = xp.maximum(xp.exp(rng.uniform(log_lo, log_hi, size=shape)), c.dt_init_floor)
        return dt + xp.log(-xp.expm1(-dt))  # inverse softplus
    if leaf == "A_log":
        return xp.log(rng.uniform(*c.A_init_range, size=shape))
    if leaf.endswith(".bias"):
        return xp.zeros(shape)
    return xp.ones(shape)  # D, norm weights


def check_params(params: Any, config: Mamba2Config) -> Namespace:
    """Validates a parameter dict against ``config``: every key present with its shape, no extra
    keys, one backend, one floating dtype. Returns the namespace. ValueError/TypeError name the key."""
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of arrays, got {type(params).__name__}")
    expected = param_shapes(config)
    missing = [k for k in expected if k not in params]
    if missing:
        raise ValueError(f"params: missing {len(missing)} parameter(s) for this config, e.g. "
                         f"{', '.join(missing[:3])}")
    extra = sorted(set(params) - set(expected))
    if extra:
        raise ValueError(f"params: unexpected parameter(s) for this config: {', '.join(extra[:5])}")
    first = next(iter(expected))
    xp = namespace(**{first: params[first]})
    for key, shape in expected.items():
        value = params[key]
        namespace(**{first: params[first], key: value})
        check_floating(key, value, xp=xp)
        if tuple(value.shape) != shape:
            raise ValueError(f"params[{key!r}]: expected shape {list(shape)} for this config, "
                             f"got {tuple(value.shape)}")
        if value.dtype != params[first].dtype:
            raise TypeError(f"params[{key!r}] is {dtype_name(value.dtype)} but params[{first!r}] is "
                            f"{dtype_name(params[first].dtype)}; use one dtype (portable_ssm.cast_params)")
    return xp


def cast_params(params: Params, dtype: str, *, backend: str | None = None, device: Any = None) -> Params:
    """A copy of ``params`` in ``dtype`` (by name), optionally on another backend / device."""
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of arrays, got {type(params).__name__}")
    check_dtype_name("dtype", dtype)
    if backend is not None:
        load(backend)
    return {k: to_backend(v, backend or array_backend(v), device=device, dtype=dtype)
            for k, v in params.items()}
