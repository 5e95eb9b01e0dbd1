"""The torch backend's fused hybrid decode step (``backends/torch_hybrid.py``): NumPy's compiled
step on zero-copy views of CPU tensors. Against NumPy's own fused step (bit for bit, from the same
state) and the torch array-API step (within float32 rounding), at every weight precision; the plan
made once per params dict and again when a tensor's memory changes; KV caches written in place
without changing any state already returned; tensors autograd records left to the reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from portable_ssm.backends.numpy import kernels
from test_hybrid_decode_kernel import CONFIGS, _counting, _params, reference

from portable_ssm.blocks import MLPSpec
from portable_ssm.hybrid_lm import HybridLM
from portable_ssm.quantized import QuantizedWeight
from portable_ssm.stack import HybridState

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(kernels.library() is None, reason="NumPy's CPU kernels are not built here")

from portable_ssm.backends import torch as torch_backend  # noqa: E402  (after the skips: needs torch)
from portable_ssm.backends import torch_hybrid  # noqa: E402
from portable_ssm.backends.torch_views import numpy_views  # noqa: E402


def _models(name: str, kind: str) -> tuple[HybridLM, HybridLM]:
    """``(torch model, NumPy model)`` of ``CONFIGS[name]`` stored as ``kind``: the NumPy one over
    views of the torch one's tensors (the very same weights)."""
    config = CONFIGS[name]
    lm = HybridLM({k: torch.from_numpy(v) for k, v in _params(config).items()}, config).quantize(kind)
    return lm, HybridLM(dict(zip(lm.params, numpy_views(list(lm.params.values())))), config)


def _to_torch(state: HybridState) -> HybridState:
    """A copy of the NumPy ``state`` as torch tensors."""
    def copy(a):
        return None if a is None else torch.from_numpy(np.array(a))
    return HybridState(tuple(map(copy, state.conv)), tuple(map(copy, state.ssm)),
                       tuple(kv._replace(k=copy(kv.k), v=copy(kv.v)) for kv in state.kv),
                       state.positions._replace(**{f: copy(getattr(state.positions, f))
                                                   for f in state.positions._fields}))


def _steps(lm: HybridLM, state, tokens: list[int], make) -> tuple[list[np.ndarray], HybridState]:
    out = []
    for t in tokens:
        logits, state = lm.step(make([t]), state)
        out.append(logits.numpy() if isinstance(logits, torch.Tensor) else logits)
    return out, state


def _host(state: HybridState) -> list[np.ndarray]:
    return [np.asarray(a) for a in (*state.conv, *state.ssm, *(t for kv in state.kv for t in (kv.k, kv.v)))]


