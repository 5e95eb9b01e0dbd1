"""Causal self-attention with grouped KV heads, RoPE (full, partial or none) and a static KV cache.

Shape legend: b batch, l new tokens, m cache slots (max_len), h query heads, kv key/value heads
(``h = kv·rep``), hd head_dim, r rotary channels (``r <= hd``, 0: no position encoding, "nope"),
c = (h + 2·kv)·hd packed q/k/v channels.

The cache never changes shape: ``k, v [b, kv, m, hd]`` and ``valid [b, m]`` (which slots hold a
real token, not left padding), ``length [b]`` (each row's slots written: an array, so a jitted
step does not retrace per position, and per row, so the rows of a state pool fill their own
slots whoever else steps) and ``seen [b]`` (each row's real tokens so far: its next RoPE position,
so a left-padded row is encoded as if alone). A row's new keys land in its slots ``length ..
length+l-1`` through a one-hot ``[b, l, m]`` and ``where`` (no in-place writes, no
data-dependent shapes).

With ``AttentionSpec.conv = k > 0`` (mamba_ssm's ``MHA(d_conv=k)``) the packed projections ``[q;
k; v]`` pass a depthwise causal conv (:func:`portable_ssm.conv.causal_conv1d`, with bias, no
activation) before the heads are split and RoPE applied; the cache then also keeps the conv's
last k inputs per row, ``conv [b, c, k]`` (the Mamba mixer's conv-state layout), and left padding
never enters a row's conv window (:func:`portable_ssm.padding.padded_conv`). With
``AttentionSpec.mlp = f > 0`` (mamba_ssm's ``mlp_dim = 2f``) a gated SiLU MLP runs beside the
heads on the same input: ``mlp_in [2f, d_model]`` gives ``[up; gate]`` and o_proj ``[d_model,
h·hd + f]`` reads ``concat(heads, up · silu(gate))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .._array import Array, Namespace, compute_dtype, device, silu
from ..backends import fast_op
from ..conv import causal_conv1d
from ..mixer import _linear
from ..padding import padded_conv


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's sizes and constants (family-neutral)."""

    n_heads: int  # h
    n_kv_heads: int  # kv; h must be a multiple
    head_dim: int  # hd
    scale: float  # scores = scale · q·k (1/sqrt(hd) for most, Granite's attention_multiplier)
    rotary_dim: int = 0  # r: RoPE on the first r channels of each head; 0 = no position encoding
    rope_theta: float = 10000.0
    bias: bool = False  # biases on the q/k/v projections (and o_proj unless out_bias says otherwise)
    out_bias: bool | None = None  # bias on o_proj; None: as ``bias`` (mamba_ssm sets the two apart)
    conv: int = 0  # k of a depthwise causal conv (with bias) over the packed [q; k; v] before RoPE; 0: none
    mlp: int = 0  # f of a gated SiLU MLP beside the heads, sharing o_proj (mlp_in biased as q/k/v); 0: none

    def __post_init__(self) -> None:
        for name in ("n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionSpec.{name}: expected a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"AttentionSpec.n_kv_heads: n_heads = {self.n_heads} must be a multiple of "
                             f"n_kv_heads = {self.n_kv_heads}")
        if not isinstance(self.bias, bool) or not isinstance(self.out_bias, (bool, type(None))):
            raise TypeError(f"AttentionSpec.bias, out_bias: expected True or False (out_bias also None), got "
                            f"{self.bias!r}, {self.out_bias!r}")
        for name in ("conv", "mlp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AttentionSpec.{name}: expected an int >= 0 (0: none), got {value!r}")
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.bias)
        if not (0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"AttentionSpec.rotary_dim: expected an even int in [0, head_dim = {self.head_dim}], "
                             f"got {self.rotary_dim!r}")


class KVCache(NamedTuple):
    """Keys and values of one attention layer, ``[b, kv, m, hd]`` each (x's dtype), and with a
    conv (``AttentionSpec.conv = k``) its last k inputs ``[b, c, k]``, else None."""

    k: Array
    v: Array
    conv: Array | None = None


class Positions(NamedTuple):
    """The slot bookkeeping every attention layer of a stack shares (see the module docstring)."""

    valid: Array  # [b, m] bool
    length: Array  # [b] int64: slots written per row
    seen: Array  # [b] int64: real tokens per row


def empty_kv_cache(spec: AttentionSpec, batch: int, max_len: int, like: Array, *, xp: Namespace) -> KVCache:
    """Zero keys and values for ``max_len`` slots (and a zero conv state), on ``like``'s device and dtype."""
    shape = (batch, spec.n_kv_heads, max_len, spec.head_dim)
    zeros = xp.zeros(shape, dtype=like.dtype, device=device(like))
    conv = xp.zeros((batch, qkv_width(spec), spec.conv), dtype=like.dtype, device=device(like)) if spec.conv else None
    return KVCache(zeros, zeros, conv)


