"""The Mamba-2 stack: pre-norm residual blocks then ``norm_f`` (MAMBA2_SPEC.md, "Block and stack").

``forward`` runs a whole sequence with the chunked scan; ``step`` runs one token with the
recurrence. Both return the per-layer ``Mamba2State`` (conv and SSM states), so a sequence can
be split anywhere: ``forward`` on the second half from the first half's state equals the whole.
With ``seq_idx`` one row holds several sequences back to back (see ``collate(mode="pack")``), each
computed as if alone; with ``cu_seqlens`` (a batch-1 row, :mod:`portable_ssm.varlen`) each of them
also has its own state in and out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

from ._array import Array, Namespace, array_backend, compute_dtype, device, dtype_name, namespace
from ._checks import Shapes, check_bool, check_floating, check_given, check_int, check_same_device, check_same_dtype
from .backends import to_backend
from .config import Mamba2Config, check_config, default_config
from .mixer import mixer, mixer_step
from .norm import rms_norm
from .padding import padded_layer
from .params import MIXER_LEAVES, Params, check_params, init_params
from .ssm_inputs import check_seq_idx, sequence_runs
from .state import Mamba2State
from .state_pool import check_state_batch_indices, gather_state, scatter_state
from .varlen import check_cu_seqlens


def empty_state(config: Mamba2Config, batch: int, like: Array) -> Mamba2State:
    """Zero state for ``batch`` sequences, on ``like``'s backend and device, for x of ``like``'s dtype."""
    check_config(config)
    check_int("batch", batch, minimum=1)
    check_given(like=like)
    xp = namespace(like=like)
    check_floating("like", like, xp=xp)
    c = config
    conv = xp.zeros((batch, c.conv_dim, c.d_conv), dtype=like.dtype, device=device(like))
    ssm = xp.zeros((batch, c.nheads, c.headdim, c.d_state), dtype=compute_dtype(xp, like.dtype),
                   device=device(like))
    return Mamba2State(conv=(conv,) * c.n_layer, ssm=(ssm,) * c.n_layer)


def check_backends(x_name: str, x: Array, params: Params, state: Any = None, state_name: str = "state") -> Namespace:
    """The namespace of ``x``, after checking that ``x``, the (already checked) params and the
    state's arrays come from one library: a TypeError naming both sides, before any of them is
    touched (a NumPy x with torch params would fail deep inside array_api_compat otherwise)."""
    first = next(iter(params))
    arrays = {x_name: x, f"params[{first!r}]": params[first]}
    if isinstance(state, Mamba2State):
        arrays.update({f"{state_name}.{kind}[{i}]": a for kind, layers in (("conv", state.conv), ("ssm", state.ssm))
                       for i, a in enumerate(layers)})
    return namespace(**arrays)


def _check_state(state: Any, config: Mamba2Config, x: Array, shapes: Shapes, name: str, *,
                 xp: Namespace, batch: str = "b") -> None:
    """Checks a :class:`Mamba2State` against x: layers, shapes (``batch`` rows: "b", or "s" for one
    state per packed sequence), dtypes, devices and backend."""
    if not isinstance(state, Mamba2State):
        raise TypeError(f"{name}: expected a Mamba2State (from forward(..., return_state=True) or "
                        f"empty_state), got {type(state).__name__}")
    c = config
    for kind, arrays, spec in (("conv", state.conv, (batch, c.conv_dim, c.d_conv)),
                               ("ssm", state.ssm, (batch, c.nheads, c.headdim, c.d_state))):
        if len(arrays) != c.n_layer:
            raise ValueError(f"{name}.{kind}: expected {c.n_layer} layers (config.n_layer), "
                             f"got {len(arrays)}")
        for i, a in enumerate(arrays):
            label = f"{name}.{kind}[{i}]"
            namespace(x=x, **{label: a})
            check_floating(label, a, xp=xp)
            shapes.check(label, a, spec)
            check_same_device(label, a, "x", x)
            want = x.dtype if kind == "conv" else compute_dtype(xp, x.dtype)
            if a.dtype != want:
                raise TypeError(f"{label} is {dtype_name(a.dtype)}, expected {dtype_name(want)} "
                                f"for x of dtype {dtype_name(x.dtype)}")


_CACHE: OrderedDict[tuple, tuple[Any, Params]] = OrderedDict()
_CACHE_SIZE = 4


def _cached(key: tuple, keep: Any, build: Any) -> Params:
    """A small LRU: ``keep`` is held with the entry so the ids in ``key`` stay valid."""
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key][1]
    value = build()
    _CACHE[key] = (keep, value)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


def _resolve(x: Array, params: Params | None, config: Mamba2Config | None, backend: str | None,
             device_: Any, **indices: Array | None) -> tuple[Array, Params, Mamba2Config, dict[str, Array | None]]:
    """Moves x (and the integer ``indices``: seq_idx, cu_seqlens) to ``backend``/``device_`` and
    builds (``params=None``) or converts params to match."""
    if backend is not None or device_ is not None:
        x = to_backend(x, backend or array_backend(x), device=device_)
    namespace(x=x)
    target, dev, dt = array_backend(x), device(x), dtype_name(x.dtype)
    if backend is not None or device_ is not None:
        for name, value in indices.items():
            if value is not None:
                namespace(**{name: value})
                indices[name] = to_backend(value, target, device=dev)
    if params is None:
        if config is None:
            if getattr(x, "ndim", 0) != 3:
                raise ValueError(f"x: expected shape [b, l, d_model], got {tuple(x.shape)}")
            config = default_config(x.shape[-1])
        params = _cached(("init", config, target, str(dev), dt), None,
                         lambda: init_params(config, seed=0, backend=target, dtype=dt, device=dev))
        return x, params, config, indices
    if not isinstance(config, Mamba2Config):
        raise TypeError(f"config: expected the Mamba2Config the params were built for, got "
                        f"{type(config).__name__}")
    if backend is not None or device_ is not None:
        key = ("convert", tuple(id(v) for v in params.values()), target, str(dev))
        params = _cached(key, params, lambda: {k: to_backend(v, target, device=dev)
                                               for k, v in params.items()})
    return x, params, config, indices


def _check_x(x: Array, params: Params, config: Mamba2Config, spec: tuple[str, ...], *,
             xp: Namespace) -> Shapes:
    check_given(x=x)
    namespace(x=x)
    check_floating("x", x, xp=xp)
    shapes = Shapes(d_model=config.d_model)
    shapes.check("x", x, spec)
    first = next(iter(params))
    check_same_dtype(f"params[{first!r}]", params[first], "x", x)
    check_same_device(f"params[{first!r}]", params[first], "x", x)
    return shapes


def _sequence_mixer(seq_idx: Array | None, shapes: Shapes, ref_name: str, ref: Array, *, xp: Namespace,
                    layer: Callable[..., Any] | None = None, cu_seqlens: Array | None = None) -> Any:
    """The layer function for :func:`_blocks`: ``layer`` (None for ``mixer``, or a callable with
    its signature), given the run ids of ``seq_idx [b, l]`` once it is checked against ``ref``, or
    the :class:`~portable_ssm.varlen.Varlen` of ``cu_seqlens`` (binding ``s``, n_seq, in ``shapes``)."""
    if layer is None:
        layer = mixer
    elif not callable(layer):
        raise TypeError(f"layer: expected None or a callable with portable_ssm.mixer.mixer's signature, "
                        f"got {type(layer).__name__}")
    if cu_seqlens is not None:
        return partial(layer, varlen=check_cu_seqlens(cu_seqlens, seq_idx, shapes, ref_name, ref, xp=xp))
    if seq_idx is None:
        return layer
    check_seq_idx(seq_idx, shapes, ref_name, ref, xp=xp)
    return partial(layer, seq_idx=sequence_runs(seq_idx, xp=xp))


def _layer(params: Params, i: int) -> dict[str, Array]:
    """Layer ``i``'s mixer parameters, named without their ``layers.{i}.mixer.`` prefix (looked up by
    name: scanning every key for the prefix cost a 24-layer decode step several milliseconds)."""
    prefix = f"layers.{i}.mixer."
    return {leaf: params[prefix + leaf] for leaf in MIXER_LEAVES if prefix + leaf in params}


def _blocks(x: Array, params: Params, config: Mamba2Config, state: Mamba2State | None, run: Any, *,
            xp: Namespace, last_only: bool = False) -> tuple[Array, Mamba2State]:
    """Pre-norm residual blocks then norm_f; ``run`` is ``mixer`` or ``mixer_step``. ``last_only``
    (``run`` a mixer over ``x [b, l, d_model]``): the last layer gives only the last position's
    output (``mixer(last_only=True)``), so the result is ``[b, 1, d_model]``."""
    c = config
    res_dtype = compute_dtype(xp, x.dtype) if c.residual_in_fp32 else x.dtype
    residual, hidden = None, x
    convs, ssms = [], []
    for i in range(c.n_layer):
        added = xp.astype(hidden, res_dtype, copy=False)
        residual = added if residual is None else residual + added
        normed = rms_norm(residual, params[f"layers.{i}.norm.weight"], c.norm_eps, xp=xp)
        conv_i = None if state is None else state.conv[i]
        ssm_i = None if state is None else state.ssm[i]
        last = {"last_only": True} if last_only and i == c.n_layer - 1 else {}
        hidden, conv_i, ssm_i = run(normed, _layer(params, i), c, conv_i, ssm_i, xp=xp, **last)
        convs.append(conv_i)
        ssms.append(ssm_i)
    if last_only:
        residual = residual[:, -1:, :]  # [b, l, d_model] -> [b, 1, d_model], as the last layer's output
    out = rms_norm(residual + xp.astype(hidden, res_dtype, copy=False), params["norm_f.weight"], c.norm_eps, xp=xp)
    return out, Mamba2State(conv=tuple(convs), ssm=tuple(ssms))


def pool_blocks(x: Array, pool: Mamba2State, indices: Array, params: Params, config: Mamba2Config,
                ref_name: str, ref: Array, *, xp: Namespace) -> tuple[Array, Mamba2State]:
    """One token ``x [b, d_model]`` through the stack on the slots ``indices [b]`` of a state pool
    (checked here, against ``ref``): ``(y [b, d_model], the new pool)``."""
    _check_state(pool, config, x, Shapes(), "state", xp=xp)  # its own b: the pool's size
    check_state_batch_indices(indices, pool.ssm[0].shape[0], x.shape[0], ref_name, ref, xp=xp)
    y, rows = _blocks(x, params, config, gather_state(pool, indices, xp=xp), mixer_step, xp=xp)
    return y, scatter_state(pool, indices, rows, xp=xp)


#: Tokens taken through every layer at a time by :func:`run_sequence`, the states carried from
#: block to block: the same result, but each layer's intermediates stay small enough for the cache
#: (a 130m layer at l=8192 on NumPy: about 1.2x faster than one block, and 5% faster than blocks
#: of 1024, whose projections are smaller matrix multiplies).
BLOCK_TOKENS = 2048


def run_sequence(x: Array, params: Params, config: Mamba2Config, state: Mamba2State | None, run: Any, *,
                 xp: Namespace, last_only: bool = False) -> tuple[Array, Mamba2State]:
    """:func:`_blocks` over ``x [b, l, d_model]``, in blocks of BLOCK_TOKENS tokens when ``run`` is
    the plain mixer (packed ``seq_idx`` rows and wrapped layers run whole). ``last_only``: the
    last position's output alone, ``[b, 1, d_model]`` (:func:`_blocks`)."""
    l = x.shape[1]
    if run is not mixer or l <= BLOCK_TOKENS:
        return _blocks(x, params, config, state, run, xp=xp, last_only=last_only)
    outputs = []
    for start in range(0, l, BLOCK_TOKENS):  # with last_only each block's last position, of which the last is kept
        y, state = _blocks(x[:, start:min(start + BLOCK_TOKENS, l), :], params, config, state, run, xp=xp,
                           last_only=last_only)
        outputs.append(y)
    return outputs[-1] if last_only else xp.concat(outputs, axis=1), state  # [b, 1 or l, d_model]


