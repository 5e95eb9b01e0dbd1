"""NumPy's batch-1 decode step of the hybrid stack: one token through every block of a Granite-4.0-H,
Bamba, Nemotron-H or Falcon-H1 model (their MoE variants included) in one call of the compiled library
(``portable_ssm_decode_hybrid``: ``decode_hybrid_run`` of ``backends/cpu/decode_hybrid.h``), one
OpenMP parallel region, where the array-API step (:func:`portable_ssm.stack.run_layers`) makes a
few dozen NumPy calls a layer and rewrites every KV cache per token.

- :func:`plan`: a model's arrays checked and gathered into the library's tables, ValueError naming
  the first array or setting the kernel does not compute (Zamba2's shared blocks,
  mamba_ssm's attention conv and inner MLP, a Mamba gated MLP, GELU MLPs: the reference runs);
- :func:`decode_hybrid_hook`: the backend's ``decode_hybrid`` fast op (``HybridLM.step``).

KV caches are written in place: the new token's key and value land in the slot the state's
``positions.length`` names, which no earlier state reads (a state sees its valid slots only). A
buffer is written in place only where this module made it and no state made from it holds that
slot yet (each buffer's frontier: the next slot free); otherwise (the prefill's caches, a second
step from one state) the step writes into a copy, so every state returned stays what it was.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_ssm.blocks.attention import KVCache
from portable_ssm.blocks.mlp import MLPSpec
from portable_ssm.blocks.moe import MoESpec
from portable_ssm.stack import HybridConfig, HybridState

from . import kernels
from .decode import (
    BYTES_PER_THREAD,
    LastPlan,
    _address,
    _float32,
    _weight,
    addresses_of,
    fresh_states,
    head_row,
    made_addresses,
    mamba_row,
)
from .threads import workers

#: The MLP activations the kernel computes, by its number.
ACTIVATIONS = {"silu": 0, "relu2": 1}
#: Entries of the tables: the header's sizes; per Mamba layer, attention layer, MLP, MoE and block.
_HEADER, _MAMBA, _ATTN, _MLP, _MOE, _BLOCK = 10, 8, 11, 5, 6, 4
_HEAD_POINTERS, _MAMBA_POINTERS, _ATTN_POINTERS = 5, 15, 15
#: Per-call entries: a Mamba layer's state pointers (conv, ssm, new conv, new ssm), an attention
#: layer's cache pointers (keys, values, valid) and sizes (m, slot, position).
_MAMBA_SLOTS, _ATTN_SLOTS, _ATTN_SIZES = np.array((1, 8, 9, 10)), np.array((12, 13, 14)), np.array((3, 4, 6))


@dataclass(frozen=True)
class HybridPlan:
    """A hybrid model's arrays as the library reads them: the tables (per-call entries 0), where
    each Mamba layer's and attention layer's per-call entries sit, the states' shapes, and the
    arrays themselves (kept alive)."""

    sizes: np.ndarray
    pointers: np.ndarray
    reals: np.ndarray
    mamba_at: np.ndarray  # [mamba layers]: each one's first pointer
    attn_at: np.ndarray  # [attention layers, 2]: each one's first size and first pointer
    conv_shapes: tuple[tuple[int, ...], ...]
    ssm_shapes: tuple[tuple[int, ...], ...]
    kv_shape: tuple[int, int]  # (kv heads, head_dim)
    d_model: int
    vocab: int
    arrays: tuple[Any, ...]
    weight_bytes: int = 0  # the weights a step reads (of a MoE block's experts, the k chosen)


def _refuse(config: HybridConfig) -> None:
    """ValueError naming the first setting of ``config`` the kernel does not compute."""
    c = config
    for i, (mix, ffn) in enumerate(c.layers):
        if mix == "shared":
            raise ValueError(f"decode_hybrid: layer {i} is ({mix!r}, {ffn!r}); the kernel runs mamba, attention, "
                             "parallel, mlp and moe blocks")
    m = c.mamba
    if m is not None and m.d_mlp:
        raise ValueError(f"decode_hybrid: the Mamba layers must have no gated MLP, got d_mlp={m.d_mlp}")
    a = c.attention
    if a is not None and (a.conv or a.mlp):
        raise ValueError(f"decode_hybrid: attention with a conv or inner MLP runs the reference, got conv={a.conv}, "
                         f"mlp={a.mlp}")
    for name, spec in (("MLP", c.mlp), ("MoE experts'", None if c.moe is None else c.moe.mlp)):
        if spec is not None and spec.act not in ACTIVATIONS:
            raise ValueError(f"decode_hybrid: {name} activation must be one of {sorted(ACTIVATIONS)}, got {spec.act!r}")


def _bias(params: dict[str, Any], name: str, width: int) -> np.ndarray | None:
    value = params.get(name)
    return None if value is None else _float32(value, name, (width,))


def _attention_rows(params: dict[str, Any], prefix: str, config: HybridConfig) -> tuple[list[Any], list[int]]:
    """An attention layer's 15 table entries (its cache's three None) and 11 sizes (per-call ones 0)."""
    a, d = config.attention, config.d_model
    widths = {"q": a.n_heads * a.head_dim, "k": a.n_kv_heads * a.head_dim, "v": a.n_kv_heads * a.head_dim}
    row, kinds = [], []
    for n, width in widths.items():
        data, kind, scale = _weight(params.get(f"{prefix}{n}_proj.weight"), f"{prefix}{n}_proj.weight", (width, d))
        row += [data, scale, _bias(params, f"{prefix}{n}_proj.bias", width)]
        kinds.append(kind)
    data, kind, scale = _weight(params.get(f"{prefix}o_proj.weight"), f"{prefix}o_proj.weight", (d, widths["q"]))
    row += [data, scale, _bias(params, f"{prefix}o_proj.bias", d), None, None, None]
    return row, [a.n_heads, a.n_kv_heads, a.head_dim, 0, 0, a.rotary_dim, 0, *kinds, kind]


def _mlp_rows(params: dict[str, Any], prefix: str, f: int, spec: MLPSpec, d: int,
              stack: tuple[int, ...] = ()) -> tuple[list[Any], list[int]]:
    """An MLP's 4 table entries and 5 sizes (hidden width ``f``); ``stack = (E,)``: a MoE block's
    experts, their weights stacks ``[E, 2f or f, d]`` and ``[E, d, f]``."""
    up, up_kind, up_scale = _weight(params.get(prefix + "up.weight"), prefix + "up.weight",
                                    (*stack, (2 if spec.gated else 1) * f, d))
    down, down_kind, down_scale = _weight(params.get(prefix + "down.weight"), prefix + "down.weight",
                                          (*stack, d, f))
    return [up, up_scale, down, down_scale], [f, ACTIVATIONS[spec.act], int(spec.gated), up_kind, down_kind]


def _router_rows(params: dict[str, Any], prefix: str, spec: MoESpec, d: int, experts: int,
                 shared: int) -> tuple[list[Any], list[int]]:
    """A MoE block's 2 table entries (its float32 router ``[E, d]`` and choice bias ``[E]`` or None)
    and 6 sizes, ``experts`` and ``shared`` its experts' and shared expert's MLP entries (-1: none)."""
    e = spec.experts
    router = _float32(params.get(prefix + "router.weight"), prefix + "router.weight", (e, d))
    sizes = [e, spec.top_k, int(spec.router == "sigmoid"), int(spec.normalize), experts, shared]
    return [router, _bias(params, prefix + "router.bias", e)], sizes


def plan(params: dict[str, Any], config: HybridConfig) -> HybridPlan:
    """``params`` of the hybrid ``config`` checked and gathered for the library's step. ValueError
    naming the first array or setting that does not fit."""
    _refuse(config)
    c, d = config, config.d_model
    m = c.mamba_step if c.mamba_step is not None else c.mamba
    g, p = (m.ngroups, m.headdim) if m is not None else (1, 1)
    widths = {"mamba": _MAMBA, "attn": _ATTN, "mlp": _MLP, "moe": _MOE, "block": _BLOCK}
    parts: dict[str, tuple[list[Any], list[int]]] = {part: ([], []) for part in widths}
    convs, ssms, multipliers, scales, moe_scales = [], [], [], [], []
    unread = 0  # bytes of the experts a step does not choose

    def add(part: str, row: list[Any], sizes: list[int]) -> int:
        rows, all_sizes = parts[part]
        rows += row
        all_sizes += sizes
        return len(all_sizes) // widths[part] - 1

    for i, (mix, ffn) in enumerate(c.layers):
        for kind, norm_name in ((mix, "mixer_norm"), (ffn, "ffn_norm")):
            if kind is None:
                continue
            norm = _float32(params.get(f"layers.{i}.{norm_name}.weight"), f"layers.{i}.{norm_name}.weight", (d,))
            at = [-1, -1, -1, -1]  # the block's Mamba, attention, MLP and MoE entries
            if kind in ("mamba", "parallel"):
                prefix = f"layers.{i}.mixer." + ("mamba." if kind == "parallel" else "")
                row, sizes, conv, ssm = mamba_row(params, prefix, norm, d, g, p, gate_norm=m.rmsnorm,
                                                  norm_before_gate=m.rmsnorm and m.norm_before_gate)
                at[0] = add("mamba", row, sizes)
                convs.append(conv)
                ssms.append(ssm)
            if kind in ("attention", "parallel"):
                prefix = f"layers.{i}.mixer." + ("attention." if kind == "parallel" else "")
                at[1] = add("attn", *_attention_rows(params, prefix, c))
                scales += [c.attention.scale, c.attention.rope_theta]
            if kind == "mlp":
                at[2] = add("mlp", *_mlp_rows(params, f"layers.{i}.ffn.", c.d_ff, c.mlp, d))
            if kind == "moe":
                prefix, e = f"layers.{i}.ffn.", c.moe.experts
                row, sizes = _mlp_rows(params, prefix + "experts.", c.d_expert, c.moe.mlp, d, (e,))
                unread += sum(a.nbytes for a in row if a is not None) * (e - c.moe.top_k) // e
                experts = add("mlp", row, sizes)
                shared = add("mlp", *_mlp_rows(params, prefix + "shared.", c.d_shared or c.d_ff, c.mlp, d)) \
                    if c.shared_expert else -1
                at[3] = add("moe", *_router_rows(params, prefix, c.moe, d, experts, shared))
                moe_scales.append(c.moe.scale)
            add("block", [norm], at)
            multipliers.append(c.residual_multiplier)
    norm_f, head, head_kind, head_scale = head_row(
        params, params.get("embedding.weight") if c.tie_embeddings else params.get("lm_head.weight"), d)
    order = ("mamba", "attn", "mlp", "moe", "block")  # the tables' order
    counts = [len(parts[k][1]) // widths[k] for k in ("block", *order[:-1])]
    rows = [a for k in order for a in parts[k][0]]
    sizes = [*counts, d, g, p, head.shape[0], head_kind, *(n for k in order for n in parts[k][1])]
    arrays = tuple(a for a in (*rows, norm_f, head, head_scale) if a is not None)
    low, high = m.dt_limit if m is not None else (0.0, float("inf"))
    n_mamba, n_attn = counts[1], counts[2]
    first_attn = _HEAD_POINTERS + _MAMBA_POINTERS * n_mamba
    return HybridPlan(
        np.array(sizes, dtype=np.int64),
        np.array([0, norm_f.ctypes.data, head.ctypes.data, _address(head_scale), 0, *map(_address, rows)],
                 dtype=np.uintp),
        np.array([c.norm_eps, c.norm_eps if m is None else m.norm_eps, low, high, *scales, *multipliers,
                  *moe_scales], dtype=np.float64),
        _HEAD_POINTERS + _MAMBA_POINTERS * np.arange(n_mamba),
        np.stack([_HEADER + _MAMBA * n_mamba + _ATTN * np.arange(n_attn),
                  first_attn + _ATTN_POINTERS * np.arange(n_attn)], axis=1),
        tuple(convs), tuple(ssms), (c.attention.n_kv_heads, c.attention.head_dim) if n_attn else (0, 0), d,
        head.shape[0], arrays, sum(a.nbytes for a in arrays) - unread)


#: Each KV buffer this module made, by its memory (data address, bytes): (a weak reference to it,
#: its frontier: the first slot no state made from it holds). By memory, not by object, so a new
#: view of the same buffer (the torch backend's NumPy view of a tensor it handed out) is the same
#: buffer; the weak reference says the memory is still that buffer's. Entries leave with them.
_FRONTIER: dict[tuple[int, int], tuple[weakref.ref, int]] = {}
_FRONTIER_LOCK = threading.Lock()


def _forget(key: tuple[int, int], ref: weakref.ref) -> None:
    """The entry of the buffer behind ``ref`` (just freed) dropped, unless another holds ``key``."""
    known = _FRONTIER.get(key)
    if known is not None and known[0] is ref:
        _FRONTIER.pop(key, None)


def _writable(cache: np.ndarray, slot: int) -> np.ndarray:
    """``cache [1, kv, m, hd]`` itself where it is (a contiguous, writeable view of) a buffer this
    module made whose frontier is ``slot`` (no state holds that slot: it may be written in place),
    else a copy of it; either way that buffer's frontier becomes ``slot + 1``."""
    key = (cache.ctypes.data, cache.nbytes)
    with _FRONTIER_LOCK:  # two threads stepping one state: one of them writes into a copy
        known = _FRONTIER.get(key)
        if (known is not None and known[1] == slot and known[0]() is not None and cache.flags.c_contiguous
                and cache.flags.writeable):
            _FRONTIER[key] = (known[0], slot + 1)
            return cache
        out = np.array(cache, order="C")
        key = (out.ctypes.data, out.nbytes)
        _FRONTIER[key] = (weakref.ref(out, lambda ref, key=key: _forget(key, ref)), slot + 1)
    return out