def qkv_width(spec: AttentionSpec) -> int:
    """c: the packed q/k/v channels, ``(h + 2·kv)·hd``."""
    return (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim


def empty_positions(batch: int, max_len: int, like: Array, *, xp: Namespace) -> Positions:
    """No slot written yet."""
    dev = device(like)
    counts = xp.zeros((batch,), dtype=xp.int64, device=dev)
    return Positions(xp.zeros((batch, max_len), dtype=xp.bool, device=dev), counts, counts)


def advance(pos: Positions, tokens: Array, *, xp: Namespace) -> tuple[Positions, Array]:
    """``(positions after writing l new slots, the new tokens' RoPE positions [b, l])``; ``tokens
    [b, l]`` bool marks real tokens (False: left padding). A padding slot gets position 0."""
    l = tokens.shape[1]
    hit = slot_hits(pos.length, l, pos.valid.shape[1], xp=xp)  # [b, l, m]
    written = xp.any(hit & tokens[:, :, None], axis=1)  # [b, m]
    counts = xp.cumulative_sum(xp.astype(tokens, xp.int64), axis=1)  # [b, l]
    rope_pos = xp.where(tokens, pos.seen[:, None] + counts - 1, xp.zeros_like(counts))  # [b, l]
    return Positions(pos.valid | written, pos.length + l, pos.seen + counts[:, -1]), rope_pos


def query_slots(start: Array, l: int, *, xp: Namespace) -> Array:
    """``[b, l]`` int64: the slots ``start[i] .. start[i]+l-1`` row i's new tokens land in."""
    return start[:, None] + xp.arange(l, dtype=xp.int64, device=device(start))[None, :]


def slot_hits(start: Array, l: int, m: int, *, xp: Namespace) -> Array:
    """The one-hot ``[b, l, m]`` bool of each row's new tokens over its ``m`` slots (from ``start [b]``)."""
    slots = xp.arange(m, dtype=xp.int64, device=device(start))
    return slots[None, None, :] == query_slots(start, l, xp=xp)[:, :, None]


def rope_tables(positions: Array, rotary_dim: int, theta: float, dtype: Any, *, xp: Namespace) -> tuple[Array, Array]:
    """``(cos, sin) [b, l, r]`` for integer ``positions [b, l]``, computed in float32 (float64 for
    float64) as transformers does: ``inv_freq = theta^(-2i/r)``, frequencies repeated twice."""
    cdtype = compute_dtype(xp, dtype)
    half = xp.arange(0, rotary_dim, 2, dtype=cdtype, device=device(positions))
    inv_freq = 1.0 / (theta ** (half / rotary_dim))  # [r/2]
    freqs = xp.astype(positions, cdtype)[..., None] * inv_freq  # [b, l, r/2]
    emb = xp.concat([freqs, freqs], axis=-1)  # [b, l, r]
    return xp.astype(xp.cos(emb), dtype), xp.astype(xp.sin(emb), dtype)


def apply_rope(x: Array, cos: Array, sin: Array, *, xp: Namespace) -> Array:
    """RoPE on the first r channels of ``x [b, heads, l, hd]`` (``cos, sin [b, l, r]``), the rest passed."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rotated = xp.concat([-rot[..., r // 2:], rot[..., :r // 2]], axis=-1)  # rotate_half
    out = rot * cos[:, None, :, :] + rotated * sin[:, None, :, :]
    return out if r == x.shape[-1] else xp.concat([out, rest], axis=-1)


def _heads(v: Array, heads: int, hd: int, *, xp: Namespace) -> Array:
    b, l, _ = v.shape
    return xp.permute_dims(xp.reshape(v, (b, l, heads, hd)), (0, 2, 1, 3))  # [b, l, heads·hd] -> [b, heads, l, hd]


def _write(cache: Array, new: Array, start: Array, *, xp: Namespace) -> Array:
    """``cache [b, kv, m, hd]`` with row i's ``new [b, kv, l, hd]`` in its slots ``start[i] ..
    start[i]+l-1``, as a new array: each slot gathers the token that lands in it (one take per
    row), so a value reaches its own slot only (a NaN key stays in its token's slot). The backend's
    ``fast_op(xp, "write_slots")`` may copy and assign instead."""
    native = fast_op(xp, "write_slots")
    written = None if native is None else native(cache, new, start)
    if written is not None:
        return written
    b, _, m, _ = cache.shape
    l = new.shape[2]
    token = xp.arange(m, dtype=xp.int64, device=device(start))[None, :] - start[:, None]  # [b, m]: which lands there
    inside = (token >= 0) & (token < l)  # [b, m]
    at = xp.clip(token, 0, l - 1)
    placed = xp.stack([xp.take(new[i, ...], at[i, ...], axis=1) for i in range(b)])  # [b, kv, m, hd]
    return xp.where(inside[:, None, :, None], placed, cache)


def _project(x: Array, p: dict[str, Array], spec: AttentionSpec, rope_pos: Array, *, xp: Namespace,
             conv_state: Array | None = None, pad: Array | None = None) -> tuple[Array, Array, Array, Array | None]:
    """``q [b, h, l, hd], k, v [b, kv, l, hd]`` of ``x [b, l, d_model]``, RoPE applied at ``rope_pos
    [b, l]``, and the conv's new state (None without a conv; see :func:`qkv_conv` for the rest)."""
    h, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    q, k, v = (_linear(x, p[f"{n}_proj.weight"], p.get(f"{n}_proj.bias"), xp=xp) for n in "qkv")
    if spec.conv:
        q, k, v, conv_state = qkv_conv(q, k, v, p, conv_state, pad, xp=xp)
    q, k, v = _heads(q, h, hd, xp=xp), _heads(k, kv, hd, xp=xp), _heads(v, kv, hd, xp=xp)
    if spec.rotary_dim:
        cos, sin = rope_tables(rope_pos, spec.rotary_dim, spec.rope_theta, x.dtype, xp=xp)
        q, k = apply_rope(q, cos, sin, xp=xp), apply_rope(k, cos, sin, xp=xp)
    return q, k, v, conv_state


def qkv_conv(q: Array, k: Array, v: Array, p: dict[str, Array], state: Array | None, pad: Array | None, *,
             xp: Namespace) -> tuple[Array, Array, Array, Array]:
    """mamba_ssm MHA's ``d_conv``: the projections ``q [b, l, h·hd], k, v [b, l, kv·hd]`` packed
    as ``[b, l, c]`` through the depthwise causal conv ``conv1d.weight [c, 1, k]`` (``conv1d.bias
    [c]``, no activation) from ``state [b, c, k]`` (None: zeros), then cut apart again:
    ``(q, k, v, new state)``. ``pad [b]`` (left padding, or None): each row's padding is left out
    of its window, as the Mamba mixer's conv does."""
    widths = (q.shape[-1], k.shape[-1], v.shape[-1])
    packed = xp.concat([q, k, v], axis=-1)  # [b, l, c]
    weight = xp.reshape(p["conv1d.weight"], (sum(widths), -1))  # [c, 1, k] -> [c, k]
    if pad is None:
        y, state = causal_conv1d(packed, weight, p.get("conv1d.bias"), state, xp=xp)
    else:
        y, state = padded_conv(causal_conv1d, packed, weight, p.get("conv1d.bias"), state, pad, xp=xp)
    a, b = widths[0], widths[0] + widths[1]
    return y[..., :a], y[..., a:b], y[..., b:], state


def _out(out: Array, p: dict[str, Array], *, xp: Namespace, mlp: Array | None = None) -> Array:
    """o_proj of the heads ``[b, h, l, hd]`` (then ``mlp [b, l, f]``, see :func:`inner_mlp`) -> ``[b, l, d_model]``."""
    b, h, l, hd = out.shape
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (b, l, h * hd))  # [b, h, l, hd] -> [b, l, h·hd]
    if mlp is not None:
        out = xp.concat([out, mlp], axis=-1)  # [b, l, h·hd + f]
    return _linear(out, p["o_proj.weight"], p.get("o_proj.bias"), xp=xp)


def inner_mlp(x: Array, p: dict[str, Array], spec: AttentionSpec, *, xp: Namespace) -> Array | None:
    """The MLP beside the heads (``spec.mlp = f``; None without one): ``up · silu(gate) [b, l, f]``
    of ``mlp_in(x) = [up; gate] [b, l, 2f]`` (mamba_ssm MHA's ``mlp_dim`` part of ``in_proj``)."""
    if not spec.mlp:
        return None
    both = _linear(x, p["mlp_in.weight"], p.get("mlp_in.bias"), xp=xp)  # [b, l, 2f]
    return both[..., :spec.mlp] * silu(both[..., spec.mlp:], xp=xp)


def attention(x: Array, p: dict[str, Array], spec: AttentionSpec, cache: KVCache, start: Array, valid: Array,
              rope_pos: Array, *, xp: Namespace, pad: Array | None = None) -> tuple[Array, KVCache]:
    """One attention layer over ``x [b, l, d_model]``, row i written to its slots ``start[i] ..
    start[i]+l-1`` (``start [b]``: the positions' ``length`` before these tokens), ``valid [b, m]`` and ``rope_pos
    [b, l]`` as :func:`advance` gives them after: ``(out [b, l, d_model], new cache)``. ``p``:
    ``q_proj/k_proj/v_proj/o_proj.weight`` (and ``.bias``). Scores are computed in float32 at
    least; a query sees the valid slots up to its own. With a conv (``spec.conv``) also
    ``conv1d.weight/bias``, the cache's conv state continues and ``pad [b]`` (each row's left
    padding in x, or None) keeps padding out of it; with an inner MLP (``spec.mlp``) also
    ``mlp_in.weight`` (``.bias`` with ``spec.bias``), o_proj then ``[d_model, h·hd + f]``."""
    l = x.shape[1]
    q, k, v, conv = _project(x, p, spec, rope_pos, xp=xp, conv_state=cache.conv, pad=pad)
    m = cache.k.shape[2]
    slots = xp.arange(m, dtype=xp.int64, device=device(x))
    query_slot = query_slots(start, l, xp=xp)  # [b, l]
    cache = KVCache(_write(cache.k, k, start, xp=xp), _write(cache.v, v, start, xp=xp), conv)
    visible = (slots[None, None, :] <= query_slot[:, :, None]) & valid[:, None, :]  # [b, l, m]
    out = _out(attend(q, cache.k, cache.v, visible, spec.scale, xp=xp), p, xp=xp, mlp=inner_mlp(x, p, spec, xp=xp))
    return out, cache


def attend(q: Array, k: Array, v: Array, visible: Array, scale: float, *, xp: Namespace) -> Array:
    """``softmax(scale·q·kᵀ where visible) · v`` with grouped heads: ``q [b, h, l, hd]``, ``k, v
    [b, kv, m, hd]``, ``visible [b, l, m]`` -> ``[b, h, l, hd]`` in q's dtype. A query with no
    visible slot (left padding) spreads evenly, as transformers' additive mask does: finite, never NaN.
    A NaN or inf value reaches only the queries that see its slot: never an earlier token's, nor any
    query's from a slot none sees (e.g. one a later step of another branch wrote)."""
    native = fast_op(xp, "attend")
    fused = None if native is None else native(q, k, v, visible, scale)
    if fused is not None:  # blocked over tiles of queries (a prefill's); this function is its reference
        return fused
    b, h, l, hd = q.shape
    kv = k.shape[1]
    cdtype = compute_dtype(xp, q.dtype)
    qg = xp.reshape(xp.astype(q, cdtype), (b, kv, h // kv, l, hd))  # [b, h, l, hd] -> [b, kv, rep, l, hd]
    kc, vc = xp.astype(k, cdtype)[:, :, None, :, :], xp.astype(v, cdtype)[:, :, None, :, :]  # [b, kv, 1, m, hd]
    scores = xp.matmul(qg, xp.matrix_transpose(kc)) * scale  # [b, kv, rep, l, m]
    low = xp.asarray(xp.finfo(cdtype).min, dtype=cdtype, device=device(q))
    scores = xp.where(visible[:, None, None, :, :], scores, low)
    scores = scores - xp.max(scores, axis=-1, keepdims=True)
    weights = xp.exp(scores)
    weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    # A slot's NaN or inf value reaches only the queries that weigh the slot: a product with it would
    # give an earlier query a later token's NaN (0·NaN), so the values are multiplied finite, and the
    # queries that weigh a non-finite one take the plain product, which holds it.
    finite = xp.isfinite(vc)  # [b, kv, 1, m, hd]
    out = xp.matmul(weights, xp.where(finite, vc, xp.zeros_like(vc)))  # [b, kv, rep, l, hd]
    reach = xp.matmul(xp.astype(weights > 0, cdtype), xp.astype(~finite, cdtype))  # [b, kv, rep, l, hd]
    out = xp.where(reach > 0, xp.matmul(weights, vc), out)
    return xp.astype(xp.reshape(out, (b, h, l, hd)), q.dtype)  # [b, kv, rep, l, hd] -> [b, h, l, hd]


def attention_ref(x: Array, p: dict[str, Array], spec: AttentionSpec, *, xp: Namespace) -> Array:
    """The cache-free twin of :func:`attention` for whole unpadded rows ``x [b, l, d_model]``
    (positions 0..l-1, a plain causal mask): the oracle for the cache bookkeeping."""
    b, l, _ = x.shape
    idx = xp.arange(l, dtype=xp.int64, device=device(x))
    q, k, v, _ = _project(x, p, spec, xp.broadcast_to(idx[None, :], (b, l)), xp=xp)  # a conv starts from zeros
    causal = xp.broadcast_to((idx[None, :] <= idx[:, None])[None, :, :], (b, l, l))  # [b, l, l]
    return _out(attend(q, k, v, causal, spec.scale, xp=xp), p, xp=xp, mlp=inner_mlp(x, p, spec, xp=xp))
