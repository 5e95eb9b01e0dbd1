"""The hybrid families' blocks (portable_ssm/blocks) against plain float64 NumPy references."""

from __future__ import annotations

import array_api_compat.numpy as np_xp
import numpy as np
import pytest

from portable_ssm.blocks import AttentionSpec, MLPSpec, MoESpec, attention_ref, empty_kv_cache, mlp, moe, moe_dense_ref
from portable_ssm.blocks.attention import advance, attention, empty_positions
from portable_ssm.blocks.moe import moe_gathered
from portable_ssm.quantized import QuantizedWeight, dequantize, quantize


def _np_rope(x: np.ndarray, r: int, theta: float) -> np.ndarray:
    """RoPE of ``x [b, heads, l, hd]`` at positions 0..l-1 on the first r channels (rotate_half)."""
    l = x.shape[2]
    inv = 1.0 / theta ** (np.arange(0, r, 2) / r)
    ang = np.arange(l)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = x[..., :r]
    half = np.concatenate([-rot[..., r // 2:], rot[..., :r // 2]], -1)
    return np.concatenate([rot * cos + half * sin, x[..., r:]], -1)


def _np_attention(x: np.ndarray, p: dict, spec: AttentionSpec) -> np.ndarray:
    b, l, _ = x.shape
    h, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    q = (x @ p["q_proj.weight"].T).reshape(b, l, h, hd).transpose(0, 2, 1, 3)
    k = (x @ p["k_proj.weight"].T).reshape(b, l, kv, hd).transpose(0, 2, 1, 3)
    v = (x @ p["v_proj.weight"].T).reshape(b, l, kv, hd).transpose(0, 2, 1, 3)
    if spec.rotary_dim:
        q, k = _np_rope(q, spec.rotary_dim, spec.rope_theta), _np_rope(k, spec.rotary_dim, spec.rope_theta)
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * spec.scale
    s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = (w @ v).transpose(0, 2, 1, 3).reshape(b, l, h * hd)
    return out @ p["o_proj.weight"].T


def _attn_params(rng: np.random.Generator, d: int, spec: AttentionSpec) -> dict:
    h, kv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    return {"q_proj.weight": rng.normal(size=(h * hd, d)) * 0.3, "k_proj.weight": rng.normal(size=(kv * hd, d)) * 0.3,
            "v_proj.weight": rng.normal(size=(kv * hd, d)) * 0.3, "o_proj.weight": rng.normal(size=(d, h * hd)) * 0.3}


def _on(xp, host: dict, dtype: str = "float64") -> dict:
    return {k: xp.asarray_from(v, dtype) for k, v in host.items()}


SPECS = {"rope": AttentionSpec(4, 2, 8, 8 ** -0.5, rotary_dim=8),
         "partial_rope": AttentionSpec(4, 2, 8, 0.3, rotary_dim=4, rope_theta=500.0),
         "nope": AttentionSpec(4, 1, 8, 0.25)}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_attention_matches_numpy_causal_gqa(xp, kind):
    spec, rng = SPECS[kind], np.random.default_rng(0)
    host_x, host_p = rng.normal(size=(2, 7, 16)), _attn_params(rng, 16, SPECS[kind])
    want = _np_attention(host_x, host_p, spec)
    got = attention_ref(xp.asarray_from(host_x, "float64"), _on(xp, host_p), spec, xp=xp.namespace)
    assert got.dtype == xp.float64 and tuple(got.shape) == (2, 7, 16)
    np.testing.assert_allclose(xp.numpy(got), want, rtol=1e-10, atol=1e-12)


def _cached_run(xp, x, p, spec, splits, max_len, tokens=None):
    """``x`` through :func:`attention` in pieces of ``splits`` tokens, one cache of max_len slots."""
    b = x.shape[0]
    cache, pos = empty_kv_cache(spec, b, max_len, x, xp=xp.namespace), empty_positions(b, max_len, x, xp=xp.namespace)
    outs, start = [], 0
    for n in splits:
        piece = tokens[:, start:start + n] if tokens is not None else xp.ones((b, n), dtype=xp.bool)
        new_pos, rope_pos = advance(pos, piece, xp=xp.namespace)
        y, cache = attention(x[:, start:start + n, :], p, spec, cache, pos.length, new_pos.valid, rope_pos,
                             xp=xp.namespace)
        pos, start = new_pos, start + n
        outs.append(xp.numpy(y))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_kv_cache_prefill_then_single_steps_equals_whole_sequence(xp, kind):
    spec, rng = SPECS[kind], np.random.default_rng(1)
    host_x, host_p = rng.normal(size=(2, 6, 16)), _attn_params(rng, 16, spec)
    x, p = xp.asarray_from(host_x, "float64"), _on(xp, host_p)
    got = _cached_run(xp, x, p, spec, [3, 1, 1, 1], max_len=9)
    np.testing.assert_allclose(got, _np_attention(host_x, host_p, spec), rtol=1e-10, atol=1e-12)


def test_left_padded_row_attends_as_if_alone(xp):
    spec, rng = SPECS["partial_rope"], np.random.default_rng(2)
    host_x, host_p = rng.normal(size=(2, 5, 16)), _attn_params(rng, 16, spec)
    tokens = np.ones((2, 5), bool)
    tokens[1, :2] = False
    got = _cached_run(xp, xp.asarray_from(host_x, "float64"), _on(xp, host_p), spec, [3, 2], max_len=5,
                      tokens=xp.asarray_from(tokens))
    alone = _np_attention(host_x[1:, 2:], host_p, spec)
    np.testing.assert_allclose(got[1, 2:], alone[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[0], _np_attention(host_x[:1], host_p, spec)[0], rtol=1e-10, atol=1e-12)
    assert np.isfinite(got).all()


def _np_act(v: np.ndarray, act: str) -> np.ndarray:
    from math import erf

    if act == "silu":
        return v / (1 + np.exp(-v))
    if act == "relu2":
        return np.maximum(v, 0) ** 2
    if act == "gelu":
        return 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2)))
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False), ("gelu", False), ("gelu_pytorch_tanh", True)])
def test_mlp_matches_numpy(xp, act, gated):
    rng = np.random.default_rng(3)
    f = 12
    host = {"up.weight": rng.normal(size=((2 if gated else 1) * f, 8)), "down.weight": rng.normal(size=(8, f))}
    x = rng.normal(size=(2, 3, 8))
    u = x @ host["up.weight"].T
    h = _np_act(u[..., :f], act) * u[..., f:] if gated else _np_act(u, act)
    got = mlp(xp.asarray_from(x, "float64"), _on(xp, host), MLPSpec(act, gated), xp=xp.namespace)
    assert got.dtype == xp.float64 and tuple(got.shape) == (2, 3, 8)
    np.testing.assert_allclose(xp.numpy(got), h @ host["down.weight"].T, rtol=1e-6, atol=1e-7)


