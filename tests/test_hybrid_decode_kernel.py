"""NumPy's fused hybrid decode step (``backends/numpy/hybrid.py``, ``decode_hybrid_run`` of
``backends/cpu/decode_hybrid.h``) against its twin, the array-API step of the hybrid stack: the
same logits and states, token after token, for every block kind the kernel computes, at every
weight precision; KV caches written in place without changing any state already returned; the
variants it does not compute left to the reference. (The families' transformers oracles in
test_families.py and test_hybrid_generation.py run through it too: batch-1 NumPy steps.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from portable_ssm.backends import numpy as numpy_backend
from portable_ssm.backends.numpy import hybrid, kernels

from portable_ssm.bench.hybrid_models import random_params
from portable_ssm.blocks import AttentionSpec, MLPSpec, MoESpec
from portable_ssm.config import Mamba2Config
from portable_ssm.hybrid_lm import HybridLM
from portable_ssm.stack import HybridConfig

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="NumPy's CPU kernels are not built here")


def _mamba(**kw) -> Mamba2Config:
    return Mamba2Config(**{**dict(d_model=32, expand=1, n_layer=1, d_state=8, headdim=8, ngroups=2,
                                  vocab_size=None), **kw})


#: One config per block arrangement the kernel computes.
CONFIGS = {
    # Granite-4.0-H: (mamba | attention, gated SiLU MLP), no RoPE, GQA, multipliers, tied head
    "granite": HybridConfig(d_model=24, vocab_size=80,
                            layers=(("mamba", "mlp"), ("attention", "mlp"), ("mamba", "mlp")),
                            mamba=_mamba(), attention=AttentionSpec(6, 2, 8, 0.3), mlp=MLPSpec("silu", True), d_ff=20,
                            embedding_multiplier=2.0, residual_multiplier=0.7, logits_scaling=3.0,
                            tie_embeddings=True),
    # Falcon-H1: parallel Mamba + attention with RoPE, norm-before-gate Mamba norm, D per head
    "falcon": HybridConfig(d_model=24, vocab_size=80, layers=(("parallel", "mlp"), ("parallel", "mlp")),
                           mamba=_mamba(norm_before_gate=True), attention=AttentionSpec(4, 2, 8, 8 ** -0.5, 8, 1e4),
                           mlp=MLPSpec("silu", True), d_ff=16, embedding_multiplier=1.5, logits_scaling=1 / 0.7),
    # Falcon-H1's default: no Mamba norm at all (y·silu(z) into out_proj); one KV head for six
    "falcon_no_norm": HybridConfig(d_model=24, vocab_size=80, layers=(("parallel", "mlp"),),
                                   mamba=_mamba(rmsnorm=False), attention=AttentionSpec(6, 1, 8, 0.2, 8),
                                   mlp=MLPSpec("silu", True), d_ff=16),
    # Nemotron-H: one block a layer, relu² MLP, biased attention with partial RoPE
    "nemotron": HybridConfig(d_model=24, vocab_size=80,
                             layers=(("mamba", None), ("attention", None), (None, "mlp"), ("mamba", None)),
                             mamba=_mamba(ngroups=4), attention=AttentionSpec(4, 4, 6, 0.4, 4, bias=True),
                             mlp=MLPSpec("relu2", False), d_ff=28),
}


def _params(config: HybridConfig) -> dict[str, np.ndarray]:
    return random_params(config, dt=0.05, norm_noise=0.2)


@contextlib.contextmanager
def reference(ops: dict | None = None) -> Iterator[None]:
    """A context in which ``HybridLM.step`` runs the array-API step (the fast op removed from the
    backend's ``ops``, NumPy's by default)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(numpy_backend.FAST_OPS if ops is None else ops, "decode_hybrid")
        yield


def _steps(lm: HybridLM, state, tokens: list[int]) -> tuple[list[np.ndarray], object]:
    out = []
    for t in tokens:
        logits, state = lm.step(np.array([t]), state)
        out.append(logits)
    return out, state


