"""The hybrid stack: a per-layer kind list drives one pre-norm residual stack over Mamba-2,
attention, MLP and MoE blocks, with one state holding every layer's conv, SSM and KV caches.

A layer is ``(mixer, ffn)``: mixer ``"mamba" | "attention" | "parallel" | None`` then ffn ``"mlp"
| "moe" | None``, each behind its own RMSNorm and residual add (``residual +
multiplier·block(norm(h))``); ``"parallel"`` (Falcon-H1) adds Mamba-2 and attention of one input;
``"shared"`` (Zamba2) runs a transformer block (attention on ``concat(h, embeddings)`` then an
MLP, its weights under ``layers.{i}.shared.``) whose output, through ``shared.linear``, is added
to the Mamba-2 layer's input (not to the residual).
Granite-4.0-H and Bamba layers are ``(mamba or attention, mlp or moe)``; Nemotron-H's are one
block each (``("mamba", None)``, ``(None, "mlp")``...). Parameters, in core names::

    embedding.weight [V, d]            layers.{i}.mixer_norm.weight [d]   layers.{i}.mixer.<leaf>
    norm_f.weight [d]                  layers.{i}.ffn_norm.weight [d]     layers.{i}.ffn.<leaf>
    lm_head.weight [V, d] (untied)

Mamba leaves are :mod:`portable_ssm.mixer`'s: one :class:`~portable_ssm.Mamba2Config` with
``n_layer=1`` describes every Mamba layer's SSM channels (its ``d_model`` is the SSM width and
``expand`` 1, so the width need not be a multiple of the stack's d_model; in_proj reads and
out_proj writes the stack's d_model), attention's ``q_proj/k_proj/v_proj/o_proj.weight``,
a parallel mixer's under ``mamba.`` and ``attention.``, an MLP's ``up/down.weight``, a MoE's
``router.weight``, ``experts.up/down.weight`` and, with a shared expert, ``shared.up/down.weight``.
The pure Mamba-2 model does not run through here: its stack (:mod:`portable_ssm.model`) keeps
its whole-model decode kernel.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._array import Array, Namespace, compute_dtype, device, is_traced
from .blocks.attention import (
    AttentionSpec,
    KVCache,
    Positions,
    advance,
    attention,
    empty_kv_cache,
    empty_positions,
    qkv_width,
)
from .blocks.mlp import MLPSpec, mlp
from .blocks.moe import MoESpec, moe
from .config import Mamba2Config
from .lm import embed
from .mixer import _linear, mixer, mixer_step
from .norm import rms_norm
from .params import param_shapes as mamba_shapes
from .state_pool import gather_rows, scatter_rows

MIXERS = ("mamba", "attention", "parallel", "shared", None)
FFNS = ("mlp", "moe", None)


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid model: the layer kinds, each block kind's spec, and the scalar multipliers."""

    d_model: int
    vocab_size: int
    layers: tuple[tuple[str | None, str | None], ...]  # (mixer, ffn) per layer
    mamba: Mamba2Config | None = None  # n_layer=1, d_model = SSM width, expand=1: every Mamba layer's shapes
    mamba_step: Mamba2Config | None = None  # the one-token step's, where it differs (Zamba2's dt clamp); None: mamba
    attention: AttentionSpec | None = None
    mlp: MLPSpec | None = None
    moe: MoESpec | None = None
    shared_expert: bool = False  # a MoE layer adds an MLP (the ``mlp`` spec) on the same input
    d_ff: int = 0  # f of the MLP (and shared expert)
    d_expert: int = 0  # f of each routed expert
    d_shared: int = 0  # f of the shared expert (0: d_ff)
    norm_eps: float = 1e-6
    embedding_multiplier: float = 1.0  # on the token embeddings
    residual_multiplier: float = 1.0  # on every block's output before the residual add
    logits_scaling: float = 1.0  # logits are divided by it
    tie_embeddings: bool = False
    family: str = "hybrid"  # the loader's name, for info

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(tuple(k) for k in self.layers))
        need = {"mamba": self.mamba, "attention": self.attention, "mlp": self.mlp, "moe": self.moe}
        for i, kinds in enumerate(self.layers):
            if len(kinds) != 2 or kinds[0] not in MIXERS or kinds[1] not in FFNS or kinds == (None, None):
                raise ValueError(f"HybridConfig.layers[{i}]: expected (mixer in {MIXERS}, ffn in {FFNS}), not both "
                                 f"None, got {kinds!r}")
            for kind in kinds:
                if kind in need and need[kind] is None:
                    raise ValueError(f"HybridConfig.{kind}: layer {i} is {kind!r}, so its spec is required")
        if self.shared_expert and self.mlp is None:
            raise ValueError("HybridConfig.mlp: shared_expert needs the shared MLP's spec")
        if self.mamba is not None and (self.mamba.n_layer != 1 or self.mamba.expand != 1 or self.mamba.d_mlp):
            raise ValueError(f"HybridConfig.mamba: expected n_layer=1, expand=1 (d_model = the SSM width) and no "
                             f"d_ssm, got n_layer={self.mamba.n_layer}, expand={self.mamba.expand}")
        needs = {"parallel": ("mamba", "attention"), "shared": ("mamba", "attention", "mlp")}
        for i, (mix, _) in enumerate(self.layers):
            for kind in needs.get(mix, ()):
                if need[kind] is None:
                    raise ValueError(f"HybridConfig.{kind}: layer {i} is {mix!r}, so its spec is required")

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    def indices(self, kind: str) -> tuple[int, ...]:
        """The layers that hold a ``kind`` ("mamba" or "attention") block, parallel ones included."""
        return tuple(i for i, (m, _) in enumerate(self.layers) if m in (kind, "parallel", "shared"))