def _np_moe(x: np.ndarray, p: dict, spec: MoESpec) -> np.ndarray:
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = p["router.weight"] @ x[t]
        scores = logits if spec.router == "softmax" else 1 / (1 + np.exp(-logits))
        choice = scores + p.get("router.bias", 0.0)
        top = np.argsort(-choice, kind="stable")[:spec.top_k]
        w = scores[top]
        if spec.router == "softmax":
            w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
        elif spec.normalize:
            w = w / w.sum()
        for e, we in zip(top, w * spec.scale):
            u = p["experts.up.weight"][e] @ x[t]
            f = p["experts.down.weight"].shape[-1]
            h = _np_act(u[:f], spec.mlp.act) * u[f:] if spec.mlp.gated else _np_act(u, spec.mlp.act)
            out[t] += we * (p["experts.down.weight"][e] @ h)
    return out


MOES = {"granite_softmax": MoESpec(6, 2, "softmax", MLPSpec("silu", True)),
        "nemotron_sigmoid_bias": MoESpec(6, 3, "sigmoid", MLPSpec("relu2", False), normalize=True, scale=2.5)}


def _moe_case(spec: MoESpec) -> tuple[dict, np.ndarray]:
    """Random host weights for ``spec`` (6 experts, d 8, f 5) and tokens ``x [5, 8]``."""
    rng, f = np.random.default_rng(4), 5
    host = {"router.weight": rng.normal(size=(6, 8)),
            "experts.up.weight": rng.normal(size=(6, (2 if spec.mlp.gated else 1) * f, 8)),
            "experts.down.weight": rng.normal(size=(6, 8, f))}
    if spec.router == "sigmoid":
        host["router.bias"] = rng.normal(size=(6,))
    return host, rng.normal(size=(5, 8))


@pytest.mark.parametrize("kind", sorted(MOES))
def test_moe_dense_and_gathered_match_numpy(xp, kind):
    spec = MOES[kind]
    host, x = _moe_case(spec)
    want = _np_moe(x, host, spec)
    xa, p = xp.asarray_from(x, "float64"), _on(xp, host)
    for fn in (moe_dense_ref, moe_gathered, moe):
        got = fn(xa, p, spec, xp=xp.namespace)
        assert got.dtype == xp.float64 and tuple(got.shape) == (5, 8)
        np.testing.assert_allclose(xp.numpy(got), want, rtol=1e-10, atol=1e-10, err_msg=fn.__name__)