def forward(x: Array, params: Params | None = None, *, config: Mamba2Config | None = None,
            backend: str | None = None, device: Any = None, initial_state: Mamba2State | None = None,
            return_state: bool = False, seq_idx: Array | None = None,
            layer: Callable[..., Any] | None = None, attention_mask: Array | None = None,
            cu_seqlens: Array | None = None) -> Array | tuple[Array, Mamba2State]:
    """The Mamba-2 backbone over a sequence: ``x [b, l, d_model] -> [b, l, d_model]``.

    Equal to transformers' ``Mamba2Model(inputs_embeds=x).last_hidden_state`` for the same weights.

    Args:
        x: input embeddings ``[b, l, d_model]``, any floating dtype; params must share it.
        params: a parameter dict (:func:`init_params`, :func:`load_params`); ``None`` builds the
            default model for ``config`` (or, without config, :func:`default_config` of x's width)
            with seed 0, cached.
        config: the :class:`Mamba2Config` the params belong to (required with params).
        backend: ``"numpy" | "torch" | "cupy" | "jax" | "array_api_strict"`` to convert x, the
            params and seq_idx to (converted params are cached); ``None`` keeps x's own library.
        device: target device (``"cpu"``, ``"cuda:0"``, ...), with or without ``backend``.
        initial_state: a :class:`Mamba2State` to continue from (e.g. the first half's); with
            ``seq_idx`` it feeds each row's first sequence only.
        return_state: also return the state after the last token (with ``seq_idx``: the state
            of each row's last sequence, ready for :func:`step` to continue it).
        seq_idx: optional ``[b, l]`` integer sequence ids, non-decreasing along l (mamba_ssm's
            packed rows): the conv window and the SSM state reset wherever the id changes, so a
            packed row gives what each of its sequences gives alone.
        layer: a stand-in for each layer's :func:`portable_ssm.mixer.mixer`, called with its
            arguments, e.g. ``partial(torch.utils.checkpoint.checkpoint, mixer, use_reentrant=False)``
            to recompute activations in backward. A stand-in sees the whole sequence (no token blocks).
        attention_mask: optional ``[b, l]`` left-padding mask on x's backend (1/True for tokens,
            0/False for padding, transformers' semantics): each row gives, at its tokens and in its
            state, what it gives alone without its padding (:mod:`portable_ssm.padding`; a mask
            with holes or right padding is a ValueError; not with seq_idx).
        cu_seqlens: optional ``[n_seq + 1]`` integer cumulative lengths of the sequences packed in
            a batch-1 x (0 first, l last, strictly increasing; vLLM's and mamba_ssm's varlen layout,
            :mod:`portable_ssm.varlen`): each sequence gives what it gives alone, initial_state
            then holds one state per sequence (batch n_seq) and the returned state does too, ready
            for :func:`step` on a batch of n_seq tokens. Not with seq_idx or attention_mask.

    Returns:
        ``y [b, l, d_model]`` in x's dtype, or ``(y, state)``.
    """
    check_bool("return_state", return_state)
    x, params, config, indices = _resolve(x, params, config, backend, device, seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    seq_idx, cu_seqlens = indices["seq_idx"], indices["cu_seqlens"]
    xp = check_params(params, config)
    check_backends("x", x, params, initial_state, "initial_state")
    shapes = _check_x(x, params, config, ("b", "l", "d_model"), xp=xp)
    run = _sequence_mixer(seq_idx, shapes, "x", x, xp=xp, layer=layer, cu_seqlens=cu_seqlens)
    run = padded_layer(run, attention_mask, seq_idx, shapes, "x", x, xp=xp, cu_seqlens=cu_seqlens)
    if initial_state is not None:
        _check_state(initial_state, config, x, shapes, "initial_state", xp=xp,
                     batch="b" if cu_seqlens is None else "s")
    y, state = run_sequence(x, params, config, initial_state, run, xp=xp)
    return (y, state) if return_state else y


def step(x_t: Array, state: Mamba2State | None, params: Params, *, config: Mamba2Config,
         state_batch_indices: Array | None = None) -> tuple[Array, Mamba2State]:
    """One token through the stack: ``x_t [b, d_model]`` -> ``(y_t [b, d_model], new_state)``.

    ``state`` comes from ``forward(..., return_state=True)``, a previous ``step`` or
    :func:`empty_state` (``None`` means zeros). The input state is not modified.
    With ``state_batch_indices [b]`` (distinct integers) ``state`` is a pool of ``[pool, ...]``
    states: row i reads and updates slot ``state_batch_indices[i]``, and the returned state is the
    whole new pool (:mod:`portable_ssm.state_pool`).
    """
    check_config(config)
    xp = check_params(params, config)
    check_backends("x_t", x_t, params, state)
    shapes = _check_x(x_t, params, config, ("b", "d_model"), xp=xp)
    if state_batch_indices is not None:
        return pool_blocks(x_t, state, state_batch_indices, params, config, "x_t", x_t, xp=xp)
    if state is None:
        state = empty_state(config, x_t.shape[0], x_t)
    _check_state(state, config, x_t, shapes, "state", xp=xp)
    return _blocks(x_t, params, config, state, mixer_step, xp=xp)