class HybridState(NamedTuple):
    """Every layer's inference state: ``conv[j] [b, conv_dim, d_conv]``, ``ssm[j] [b, h, p, n]``
    for the j-th Mamba layer, ``kv[j]`` (:class:`~portable_ssm.blocks.KVCache`, ``[b, kv, m, hd]``,
    with an attention conv also its state ``[b, c, k]``) for the j-th attention layer, and the
    slots' bookkeeping the attention layers share."""

    conv: tuple[Array, ...]
    ssm: tuple[Array, ...]
    kv: tuple[KVCache, ...]
    positions: Positions

    @property
    def max_len(self) -> int:
        """Slots of each row's KV caches: the tokens each row (a pool slot: each request) can hold."""
        return self.positions.valid.shape[1]


def empty_hybrid_state(config: HybridConfig, batch: int, max_len: int, like: Array, *, xp: Namespace) -> HybridState:
    """Zero state for ``batch`` rows and ``max_len`` tokens, on ``like``'s device, for its dtype."""
    dev, dtype = device(like), like.dtype
    convs, ssms = (), ()
    c = config.mamba
    if c is not None:
        n = len(config.indices("mamba"))
        convs = (xp.zeros((batch, c.conv_dim, c.d_conv), dtype=dtype, device=dev),) * n
        ssms = (xp.zeros((batch, c.nheads, c.headdim, c.d_state), dtype=compute_dtype(xp, dtype), device=dev),) * n
    kv = () if config.attention is None else (
        (empty_kv_cache(config.attention, batch, max_len, like, xp=xp),) * len(config.indices("attention")))
    return HybridState(convs, ssms, kv, empty_positions(batch, max_len, like, xp=xp))


_GROUPS: OrderedDict[int, tuple[dict[str, Array], dict[str, dict[str, Array]]]] = OrderedDict()


def _layer_params(params: dict[str, Array], i: int, group: str) -> dict[str, Array]:
    """``layers.{i}.{group}.*`` named without the prefix: every layer's groups are split in one
    pass per params dict (kept for the last few dicts, with the dict itself so its id stays valid),
    so a decode step does not scan every name once per layer."""
    key = id(params)
    if key not in _GROUPS or _GROUPS[key][0] is not params:
        groups: dict[str, dict[str, Array]] = {}
        for name, value in params.items():
            parts = name.split(".", 3)
            if len(parts) == 4 and parts[0] == "layers":
                groups.setdefault(f"{parts[1]}.{parts[2]}", {})[parts[3]] = value
        _GROUPS[key] = (params, groups)
        if len(_GROUPS) > 4:
            _GROUPS.popitem(last=False)
    _GROUPS.move_to_end(key)
    return _GROUPS[key][1].get(f"{i}.{group}", {})