@pytest.mark.parametrize("kind", sorted(MOES))
def test_numpy_moe_runs_each_expert_on_the_tokens_that_chose_it_only(kind, monkeypatch):
    """NumPy's ``moe`` fast op (many tokens: the array-API path would run every expert on every one)
    computes only the chosen experts, equals the dense reference, and keeps a token's NaN its own."""
    from portable_ssm.backends.numpy import experts as grouped

    from portable_ssm.blocks.moe import route

    spec = MOES[kind]
    host, x = _moe_case(spec)
    x = np.concatenate([x, -0.5 * x[:2]])  # [7, 8]: 14 pairs over 6 experts
    p = {k: v.astype(np.float32) for k, v in host.items()}
    xs = x.astype(np.float32)
    taken: list[int] = []
    real = grouped.chosen_experts
    monkeypatch.setattr(grouped, "chosen_experts",
                        lambda w, ids, **kw: taken.extend(ids.tolist()) or real(w, ids, **kw))
    got = moe(xs, p, spec, xp=np_xp)
    chosen = set(np.asarray(route(xs, p, spec, xp=np_xp)[0]).ravel().tolist())
    assert sorted(set(taken)) == sorted(chosen) and len(taken) == 2 * len(chosen)  # up and down of each, once
    np.testing.assert_allclose(got, moe_dense_ref(xs, p, spec, xp=np_xp), rtol=2e-6, atol=2e-6 * np.abs(got).max())
    poisoned = xs.copy()
    poisoned[3, 2] = np.nan
    out = moe(poisoned, p, spec, xp=np_xp)
    assert np.isnan(out[3]).all() and np.array_equal(np.delete(out, 3, axis=0), np.delete(got, 3, axis=0))
    many = np.random.default_rng(9).normal(size=(3, 700, 8)).astype(np.float32)  # experts over the pool's workers
    np.testing.assert_allclose(moe(many, p, spec, xp=np_xp), moe_dense_ref(many, p, spec, xp=np_xp), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("storage", ["int8", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(MOES))
def test_moe_reads_quantized_experts_as_their_dequantized_weights(xp, kind, storage):
    """Experts stored as QuantizedWeight stacks ``[E, out, in]``: the dense path (every expert
    dequantized) and the gathered one (the chosen experts' storage and scales taken, only those
    widened) give the float32 experts' result on the dequantized weights."""
    spec = MOES[kind]
    host, x = _moe_case(spec)
    experts = ["experts.up.weight", "experts.down.weight"]
    p = quantize(_on(xp, host, "float32"), storage, names=experts)
    assert all(isinstance(p[k], QuantizedWeight) and p[k].ndim == 3 for k in experts)
    widened = {k: xp.numpy(dequantize(v, xp=xp.namespace)) if isinstance(v, QuantizedWeight) else xp.numpy(v)
               for k, v in p.items()}
    want = _np_moe(x, widened, spec)
    xa = xp.asarray_from(x, "float32")
    for fn in (moe_dense_ref, moe_gathered, moe):
        got = fn(xa, p, spec, xp=xp.namespace)
        assert got.dtype == xp.float32 and tuple(got.shape) == (5, 8)
        np.testing.assert_allclose(xp.numpy(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=fn.__name__)


def test_specs_refuse_bad_fields_by_name():
    with pytest.raises(ValueError, match="n_kv_heads"):
        AttentionSpec(4, 3, 8, 1.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        AttentionSpec(4, 2, 8, 1.0, rotary_dim=10)
    with pytest.raises(ValueError, match="act"):
        MLPSpec("tanh", False)
    with pytest.raises(ValueError, match="top_k"):
        MoESpec(4, 5, "softmax", MLPSpec("silu", True))


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_later_tokens_nan_value_never_reaches_an_earlier_query(xp, poison):
    """Token 70's value holds a NaN (or inf) in one channel: the queries before it are the clean run's
    to the bit and finite, those after it non-finite in that channel only (on NumPy also through the
    blocked prefill path, whose softmax runs in the kernel or in ufuncs)."""
    from portable_ssm.blocks.attention import attend

    rng = np.random.default_rng(5)
    b, h, kv, l, hd = 1, 4, 2, 96, 8
    q, k, v = (rng.standard_normal((b, n, l, hd)).astype(np.float32) for n in (h, kv, kv))
    causal = np.broadcast_to(np.tril(np.ones((l, l), bool))[None], (b, l, l)).copy()
    poisoned = v.copy()
    poisoned[0, 1, 70, 3] = poison
    args = [xp.asarray_from(a) for a in (q, k, v, causal)]
    clean = xp.numpy(xp.call(attend, *args, 0.5, xp=xp.namespace))
    args[2] = xp.asarray_from(poisoned)
    got = xp.numpy(xp.call(attend, *args, 0.5, xp=xp.namespace))
    np.testing.assert_array_equal(got[:, :, :70], clean[:, :, :70])
    assert np.isfinite(got[:, :2]).all()  # the other KV head's query heads
    assert (~np.isfinite(got[0, 2:, 70:])).all(axis=(0, 1)).tolist() == [c == 3 for c in range(hd)]
