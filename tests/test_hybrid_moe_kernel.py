"""MoE blocks in NumPy's fused hybrid decode step (``moe_share`` of ``backends/cpu/decode_hybrid.h``,
planned by ``backends/numpy/hybrid.py``) against their twin, the array-API step
(:func:`portable_ssm.stack.run_layers` with :func:`portable_ssm.blocks.moe.moe`): the same logits
and states token after token for softmax and sigmoid routers (bias, normalize, scale), with and
without a shared expert, at every weight precision and on 1, 2 and 3 threads; ties in the router's
scores go to the lowest expert as in the reference; greedy generation picks the same tokens."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from portable_ssm.backends.numpy import hybrid, kernels
from test_hybrid_decode_kernel import _steps, reference

from portable_ssm.bench.hybrid_models import random_params
from portable_ssm.blocks import AttentionSpec, MLPSpec, MoESpec
from portable_ssm.config import Mamba2Config
from portable_ssm.hybrid_lm import HybridLM
from portable_ssm.stack import HybridConfig

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="NumPy's CPU kernels are not built here")

_MAMBA = Mamba2Config(d_model=32, expand=1, n_layer=1, d_state=8, headdim=8, ngroups=2, vocab_size=None)
_SILU, _RELU2 = MLPSpec("silu", True), MLPSpec("relu2", False)

#: One config per router and shared-expert arrangement the kernel computes.
CONFIGS = {
    # Granite-4.0-H MoE without a shared expert: softmax over the chosen logits, gated SiLU experts
    "softmax": HybridConfig(d_model=24, vocab_size=80, layers=(("mamba", "moe"), ("attention", "moe")),
                            mamba=_MAMBA, attention=AttentionSpec(6, 2, 8, 0.3), mlp=_SILU,
                            moe=MoESpec(6, 2, "softmax", _SILU), d_expert=12, residual_multiplier=0.7,
                            tie_embeddings=True),
    # Granite-4.0-H tiny: a shared expert of its own width beside three chosen of eight
    "softmax_shared": HybridConfig(d_model=24, vocab_size=80, layers=(("mamba", "moe"), ("attention", "moe")),
                                   mamba=_MAMBA, attention=AttentionSpec(6, 2, 8, 0.3), mlp=_SILU,
                                   moe=MoESpec(8, 3, "softmax", _SILU), shared_expert=True,
                                   d_ff=20, d_expert=12, d_shared=16, tie_embeddings=True),
    # Nemotron-H MoE: sigmoid router with a choice bias, normalized, scaled; relu² experts and shared expert
    "sigmoid_shared": HybridConfig(d_model=24, vocab_size=80,
                                   layers=(("mamba", None), (None, "moe"), ("attention", None), (None, "moe")),
                                   mamba=_MAMBA, attention=AttentionSpec(4, 2, 6, 0.4), mlp=_RELU2,
                                   moe=MoESpec(8, 3, "sigmoid", _RELU2, normalize=True, scale=2.5),
                                   shared_expert=True, d_ff=20, d_expert=10),
    # sigmoid weights as they are (no normalize), no shared expert
    "sigmoid": HybridConfig(d_model=24, vocab_size=80, layers=(("mamba", "moe"), ("attention", "moe")),
                            mamba=_MAMBA, attention=AttentionSpec(6, 2, 8, 0.3), mlp=_RELU2,
                            moe=MoESpec(5, 2, "sigmoid", _RELU2, scale=1.5), d_expert=12),
}


@dataclass
class Team:
    """The fused step's team size for a test, and the size each call of the library was given."""

    size: int
    calls: list[int] = field(default_factory=list)


@pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def team(request, monkeypatch) -> Team:
    """The fused step on a team of the given size however small the model, each call recorded."""
    monkeypatch.setattr(hybrid, "workers", lambda: request.param)
    monkeypatch.setattr(hybrid, "BYTES_PER_THREAD", 1)
    out, library = Team(request.param), kernels.library()

    class Recording:  # the library, its hybrid step recorded
        def __getattr__(self, name):
            return getattr(library, name)

        def portable_ssm_decode_hybrid(self, *args):
            out.calls.append(args[-1])
            return library.portable_ssm_decode_hybrid(*args)

    monkeypatch.setattr(hybrid.kernels, "library", lambda: Recording())
    return out


_PROMPT = np.array([[3, 17, 5, 60, 2, 9]])


def _assert_same_steps(lm: HybridLM, tokens: list[int], team: Team) -> list[np.ndarray]:
    """The fused steps of ``tokens`` after a prompt equal the reference's (logits and states), each
    on ``team``'s threads; returns the fused logits."""
    _, start = lm.prefill(_PROMPT, max_len=16)
    with reference():
        want, want_state = _steps(lm, start, tokens)
    team.calls.clear()
    got, got_state = _steps(lm, start, tokens)
    assert team.calls == [team.size] * len(tokens)  # every step fused
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
    for g, w in zip((*got_state.conv, *got_state.ssm), (*want_state.conv, *want_state.ssm)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    return got


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_moe_step_equals_the_array_api_step_token_after_token(name, kind, team):
    config = CONFIGS[name]
    lm = HybridLM(random_params(config, dt=0.05, norm_noise=0.2), config).quantize(kind)
    _assert_same_steps(lm, [4, 71, 12, 33, 8, 50, 1], team)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_tied_router_scores_choose_the_lowest_experts(router, team):
    config = CONFIGS[router]
    params = random_params(config, dt=0.05, norm_noise=0.2)
    params["layers.0.ffn.router.weight"][:] = 0.0  # every score of layer 0 exactly equal, whatever the token
    if router == "sigmoid":
        params["layers.0.ffn.router.bias"][:] = 0.25
    got = _assert_same_steps(HybridLM(params, config), [4, 71, 12], team)
    reversed_experts = {f"layers.0.ffn.experts.{n}.weight": params[f"layers.0.ffn.experts.{n}.weight"][::-1].copy()
                        for n in ("up", "down")}  # the highest experts first: what ties to the highest would run
    lm = HybridLM({**params, **reversed_experts}, config)
    with reference():
        other, _ = _steps(lm, lm.prefill(_PROMPT, max_len=16)[1], [4, 71, 12])
    assert any(not np.allclose(g, o, rtol=1e-3, atol=1e-3) for g, o in zip(got, other))


def test_greedy_generation_picks_the_reference_tokens():
    config = CONFIGS["sigmoid_shared"]
    lm = HybridLM(random_params(config, seed=1, dt=0.05, norm_noise=0.2), config)
    prompt = np.array([[5, 12, 40, 7]])
    got = lm.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    with reference():
        want = lm.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert got.shape == (1, 12)
    np.testing.assert_array_equal(got, want)


def test_plan_counts_the_chosen_experts_bytes_and_names_a_router_that_is_not_float32():
    config = CONFIGS["sigmoid_shared"]
    params = random_params(config)
    e, k = config.moe.experts, config.moe.top_k
    every = replace(config, moe=replace(config.moe, top_k=e))  # every expert chosen: every byte read
    stack = sum(params[f"layers.1.ffn.experts.{n}.weight"].nbytes for n in ("up", "down"))  # one layer's
    unread = hybrid.plan(params, every).weight_bytes - hybrid.plan(params, config).weight_bytes
    assert unread == 2 * (stack * (e - k) // e)
    params["layers.3.ffn.router.weight"] = params["layers.3.ffn.router.weight"].astype(np.float64)
    with pytest.raises(ValueError, match=r"layers\.3\.ffn\.router\.weight"):
        hybrid.plan(params, config)