TOKENS = [4, 71, 12, 33, 8, 50, 1]


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("name", ["granite", "falcon"])
def test_torch_fused_step_equals_numpys_bit_for_bit_and_the_reference_within_rounding(name, kind, monkeypatch):
    lm, numpy_lm = _models(name, kind)
    _, start = numpy_lm.prefill(np.array([[3, 17, 5, 60, 2, 9]]), max_len=16)
    want, want_state = _steps(numpy_lm, start, TOKENS, np.array)  # NumPy's fused step
    with reference(torch_backend.FAST_OPS):
        ref, ref_state = _steps(lm, _to_torch(start), TOKENS, torch.tensor)
    calls = _counting(monkeypatch, torch_backend.FAST_OPS)
    got, got_state = _steps(lm, _to_torch(start), TOKENS, torch.tensor)
    assert calls == [True] * len(TOKENS)
    assert all(isinstance(a, torch.Tensor) for a in (*got_state.conv, *got_state.ssm, got_state.kv[0].k))
    for g, w, r in zip(got, want, ref):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * np.abs(r).max())
    for g, w in zip(_host(got_state), _host(want_state)):
        np.testing.assert_array_equal(g, w)
    for g, r in zip((*got_state.conv, *got_state.ssm), (*ref_state.conv, *ref_state.ssm)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    n = 6 + len(TOKENS)  # the slots written: the caches agree there (the rest is never read)
    for g, r in zip(got_state.kv, ref_state.kv):
        np.testing.assert_allclose(g.k[:, :, :n], r.k[:, :, :n], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g.v[:, :, :n], r.v[:, :, :n], rtol=1e-4, atol=1e-5)
    for field in ("valid", "length", "seen"):
        np.testing.assert_array_equal(getattr(got_state.positions, field), getattr(ref_state.positions, field))


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_torch_generate_through_the_fused_step_gives_the_reference_tokens(kind, monkeypatch):
    lm, numpy_lm = _models("falcon", kind)
    ids = torch.tensor([[3, 17, 5, 60]])
    with reference(torch_backend.FAST_OPS):
        want = lm.generate(ids, 8, eos_token_id=None)
    calls = _counting(monkeypatch, torch_backend.FAST_OPS)
    got = lm.generate(ids, 8, eos_token_id=None)
    assert calls and all(calls)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    np.testing.assert_array_equal(got.numpy(), numpy_lm.generate(ids.numpy(), 8, eos_token_id=None))


def test_the_model_is_planned_once_and_again_when_a_tensors_memory_changes(monkeypatch):
    lm, _ = _models("granite", "float32")
    made = []
    make = torch_hybrid.known_plan.make
    monkeypatch.setattr(torch_hybrid.known_plan, "make", lambda *a: made.append(1) or make(*a))
    _, state = lm.prefill(torch.tensor([[3, 17, 5]]), max_len=12)
    _steps(lm, state, [4, 9, 40], torch.tensor)
    assert len(made) == 1
    weight = lm.params["layers.1.mixer.q_proj.weight"]
    weight.data = weight.data * 3  # the same tensor object over new memory: the old memory is freed
    got, _ = _steps(lm, state, [4], torch.tensor)
    assert len(made) == 2
    with reference(torch_backend.FAST_OPS):
        want, _ = _steps(lm, state, [4], torch.tensor)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5 * np.abs(want[0]).max())


def test_a_model_the_kernel_does_not_compute_is_checked_once_not_per_token(monkeypatch):
    config = replace(CONFIGS["granite"], mlp=MLPSpec("gelu", True))
    lm = HybridLM({k: torch.from_numpy(v) for k, v in _params(config).items()}, config)
    made = []
    make = torch_hybrid.known_plan.make
    monkeypatch.setattr(torch_hybrid.known_plan, "make", lambda *a: made.append(1) or make(*a))
    calls = _counting(monkeypatch, torch_backend.FAST_OPS)
    _steps(lm, lm.empty_state(1, 6), [4, 9, 40], torch.tensor)
    assert calls == [False] * 3 and len(made) == 1


def test_torch_kv_caches_are_written_in_place_after_the_first_fused_step():
    lm, _ = _models("granite", "float32")
    _, start = lm.prefill(torch.tensor([[3, 17, 5]]), max_len=12)
    kept = [kv.k.clone() for kv in start.kv]
    _, state = lm.step(torch.tensor([4]), start)  # the prefill's caches: copied once
    assert all(kv.k.data_ptr() != s.k.data_ptr() for kv, s in zip(state.kv, start.kv))
    for kv, k in zip(start.kv, kept):
        torch.testing.assert_close(kv.k, k, rtol=0, atol=0)
    addresses = [(kv.k.data_ptr(), kv.v.data_ptr()) for kv in state.kv]
    for t in (9, 40, 2, 7):
        _, state = lm.step(torch.tensor([t]), state)
        assert [(kv.k.data_ptr(), kv.v.data_ptr()) for kv in state.kv] == addresses


def test_a_torch_state_stepped_twice_branches_without_changing_any_returned_state(monkeypatch):
    lm, _ = _models("granite", "float32")
    _, start = lm.prefill(torch.tensor([[3, 17, 5]]), max_len=12)
    calls = _counting(monkeypatch, torch_backend.FAST_OPS)
    _, one = lm.step(torch.tensor([4]), start)  # the caches now belong to the fused path: written in place next
    kept = [(kv.k.clone(), kv.v.clone()) for kv in one.kv]
    a_logits, a = lm.step(torch.tensor([9]), one)  # in place: slot 4 of one's buffers
    b_logits, b = lm.step(torch.tensor([40]), one)  # the same slot again: must go to a copy
    a_next, _ = lm.step(torch.tensor([2]), a)
    for kv, (k, v) in zip(one.kv, kept):  # one's own slots are as they were
        torch.testing.assert_close(kv.k[:, :, :4], k[:, :, :4], rtol=0, atol=0)
        torch.testing.assert_close(kv.v[:, :, :4], v[:, :, :4], rtol=0, atol=0)
    with reference(torch_backend.FAST_OPS):
        want_a, ref_a = lm.step(torch.tensor([9]), one)
        want_b, _ = lm.step(torch.tensor([40]), one)
        want_next, _ = lm.step(torch.tensor([2]), ref_a)
    for got, want in ((a_logits, want_a), (b_logits, want_b), (a_next, want_next)):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    assert calls == [True] * 4
    assert all(x.k.data_ptr() != y.k.data_ptr() for x, y in zip(a.kv, b.kv))