def _sub(params: dict[str, Array], prefix: str) -> dict[str, Array]:
    """The params under ``prefix``, named without it."""
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def _ffn(h: Array, p: dict[str, Array], kind: str, config: HybridConfig, *, xp: Namespace) -> Array:
    if kind == "mlp":
        return mlp(h, p, config.mlp, xp=xp)
    out = moe(h, p, config.moe, xp=xp)
    if config.shared_expert:
        out = out + mlp(h, _sub(p, "shared."), config.mlp, xp=xp)
    return out


def run_layers(x: Array, params: dict[str, Array], config: HybridConfig, state: HybridState, tokens: Array,
               pad: Array | None, *, xp: Namespace, one_token: bool = False,
               embeddings: Array | None = None, keep: int = 0) -> tuple[Array, HybridState]:
    """Every layer then ``norm_f`` over ``x [b, l, d_model]`` (``one_token``: ``x [b, d_model]``
    through the Mamba layers' one-token step): ``(hidden, new state)``. ``tokens [b, l]`` bool
    marks real tokens, ``pad [b]`` each row's left padding (None: none), both from the caller;
    ``embeddings`` (x's shape): the token embeddings a "shared" layer reads (default: x). ``keep``
    k > 0: only the last k positions' hidden states are returned, ``[b, k, d_model]``; the last
    layer's FFN runs on those alone (the state needs every position's mixer, no later layer needs
    its FFN's other outputs; llama.cpp's graphs cut the rows there too)."""
    positions, rope_pos = advance(state.positions, tokens, xp=xp)
    convs, ssms, kvs = list(state.conv), list(state.ssm), list(state.kv)
    mamba_at = {i: j for j, i in enumerate(config.indices("mamba"))}
    attn_at = {i: j for j, i in enumerate(config.indices("attention"))}
    hidden = x
    emb = x if embeddings is None else embeddings

    def attend(v: Array, p: dict[str, Array], j: int) -> Array:
        seq = v[:, None, :] if one_token else v  # [b, d] -> [b, 1, d]
        out, kvs[j] = attention(seq, p, config.attention, kvs[j], state.positions.length, positions.valid, rope_pos,
                                xp=xp, pad=pad)
        return out[:, 0, :] if one_token else out

    mamba_c = config.mamba_step if one_token and config.mamba_step is not None else config.mamba
    for i, (mix, ffn) in enumerate(config.layers):
        if mix is not None:
            p = _layer_params(params, i, "mixer")
            source = hidden
            if mix == "shared":
                source = hidden + _shared_block(hidden, emb, _layer_params(params, i, "shared"), attn_at[i], attend,
                                                config, xp=xp)
            normed = rms_norm(source, params[f"layers.{i}.mixer_norm.weight"], config.norm_eps, xp=xp)
            out = None
            if mix in ("mamba", "parallel", "shared"):
                j = mamba_at[i]
                mp = _sub(p, "mamba.") if mix == "parallel" else p
                if one_token:
                    out, convs[j], ssms[j] = mixer_step(normed, mp, mamba_c, convs[j], ssms[j], xp=xp)
                else:
                    extra = {} if pad is None else {"pad": pad}
                    out, convs[j], ssms[j] = mixer(normed, mp, mamba_c, convs[j], ssms[j], xp=xp, **extra)
            if mix in ("attention", "parallel"):
                att = attend(normed, _sub(p, "attention.") if mix == "parallel" else p, attn_at[i])
                out = att if out is None else out + att
            hidden = hidden + out * config.residual_multiplier
        if keep and not one_token and i == len(config.layers) - 1:
            hidden = hidden[:, -keep:, :]  # [b, l, d_model] -> [b, keep, d_model]: what reaches the head
        if ffn is not None:
            normed = rms_norm(hidden, params[f"layers.{i}.ffn_norm.weight"], config.norm_eps, xp=xp)
            hidden = hidden + _ffn(normed, _layer_params(params, i, "ffn"), ffn, config, xp=xp) * \
                config.residual_multiplier
    out = rms_norm(hidden, params["norm_f.weight"], config.norm_eps, xp=xp)
    return out, HybridState(tuple(convs), tuple(ssms), tuple(kvs), positions)