#: :func:`plan`, remembered for the params :func:`decode_hybrid_hook` last stepped.
known_plan = LastPlan(plan)


def _shaped(a: Any, dtype: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape


def decode_hybrid_hook(x: Any, state: HybridState, positions: Any, params: dict[str, Any],
                       config: HybridConfig, plans: Callable[[dict[str, Any], HybridConfig], HybridPlan | None]
                       | None = None) -> tuple[np.ndarray, HybridState] | None:
    """The ``decode_hybrid`` fast op: one token ``x [1, d_model]`` (embedded, float32) after
    ``state`` through the whole stack, ``positions`` the state's slot bookkeeping after this token
    (:func:`portable_ssm.blocks.attention.advance`): ``(logits [1, rows] before logits_scaling,
    new state)``. None (the array-API step runs) where the kernels are off, the model is not one
    :func:`plan` takes, or the state's arrays are not batch-1 float32 arrays of its shapes.
    ``plans``: where the plan of ``params`` comes from (None: :data:`known_plan`; the torch
    backend's plans NumPy views of its tensors)."""
    if kernels.library() is None or not isinstance(state, HybridState):
        return None
    model = (known_plan if plans is None else plans)(params, config)
    m = state.max_len
    old, new = state.positions, positions
    if (model is None or len(state.conv) != len(model.conv_shapes) or len(state.ssm) != len(model.ssm_shapes)
            or len(state.kv) != len(model.attn_at)):
        return None
    kv_shape = (1, model.kv_shape[0], m, model.kv_shape[1])
    olds = made_addresses(state.conv, state.ssm, model.conv_shapes, model.ssm_shapes)  # [mamba layers, 2]
    held: tuple[list[np.ndarray], ...] = ()  # contiguous copies the kernel reads: alive until it returns
    if olds is None:
        if not all(_shaped(a, np.float32, s) for a, s in (*zip(state.conv, model.conv_shapes),
                                                          *zip(state.ssm, model.ssm_shapes))):
            return None
        held = tuple([a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in group]
                     for group in (state.conv, state.ssm))
        olds = np.stack([addresses_of(group) for group in held], axis=1)  # [mamba layers, 2]
    if not (_shaped(x, np.float32, (1, model.d_model))
            and all(kv.conv is None and _shaped(kv.k, np.float32, kv_shape) and _shaped(kv.v, np.float32, kv_shape)
                    for kv in state.kv)
            and _shaped(new.valid, np.bool_, (1, m)) and _shaped(old.length, np.int64, (1,))
            and _shaped(old.seen, np.int64, (1,))):
        return None
    slot, position = int(old.length[0]), int(old.seen[0])
    caches = [KVCache(_writable(kv.k, slot), _writable(kv.v, slot)) for kv in state.kv]
    valid = np.ascontiguousarray(new.valid)
    convs, ssms, fresh = fresh_states(model.conv_shapes, model.ssm_shapes)
    logits = np.empty((1, model.vocab), dtype=np.float32)
    sizes, pointers = model.sizes.copy(), model.pointers.copy()
    x = np.ascontiguousarray(x)
    pointers[0], pointers[4] = x.ctypes.data, logits.ctypes.data
    pointers[model.mamba_at[:, None] + _MAMBA_SLOTS] = np.concatenate([olds, fresh], axis=1)
    for (size_at, at), cache in zip(model.attn_at, caches):
        pointers[at + _ATTN_SLOTS] = [cache.k.ctypes.data, cache.v.ctypes.data, valid.ctypes.data]
        sizes[size_at + _ATTN_SIZES] = [m, slot, position]
    threads = max(1, min(workers(), model.weight_bytes // BYTES_PER_THREAD))
    kernels.library().portable_ssm_decode_hybrid(sizes.ctypes.data, pointers.ctypes.data, model.reals.ctypes.data,
                                                 threads)
    return logits, HybridState(tuple(convs), tuple(ssms), tuple(caches), positions)