def test_a_torch_decode_loops_states_reach_numpy_as_the_arrays_under_them(monkeypatch):
    """The states a step hands out, handed back, reach NumPy's hook as the very arrays its step
    made (taken without a check per array); clones of them as new views; both step to the same
    floats, and a state autograd would record never takes that path."""
    lm, _ = _models("granite", "int8")
    _, start = lm.prefill(torch.tensor([[3, 17, 5]]), max_len=12)
    _, state = lm.step(torch.tensor([4]), start)
    mamba = (*state.conv, *state.ssm)
    arrays = torch_hybrid._handed_back(mamba)
    assert arrays is not None and [a.ctypes.data for a in arrays] == [t.data_ptr() for t in mamba]
    cloned = state._replace(conv=tuple(t.clone() for t in state.conv), ssm=tuple(t.clone() for t in state.ssm))
    assert torch_hybrid._handed_back((*cloned.conv, *cloned.ssm)) is None
    seen = []
    hook = torch_hybrid.hybrid.decode_hybrid_hook
    monkeypatch.setattr(torch_hybrid.hybrid, "decode_hybrid_hook",
                        lambda x, given, *a, **kw: seen.append(given.ssm[0]) or hook(x, given, *a, **kw))
    logits, after = lm.step(torch.tensor([9]), state)
    clone_logits, clone_next = lm.step(torch.tensor([9]), cloned)
    assert seen[0] is arrays[len(state.conv)] and seen[1] is not arrays[len(state.conv)]
    torch.testing.assert_close(logits, clone_logits, rtol=0, atol=0)
    for x, y in zip((*after.conv, *after.ssm), (*clone_next.conv, *clone_next.ssm)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    state.ssm[0].requires_grad_()
    assert torch_hybrid.decode_hybrid(torch.zeros(1, CONFIGS["granite"].d_model), state, after.positions,
                                      lm.params, lm.config) is None


def test_tensors_autograd_records_take_the_reference_step(monkeypatch):
    lm, _ = _models("granite", "int8")
    _, state = lm.prefill(torch.tensor([[3, 17]]), max_len=6)
    lm.params["layers.0.mixer_norm.weight"].requires_grad_()
    calls = _counting(monkeypatch, torch_backend.FAST_OPS)
    logits, _ = lm.step(torch.tensor([4]), state)
    assert calls == [False] and logits.requires_grad
    with torch.no_grad():
        logits, _ = lm.step(torch.tensor([4]), state)
    assert calls == [False, True] and not logits.requires_grad


def test_other_dtypes_and_batches_take_the_reference_step(monkeypatch):
    config = CONFIGS["granite"]
    lm = HybridLM({k: torch.from_numpy(v.astype(np.float64)) for k, v in _params(config).items()}, config)
    calls = _counting(monkeypatch, torch_backend.FAST_OPS)
    lm.step(torch.tensor([4]), lm.empty_state(1, 4))
    lm32, _ = _models("granite", "float32")
    lm32.step(torch.tensor([4, 5]), lm32.empty_state(2, 4))
    assert calls == [False, False]


def test_numpy_views_share_the_weights_memory():
    lm, numpy_lm = _models("granite", "bfloat16")
    name = "layers.0.mixer.in_proj.weight"
    w, view = lm.params[name], numpy_lm.params[name]
    assert isinstance(view, QuantizedWeight) and view.data.dtype == np.uint16
    assert view.data.ctypes.data == w.data.data_ptr()