def _shared_block(hidden: Array, emb: Array, p: dict[str, Array], j: int, attend: Any, config: HybridConfig, *,
                  xp: Namespace) -> Array:
    """Zamba2's shared transformer block on ``concat(hidden, emb) [..., 2d]``: attention (KV cache
    ``j``) then the MLP, each after its RMSNorm, then ``linear``: ``[..., d]``."""
    cat = xp.concat([hidden, emb], axis=-1)  # [..., 2d]
    att = attend(rms_norm(cat, p["attn_norm.weight"], config.norm_eps, xp=xp), _sub(p, "attention."), j)
    out = mlp(rms_norm(att, p["ffn_norm.weight"], config.norm_eps, xp=xp), _sub(p, "ffn."), config.mlp, xp=xp)
    return _linear(out, p["linear.weight"], None, xp=xp)


def head(hidden: Array, params: dict[str, Array], config: HybridConfig, *, xp: Namespace) -> Array:
    """Logits ``[..., V]`` of ``hidden [..., d_model]``: the (tied) head, divided by logits_scaling."""
    weight = params["embedding.weight"] if config.tie_embeddings else params["lm_head.weight"]
    return scale_logits(_linear(hidden, weight, None, xp=xp), config)


def scale_logits(out: Array, config: HybridConfig) -> Array:
    """The head's output ``out [..., V]`` divided by logits_scaling."""
    return out if config.logits_scaling == 1.0 else out / config.logits_scaling


def embed_tokens(ids: Array, params: dict[str, Array], config: HybridConfig, *, xp: Namespace) -> Array:
    """``ids [...]`` -> ``[..., d_model]`` rows of the embedding, times embedding_multiplier."""
    out = embed(ids, params, xp=xp)  # [..., d_model], a quantized table's rows widened
    return out if config.embedding_multiplier == 1.0 else out * config.embedding_multiplier


def _map_rows(fn: Any, pool: HybridState, rows: HybridState) -> HybridState:
    """``fn(pool array, rows array)`` over every per-row array of two HybridStates of one config."""
    return HybridState(
        conv=tuple(fn(a, r) for a, r in zip(pool.conv, rows.conv)),
        ssm=tuple(fn(a, r) for a, r in zip(pool.ssm, rows.ssm)),
        kv=tuple(KVCache(fn(a.k, r.k), fn(a.v, r.v), None if a.conv is None else fn(a.conv, r.conv))
                 for a, r in zip(pool.kv, rows.kv)),
        positions=Positions(*(fn(a, r) for a, r in zip(pool.positions, rows.positions))))


def gather_hybrid(pool: HybridState, indices: Array, *, xp: Namespace) -> HybridState:
    """The slots ``indices [b]`` of a pool of HybridStates (SSM, conv and KV caches, and each
    slot's positions: its valid KV slots, slots written and tokens seen)."""
    return _map_rows(lambda a, _: gather_rows(a, indices, xp=xp), pool, pool)


def scatter_hybrid(pool: HybridState, indices: Array, rows: HybridState, *, xp: Namespace) -> HybridState:
    """A new pool with the slots ``indices`` replaced by ``rows``, each with its own positions (a
    request put in keeps its count of slots written; a reused slot starts from its new rows')."""
    return _map_rows(lambda a, r: scatter_rows(a, indices, r, xp=xp), pool, rows)


def check_attention_convs(config: HybridConfig, state: HybridState, name: str = "state") -> None:
    """ValueError unless every KV cache of ``state`` holds the conv state ``[b, c, k]`` its
    attention spec needs (``AttentionSpec.conv = k``), or None where it has no conv."""
    a = config.attention
    if a is None:
        return
    b = state.positions.valid.shape[0]
    want = (b, qkv_width(a), a.conv) if a.conv else None
    for j, cache in enumerate(state.kv):
        got = None if getattr(cache, "conv", None) is None else tuple(cache.conv.shape)
        if got != want:
            raise ValueError(f"{name}.kv[{j}].conv: expected {'a conv state of shape ' + str(want) if want else 'None'}"
                             f" (attention conv {a.conv}), got {got if got is not None else 'None'}; start from "
                             f"this model's empty_state")


