"""Causal self-attention with grouped KV heads, RoPE (full, partial or none) and a static KV cache.

Shape legend: b batch, l new tokens, m cache slots (max_len), h query heads, kv key/value heads
(``h = kv·rep``), hd head_dim, r rotary channels (``r <= hd``, 0: no position encoding, "nope").

The cache never changes shape: ``k, v [b, kv, m, hd]`` and ``valid [b, m]`` (which slots hold a
real token, not left padding), ``length [b]`` (each row's slots written: an array, so a jitted
step does not retrace per position, and per row, so the rows of a state pool fill their own
slots whoever else steps) and ``seen [b]`` (each row's real tokens so far: its next RoPE position,
so a left-padded row is encoded as if alone). A row's new keys land in its slots ``length ..
length+l-1`` through a one-hot ``[b, l, m]`` and ``where`` (no in-place writes, no
data-dependent shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .._array import Array, Namespace, compute_dtype, device
from ..mixer import _linear


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
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.bias)
        if not (0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"AttentionSpec.rotary_dim: expected an even int in [0, head_dim = {self.head_dim}], "
                             f"got {self.rotary_dim!r}")


class KVCache(NamedTuple):
    """Keys and values of one attention layer, ``[b, kv, m, hd]`` each (x's dtype)."""

    k: Array
    v: Array


class Positions(NamedTuple):
    """The slot bookkeeping every attention layer of a stack shares (see the module docstring)."""

    valid: Array  # [b, m] bool
    length: Array  # [b] int64: slots written per row
    seen: Array  # [b] int64: real tokens per row


def empty_kv_cache(spec: AttentionSpec, batch: int, max_len: int, like: Array, *, xp: Namespace) -> KVCache:
    """Zero keys and values for ``max_len`` slots, on ``like``'s device and dtype."""
    shape = (batch, spec.n_kv_heads, max_len, spec.head_dim)
    zeros = xp.zeros(shape, dtype=like.dtype, device=device(like))
    return KVCache(zeros, zeros)


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


def _write(cache: Array, new: Array, hit: Array, *, xp: Namespace) -> Array:
    """``cache [b, kv, m, hd]`` with ``new [b, kv, l, hd]`` in the slots of the one-hot ``hit [b, l, m]``."""
    spread = xp.astype(xp.matrix_transpose(hit), new.dtype)[:, None, :, :]  # [b, l, m] -> [b, 1, m, l]
    placed = xp.matmul(spread, new)  # [b, 1, m, l] @ [b, kv, l, hd] -> [b, kv, m, hd]
    return xp.where(xp.any(hit, axis=1)[:, None, :, None], placed, cache)


def _project(x: Array, p: dict[str, Array], spec: AttentionSpec, rope_pos: Array, *,
             xp: Namespace) -> tuple[Array, Array, Array]:
    """``q [b, h, l, hd], k, v [b, kv, l, hd]`` of ``x [b, l, d_model]``, RoPE applied at ``rope_pos [b, l]``."""
    h, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    q = _heads(_linear(x, p["q_proj.weight"], p.get("q_proj.bias"), xp=xp), h, hd, xp=xp)
    k = _heads(_linear(x, p["k_proj.weight"], p.get("k_proj.bias"), xp=xp), kv, hd, xp=xp)
    v = _heads(_linear(x, p["v_proj.weight"], p.get("v_proj.bias"), xp=xp), kv, hd, xp=xp)
    if spec.rotary_dim:
        cos, sin = rope_tables(rope_pos, spec.rotary_dim, spec.rope_theta, x.dtype, xp=xp)
        q, k = apply_rope(q, cos, sin, xp=xp), apply_rope(k, cos, sin, xp=xp)
    return q, k, v


def _out(out: Array, p: dict[str, Array], *, xp: Namespace) -> Array:
    """o_proj of the heads ``[b, h, l, hd]`` -> ``[b, l, d_model]``."""
    b, h, l, hd = out.shape
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (b, l, h * hd))  # [b, h, l, hd] -> [b, l, h·hd]
    return _linear(out, p["o_proj.weight"], p.get("o_proj.bias"), xp=xp)


def attention(x: Array, p: dict[str, Array], spec: AttentionSpec, cache: KVCache, start: Array, valid: Array,
              rope_pos: Array, *, xp: Namespace) -> tuple[Array, KVCache]:
    """One attention layer over ``x [b, l, d_model]``, row i written to its slots ``start[i] ..
    start[i]+l-1`` (``start [b]``: the positions' ``length`` before these tokens), ``valid [b, m]`` and ``rope_pos
    [b, l]`` as :func:`advance` gives them after: ``(out [b, l, d_model], new cache)``. ``p``:
    ``q_proj/k_proj/v_proj/o_proj.weight`` (and ``.bias``). Scores are computed in float32 at
    least; a query sees the valid slots up to its own."""
    l = x.shape[1]
    q, k, v = _project(x, p, spec, rope_pos, xp=xp)
    m = cache.k.shape[2]
    slots = xp.arange(m, dtype=xp.int64, device=device(x))
    query_slot = query_slots(start, l, xp=xp)  # [b, l]
    hit = slots[None, None, :] == query_slot[:, :, None]  # [b, l, m]
    cache = KVCache(_write(cache.k, k, hit, xp=xp), _write(cache.v, v, hit, xp=xp))
    visible = (slots[None, None, :] <= query_slot[:, :, None]) & valid[:, None, :]  # [b, l, m]
    return _out(attend(q, cache.k, cache.v, visible, spec.scale, xp=xp), p, xp=xp), cache


def attend(q: Array, k: Array, v: Array, visible: Array, scale: float, *, xp: Namespace) -> Array:
    """``softmax(scale·q·kᵀ where visible) · v`` with grouped heads: ``q [b, h, l, hd]``, ``k, v
    [b, kv, m, hd]``, ``visible [b, l, m]`` -> ``[b, h, l, hd]`` in q's dtype. A query with no
    visible slot (left padding) spreads evenly, as transformers' additive mask does: finite, never NaN."""
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
    out = xp.matmul(weights, vc)  # [b, kv, rep, l, hd]
    return xp.astype(xp.reshape(out, (b, h, l, hd)), q.dtype)  # [b, kv, rep, l, hd] -> [b, h, l, hd]


def attention_ref(x: Array, p: dict[str, Array], spec: AttentionSpec, *, xp: Namespace) -> Array:
    """The cache-free twin of :func:`attention` for whole unpadded rows ``x [b, l, d_model]``
    (positions 0..l-1, a plain causal mask): the oracle for the cache bookkeeping."""
    b, l, _ = x.shape
    idx = xp.arange(l, dtype=xp.int64, device=device(x))
    q, k, v = _project(x, p, spec, xp.broadcast_to(idx[None, :], (b, l)), xp=xp)
    causal = xp.broadcast_to((idx[None, :] <= idx[:, None])[None, :, :], (b, l, l))  # [b, l, l]
    return _out(attend(q, k, v, causal, spec.scale, xp=xp), p, xp=xp)