def _counting(monkeypatch, ops: dict | None = None) -> list[bool]:
    """Records whether each call of the backend's fast op (``ops``, NumPy's by default) computed the
    step (True) or declined (False)."""
    ops = numpy_backend.FAST_OPS if ops is None else ops
    calls: list[bool] = []
    hook = ops["decode_hybrid"]

    def counted(*args):
        out = hook(*args)
        calls.append(out is not None)
        return out
    monkeypatch.setitem(ops, "decode_hybrid", counted)
    return calls


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_hybrid_step_equals_the_array_api_step_token_after_token(name, kind, monkeypatch):
    lm = HybridLM(_params(CONFIGS[name]), CONFIGS[name]).quantize(kind)
    prompt = np.array([[3, 17, 5, 60, 2, 9]])
    _, start = lm.prefill(prompt, max_len=16)
    tokens = [4, 71, 12, 33, 8, 50, 1]
    with reference():
        want, want_state = _steps(lm, start, tokens)
    calls = _counting(monkeypatch)
    got, got_state = _steps(lm, start, tokens)
    assert calls == [True] * len(tokens)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
    for g, w in zip((*got_state.conv, *got_state.ssm), (*want_state.conv, *want_state.ssm)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    n = prompt.shape[1] + len(tokens)  # slots written: the caches agree there (the rest is never read)
    for g, w in zip(got_state.kv, want_state.kv):
        np.testing.assert_allclose(g.k[:, :, :n], w.k[:, :, :n], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g.v[:, :, :n], w.v[:, :, :n], rtol=1e-4, atol=1e-5)
    for field in ("valid", "length", "seen"):
        np.testing.assert_array_equal(getattr(got_state.positions, field), getattr(want_state.positions, field))


def test_fused_step_attends_only_to_a_left_padded_rows_real_tokens():
    config = CONFIGS["falcon"]
    lm = HybridLM(_params(config), config)
    ids, mask = np.array([[0, 0, 7, 3, 11]]), np.array([[0, 0, 1, 1, 1]])
    _, state = lm.prefill(ids, attention_mask=mask, max_len=9)
    with reference():
        want, _ = _steps(lm, state, [5, 6, 2])
    got, _ = _steps(lm, state, [5, 6, 2])
    alone, _ = _steps(lm, lm.prefill(ids[:, 2:], max_len=7)[1], [5, 6, 2])
    for g, w, a in zip(got, want, alone):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
        np.testing.assert_allclose(g, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


@pytest.mark.parametrize("head_dim", [120, 64, 20])  # 120: the 64-, 32-, 16- and 8-channel passes; 20: 16 and 4 single
@pytest.mark.parametrize("heads", [(6, 2), (10, 2), (4, 4)], ids=["3 a KV head", "5 a KV head", "1 a KV head"])
def test_fused_attention_over_wide_heads_and_padded_blocks_of_slots_equals_the_array_api_step(head_dim, heads):
    config = replace(CONFIGS["granite"], attention=AttentionSpec(*heads, head_dim, head_dim ** -0.5))
    lm = HybridLM(_params(config), config)
    rng = np.random.default_rng(head_dim)
    ids = rng.integers(0, config.vocab_size, (1, 21))
    mask = np.ones_like(ids)
    mask[:, :5] = 0  # the first block of eight slots holds five the queries must not see
    _, state = lm.prefill(ids, attention_mask=mask, max_len=30)
    tokens = [5, 6, 2, 70, 11]
    with reference():
        want, _ = _steps(lm, state, tokens)
    got, _ = _steps(lm, state, tokens)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


def test_a_state_stepped_twice_branches_without_changing_any_returned_state():
    config = CONFIGS["granite"]
    lm = HybridLM(_params(config), config)
    _, start = lm.prefill(np.array([[3, 17, 5]]), max_len=12)
    _, one = lm.step(np.array([4]), start)  # the caches now belong to the fused path: written in place next
    kept = [(kv.k.copy(), kv.v.copy()) for kv in one.kv]
    a_logits, a = lm.step(np.array([9]), one)  # in place: slot 4 of one's buffers
    b_logits, b = lm.step(np.array([40]), one)  # the same slot again: must go to a copy
    a_next, _ = lm.step(np.array([2]), a)
    for kv, (k, v) in zip(one.kv, kept):  # one's own slots are as they were
        np.testing.assert_array_equal(kv.k[:, :, :4], k[:, :, :4])
        np.testing.assert_array_equal(kv.v[:, :, :4], v[:, :, :4])
    with reference():
        want_a, ref_a = lm.step(np.array([9]), one)
        want_b, _ = lm.step(np.array([40]), one)
        want_next, _ = lm.step(np.array([2]), ref_a)
    for got, want in ((a_logits, want_a), (b_logits, want_b), (a_next, want_next)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert all(x.k is not y.k for x, y in zip(a.kv, b.kv))


def _gelu_experts() -> HybridConfig:
    c = CONFIGS["granite"]
    return HybridConfig(d_model=c.d_model, vocab_size=c.vocab_size, layers=(("mamba", "moe"), ("attention", "mlp")),
                        mamba=c.mamba, attention=c.attention, mlp=c.mlp,
                        moe=MoESpec(4, 2, "softmax", MLPSpec("gelu", True)), d_ff=20, d_expert=12, tie_embeddings=True)


@pytest.mark.parametrize("variant", ["gelu experts", "attention conv", "gelu"])
def test_variants_the_kernel_does_not_compute_run_the_reference(variant, monkeypatch):
    c = CONFIGS["granite"]
    config = {"gelu experts": _gelu_experts,
              "attention conv": lambda: replace(c, attention=AttentionSpec(6, 2, 8, 0.3, conv=3)),
              "gelu": lambda: replace(c, mlp=MLPSpec("gelu", True))}[variant]()
    params = _params(config)
    with pytest.raises(ValueError, match="decode_hybrid"):
        hybrid.plan(params, config)
    lm = HybridLM(params, config)
    calls = _counting(monkeypatch)
    logits, _ = lm.step(np.array([3]), lm.empty_state(1, 4))
    assert calls == [False] and np.isfinite(logits).all()


def test_plan_names_the_array_that_does_not_fit():
    config = CONFIGS["nemotron"]
    params = _params(config)
    params["layers.1.mixer.k_proj.weight"] = params["layers.1.mixer.k_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"layers\.1\.mixer\.k_proj\.weight"):
        hybrid.plan(params, config)


def test_batches_and_pools_take_the_array_api_step(monkeypatch):
    config = CONFIGS["granite"]
    lm = HybridLM(_params(config), config)
    _, state = lm.prefill(np.array([[3, 17], [5, 6]]), max_len=6)
    calls = _counting(monkeypatch)
    lm.step(np.array([1, 2]), state)
    assert calls == [False]


@pytest.mark.parametrize("fused", [True, False])
def test_a_nan_in_a_slot_the_state_does_not_hold_never_reaches_the_logits(fused):
    config = CONFIGS["falcon"]
    lm = HybridLM(_params(config), config)
    _, state = lm.prefill(np.array([[3, 17, 5]]), max_len=8)
    poisoned = state._replace(kv=tuple(kv._replace(k=kv.k.copy(), v=kv.v.copy()) for kv in state.kv))
    for kv in poisoned.kv:  # slots 4.. are past the state's tokens (and the one this step writes)
        kv.k[:, :, 4:] = np.nan
        kv.v[:, :, 4:] = np.nan
    with contextlib.nullcontext() if fused else reference():
        want, _ = lm.step(np.array([9]), state)
        got, _ = lm.step(np.array([9]), poisoned)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def _attention_case(seed: int, b: int, h: int, kv: int, l: int, m: int, hd: int = 8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, l, hd)).astype(np.float32)
    k, v = (rng.standard_normal((b, kv, m, hd)).astype(np.float32) for _ in range(2))
    start = rng.integers(0, m - l + 1, size=b)  # each row's first query slot
    slot = np.arange(m)
    query = start[:, None] + np.arange(l)[None, :]  # [b, l]
    valid = slot[None, :] < (start + l)[:, None]
    valid[:, 1] = False  # a hole: a slot no query sees
    k[:, :, 1], v[:, :, 1] = np.nan, np.inf  # whatever it holds weighs nothing
    return q, k, v, (slot[None, None, :] <= query[:, :, None]) & valid[:, None, :]


@pytest.mark.parametrize("b, h, kv, l, m", [(1, 6, 2, 200, 200), (2, 4, 1, 130, 300), (1, 3, 3, 64, 90)])
@pytest.mark.parametrize("softmax", ["kernel", "ufuncs"])
def test_blocked_attention_equals_the_reference(b, h, kv, l, m, softmax, monkeypatch):
    from portable_ssm.backends.numpy import attention as blocked

    from portable_ssm.blocks.attention import attend

    monkeypatch.setattr(blocked, "SCORE_BYTES", 4096)  # many tiles, a partial last one
    calls: list[bool] = []
    native = kernels.masked_softmax
    monkeypatch.setattr(kernels, "masked_softmax", lambda *a: calls.append(True) or (
        native(*a) if softmax == "kernel" else None))
    q, k, v, visible = _attention_case(0, b, h, kv, l, m)
    xp = numpy_backend.namespace()
    got = blocked.attend(q, k, v, visible, 0.3)
    assert len(calls) > b * kv  # every tile asked
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(numpy_backend.FAST_OPS, "attend")
        want = attend(q, k, v, visible, 0.3, xp=xp)
    assert got is not None and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softmax", ["kernel", "ufuncs"])
def test_blocked_attention_gives_a_nan_value_to_the_queries_that_see_it_only(softmax, monkeypatch):
    from portable_ssm.backends.numpy import attention as blocked

    from portable_ssm.blocks.attention import attend

    monkeypatch.setattr(blocked, "SCORE_BYTES", 4096)  # tiles of 8 queries: the NaN's tile and later ones
    if softmax == "ufuncs":
        monkeypatch.setattr(kernels, "masked_softmax", lambda *a: None)
    q, k, v, visible = _attention_case(2, 2, 6, 2, 130, 300)
    first = [int(np.flatnonzero(visible[i, 0])[-1]) for i in range(2)]  # each row's first query's own slot
    assert first[1] + 130 < 300
    v[0, 1, first[0] + 50, 5] = np.nan  # row 0, query 50's token's value
    v[1, 0, first[1] + 130, 0] = np.inf  # row 1: a slot past its tokens, which no query sees
    got = blocked.attend(q, k, v, visible, 0.3)
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(numpy_backend.FAST_OPS, "attend")
        want = attend(q, k, v, visible, 0.3, xp=numpy_backend.namespace())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # NaN where the reference has NaN
    bad = ~np.isfinite(got)
    assert bad[0, 3:, 50:, 5].all() and bad.sum() == 3 * 80  # row 0, KV head 1's heads, from query 50, channel 5


def test_blocked_attention_leaves_short_and_padded_queries_to_the_reference():
    from portable_ssm.backends.numpy import attention as blocked

    q, k, v, visible = _attention_case(1, 1, 2, 2, 100, 120)
    assert blocked.attend(q[:, :, :10], k, v, visible[:, :10], 1.0) is None  # a decode step's few queries
    visible[0, 3] = False  # a query that sees no slot
    assert blocked.attend(q, k, v, visible, 1.0) is None


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_prefill_keeps_only_the_last_logits_asked_for(family):
    """The last layer's FFN runs on the kept positions only: the same logits and state as the full run's."""
    config = CONFIGS[family]
    lm = HybridLM(_params(config), config)
    ids = np.array([[3, 17, 5, 60, 2]])
    full, state = lm.prefill(ids)
    last, last_state = lm.prefill(ids, logits_to_keep=2)
    np.testing.assert_allclose(last, full[:, -2:], rtol=1e-6, atol=1e-6 * np.abs(full).max())
    assert lm.prefill(ids, logits_to_keep=9)[0].shape == full.shape
    np.testing.assert_array_equal(last_state.ssm[0], state.ssm[0])
    for bad, error in ((-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="logits_to_keep"):
            lm.prefill(ids, logits_to_keep=bad)


@pytest.mark.parametrize("fast", [True, False])
def test_a_prompts_keys_land_in_their_own_slots_only(fast):
    from portable_ssm.blocks.attention import _write

    rng = np.random.default_rng(3)
    cache = rng.standard_normal((2, 3, 9, 4)).astype(np.float32)
    new = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    new[0, 1, 2] = np.nan  # token 2 of row 0: a NaN key reaches its own slot only, never an earlier token's
    new[1, 0, 0] = np.inf
    want = cache.copy()
    want[0, :, 0:4], want[1, :, 5:9] = new[0], new[1]
    with contextlib.nullcontext() if fast else pytest.MonkeyPatch.context() as patch:
        if not fast:
            patch.delitem(numpy_backend.FAST_OPS, "write_slots")
        got = _write(cache, new, np.array([0, 5]), xp=numpy_backend.namespace())
    np.testing.assert_array_equal(got, want)
    assert got is not cache and np.isnan(got).sum() == 4 and np.isinf(got).sum() == 4