def check_room(state: HybridState, new: int, *, slots: Array | None = None, xp: Namespace) -> None:
    """ValueError naming the first row whose KV caches cannot take ``new`` more tokens (skipped
    when traced); ``slots [b]``: the pool slots the rows are, named with them."""
    length = state.positions.length  # [b]
    if is_traced(length) or length.shape[0] == 0 or int(xp.max(length)) + new <= state.max_len:
        return
    row = int(xp.argmax(xp.astype(length + new > state.max_len, xp.int8)))
    which = f"row {row}" if slots is None else f"row {row} (pool slot {int(slots[row])})"
    raise ValueError(f"state: {which} has {int(length[row])} of its max_len = {state.max_len} KV slots written, "
                     f"{new} more do not fit; start it from a state with a larger max_len")


def param_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name a :class:`HybridConfig` needs with its shape (loaders check against it)."""
    d = config.d_model
    shapes: dict[str, tuple[int, ...]] = {"embedding.weight": (config.vocab_size, d), "norm_f.weight": (d,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i, (mix, ffn) in enumerate(config.layers):
        pre = f"layers.{i}.mixer." + ("mamba." if mix == "parallel" else "")
        if mix in ("mamba", "parallel", "shared"):
            for k, v in mamba_shapes(config.mamba).items():
                if k.startswith("layers.0.mixer."):
                    leaf = k[len("layers.0.mixer."):]
                    if leaf == "in_proj.weight":  # in_proj reads, out_proj writes the stack's d_model
                        v = (v[0], d)
                    elif leaf.startswith("out_proj."):
                        v = (d, *v[1:])
                    shapes[pre + leaf] = v
        pre = f"layers.{i}.mixer." + ("attention." if mix == "parallel" else "")
        if mix == "shared":
            s = f"layers.{i}.shared."
            shapes.update({s + "attn_norm.weight": (2 * d,), s + "ffn_norm.weight": (d,), s + "linear.weight": (d, d),
                           s + "ffn.up.weight": ((2 if config.mlp.gated else 1) * config.d_ff, d),
                           s + "ffn.down.weight": (d, config.d_ff)})
            pre = s + "attention."
        if mix in ("attention", "parallel", "shared"):
            a, din = config.attention, 2 * d if mix == "shared" else d
            q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
            for name, shape in (("q_proj", (q, din)), ("k_proj", (kv, din)), ("v_proj", (kv, din)),
                                ("o_proj", (d, q + a.mlp))) + ((("mlp_in", (2 * a.mlp, din)),) if a.mlp else ()):
                shapes[f"{pre}{name}.weight"] = shape
                if a.out_bias if name == "o_proj" else a.bias:
                    shapes[f"{pre}{name}.bias"] = (shape[0],)
            if a.conv:
                c = qkv_width(a)
                shapes.update({f"{pre}conv1d.weight": (c, 1, a.conv), f"{pre}conv1d.bias": (c,)})
        if mix is not None:
            shapes[f"layers.{i}.mixer_norm.weight"] = (d,)
        if ffn is not None:
            shapes[f"layers.{i}.ffn_norm.weight"] = (d,)
        if ffn == "mlp" or (ffn == "moe" and config.shared_expert):
            pre = f"layers.{i}.ffn." + ("shared." if ffn == "moe" else "")
            f = config.d_shared or config.d_ff if ffn == "moe" else config.d_ff
            shapes[pre + "up.weight"] = ((2 if config.mlp.gated else 1) * f, d)  # [2f or f, d]
            shapes[pre + "down.weight"] = (d, f)
        if ffn == "moe":
            e, f = config.moe.experts, config.d_expert
            shapes[f"layers.{i}.ffn.router.weight"] = (e, d)
            if config.moe.router == "sigmoid":
                shapes[f"layers.{i}.ffn.router.bias"] = (e,)
            shapes[f"layers.{i}.ffn.experts.up.weight"] = (e, (2 if config.moe.mlp.gated else 1) * f, d)
            shapes[f"layers.{i}.ffn.experts.down.weight"] = (e, d, f)
    return shapes
