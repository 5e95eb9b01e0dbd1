"""Hostile input to the serving surfaces: the state pool (``write_state``, the pool step through
``state_batch_indices``) and ``examples/serve_batch.py``'s ``serve`` loop.

A state of another layer count, dtype, backend, d_state, head size or batch is never written into
a pool (which would change its shape or dtype, or broadcast): a TypeError/ValueError naming the
layer; slots that are float, bool, repeated or out of range are refused; a request that is not a
non-empty prompt of ids with an int budget and arrival is refused naming it, and no request makes
``serve`` loop forever. The property tests throw arbitrary states, slots and requests at them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import portable_ssm as ps
from portable_ssm import lm
from portable_ssm.state_pool import write_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import serve_batch  # noqa: E402
from serve_batch import Request  # noqa: E402

CONFIG = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, vocab_size=40, pad_vocab_size_multiple=8)
PARAMS = ps.init_params(CONFIG, seed=0)
LIKE = PARAMS["embedding.weight"]
POOL = ps.empty_state(CONFIG, 4, LIKE)


def state(config: ps.Mamba2Config = CONFIG, batch: int = 1, dtype: Any = None, seed: int = 0) -> ps.Mamba2State:
    """A random state of ``config`` (float32, or every layer in ``dtype``)."""
    rng = np.random.default_rng(seed)
    zero = ps.empty_state(config, batch, LIKE)
    return ps.Mamba2State(*(tuple(rng.standard_normal(a.shape).astype(dtype or a.dtype) for a in part)
                            for part in zero))


def other(**changes: Any) -> ps.Mamba2State:
    return state(dataclasses.replace(CONFIG, **changes))


def _torch_state() -> ps.Mamba2State:
    torch = pytest.importorskip("torch")
    return ps.Mamba2State(*(tuple(torch.as_tensor(a) for a in part) for part in state()))


SLOT = np.asarray([1])

CASES: list[tuple[str, type[Exception], str, Callable[[], Any]]] = [
    ("write-other-layer-count", ValueError, "state.conv", lambda: write_state(POOL, SLOT, other(n_layer=1))),
    ("write-more-layers", ValueError, "state.conv", lambda: write_state(POOL, SLOT, other(n_layer=3))),
    ("write-float64", TypeError, "state.conv[0]", lambda: write_state(POOL, SLOT, state(dtype=np.float64))),
    ("write-float16", TypeError, "state.conv[0]", lambda: write_state(POOL, SLOT, state(dtype=np.float16))),
    ("write-other-d-state", ValueError, "state.conv[0]", lambda: write_state(POOL, SLOT, other(d_state=4))),
    ("write-other-headdim", ValueError, "state.ssm[0]", lambda: write_state(POOL, SLOT, other(headdim=4))),
    ("write-other-d-conv", ValueError, "state.conv[0]", lambda: write_state(POOL, SLOT, other(d_conv=3))),
    ("write-batch-2-one-slot", ValueError, "state_batch_indices",
     lambda: write_state(POOL, SLOT, state(batch=2))),
    ("write-torch-state", TypeError, "state.conv[0]", lambda: write_state(POOL, SLOT, _torch_state())),
    ("write-state-tuple", TypeError, "state", lambda: write_state(POOL, SLOT, tuple(state()))),
    ("write-state-None", TypeError, "state", lambda: write_state(POOL, SLOT, None)),
    ("write-pool-dict", TypeError, "pool", lambda: write_state({"ssm": POOL.ssm}, SLOT, state())),
    ("write-state-layer-list", TypeError, "state.conv[0]",
     lambda: write_state(POOL, SLOT, ps.Mamba2State(conv=([0.0],) * 2, ssm=state().ssm))),
    ("write-state-no-layers", TypeError, "state", lambda: write_state(POOL, SLOT, ps.Mamba2State((), ()))),
    ("write-mixed-slot-counts", ValueError, "pool.conv[1]",
     lambda: write_state(POOL._replace(conv=(POOL.conv[0], POOL.conv[1][:2])), SLOT, state())),
    ("write-slots-float", TypeError, "state_batch_indices", lambda: write_state(POOL, np.asarray([1.0]), state())),
    ("write-slots-bool", TypeError, "state_batch_indices", lambda: write_state(POOL, np.asarray([True]), state())),
    ("write-slots-repeated", ValueError, "state_batch_indices",
     lambda: write_state(POOL, np.asarray([2, 2]), state(batch=2))),
    ("write-slots-out-of-range", ValueError, "state_batch_indices",
     lambda: write_state(POOL, np.asarray([4]), state())),
    ("write-slots-negative", ValueError, "state_batch_indices", lambda: write_state(POOL, np.asarray([-1]), state())),
    ("write-slots-list", TypeError, "state_batch_indices", lambda: write_state(POOL, [1], state())),
    ("write-slots-rank-2", ValueError, "state_batch_indices", lambda: write_state(POOL, np.asarray([[1]]), state())),
    ("step-pool-other-layers", ValueError, "state.conv",
     lambda: lm.logits_step(np.asarray([1]), ps.empty_state(dataclasses.replace(CONFIG, n_layer=1), 4,
                                                            LIKE), PARAMS, config=CONFIG, state_batch_indices=SLOT)),
    ("step-pool-float64", TypeError, "state.conv[0]",
     lambda: lm.logits_step(np.asarray([1]), state(batch=4, dtype=np.float64), PARAMS, config=CONFIG,
                            state_batch_indices=SLOT)),
    ("step-pool-other-d-state", ValueError, "state.conv[0]",
     lambda: lm.logits_step(np.asarray([1]), ps.empty_state(dataclasses.replace(CONFIG, d_state=4), 4,
                                                            LIKE), PARAMS, config=CONFIG, state_batch_indices=SLOT)),
    ("step-indices-bool", TypeError, "state_batch_indices",
     lambda: lm.logits_step(np.asarray([1]), POOL, PARAMS, config=CONFIG, state_batch_indices=np.asarray([True]))),
    ("step-indices-float", TypeError, "state_batch_indices",
     lambda: lm.logits_step(np.asarray([1]), POOL, PARAMS, config=CONFIG, state_batch_indices=np.asarray([1.0]))),
    ("step-indices-repeated", ValueError, "state_batch_indices",
     lambda: lm.logits_step(np.asarray([1, 2]), POOL, PARAMS, config=CONFIG, state_batch_indices=np.asarray([3, 3]))),
    ("step-indices-count", ValueError, "state_batch_indices",
     lambda: lm.logits_step(np.asarray([1, 2]), POOL, PARAMS, config=CONFIG, state_batch_indices=SLOT)),
    ("step-token-float", TypeError, "token",
     lambda: lm.logits_step(np.asarray([1.0]), POOL, PARAMS, config=CONFIG, state_batch_indices=SLOT)),
    ("step-token-None", TypeError, "token",
     lambda: lm.logits_step(None, POOL, PARAMS, config=CONFIG, state_batch_indices=SLOT)),
]


@pytest.mark.parametrize("name, error, argument, call", CASES, ids=[c[0] for c in CASES])
def test_hostile_pool_input_raises_the_documented_error_naming_it(name: str, error: type[Exception], argument: str,
                                                                call: Callable[[], Any]) -> None:
    with pytest.raises(error) as info:
        call()
    assert argument in str(info.value), f"{name}: the message does not name {argument!r}: {info.value}"


def test_a_refused_write_leaves_the_pool_as_it_was() -> None:
    pool = state(batch=4, seed=3)
    before = [a.copy() for part in pool for a in part]
    with pytest.raises(TypeError):
        write_state(pool, SLOT, state(dtype=np.float64))
    for was, now in zip(before, (a for part in pool for a in part)):
        np.testing.assert_array_equal(was, now)


# --- serve_batch.serve ---

def _serve(requests: Any, slots: Any = 2, eos: Any = None) -> Any:
    return serve_batch.serve(PARAMS, CONFIG, requests, slots, eos_token_id=eos)


SERVE_CASES: list[tuple[str, type[Exception], str, Callable[[], Any]]] = [
    ("budget-negative", ValueError, "requests[1].max_new_tokens",
     lambda: _serve([Request((1,), 2), Request((1,), -1)])),
    ("budget-float", TypeError, "requests[0].max_new_tokens", lambda: _serve([Request((1,), 2.0)])),
    ("budget-bool", TypeError, "requests[0].max_new_tokens", lambda: _serve([Request((1,), True)])),
    ("prompt-empty", ValueError, "requests[0].prompt", lambda: _serve([Request((), 2)])),
    ("prompt-str", TypeError, "requests[0].prompt", lambda: _serve([Request("12", 2)])),
    ("prompt-float-id", TypeError, "requests[0].prompt[1]", lambda: _serve([Request((1, 2.5), 2)])),
    ("prompt-id-past-vocab", ValueError, "requests[0].prompt[0]", lambda: _serve([Request((40,), 2)])),
    ("arrival-negative", ValueError, "requests[0].arrival", lambda: _serve([Request((1,), 2, arrival=-1)])),
    ("arrival-float", TypeError, "requests[0].arrival", lambda: _serve([Request((1,), 2, arrival=0.5)])),
    ("request-tuple", TypeError, "requests[0]", lambda: _serve([((1,), 2)])),
    ("requests-generator", TypeError, "requests", lambda: _serve(Request((1,), 2) for _ in range(2))),
    ("slots-zero", ValueError, "slots", lambda: _serve([Request((1,), 2)], slots=0)),
    ("slots-float", TypeError, "slots", lambda: _serve([Request((1,), 2)], slots=2.0)),
    ("eos-past-vocab", ValueError, "eos_token_id", lambda: _serve([Request((1,), 2)], eos=40)),
    ("eos-bool", TypeError, "eos_token_id", lambda: _serve([Request((1,), 2)], eos=True)),
]


@pytest.mark.parametrize("name, error, argument, call", SERVE_CASES, ids=[c[0] for c in SERVE_CASES])
def test_a_bad_request_is_refused_naming_it_before_any_is_served(name: str, error: type[Exception], argument: str,
                                                                 call: Callable[[], Any], monkeypatch) -> None:
    monkeypatch.setattr(serve_batch.lm, "logits", lambda *a, **k: pytest.fail("a request was served"))
    with pytest.raises(error) as info:
        call()
    assert argument in str(info.value), f"{name}: the message does not name {argument!r}: {info.value}"


def test_a_zero_token_budget_ends_at_once_without_a_slot() -> None:
    requests = [Request((3, 4), 0), Request((5,), 3, arrival=1), Request((6,), 0, arrival=2)]
    outputs, _ = _serve(requests, slots=1)  # looped forever before: a budget of 0 was never reached
    assert outputs == [[], serve_batch.solo(PARAMS, CONFIG, requests[1]), []]


def test_a_zero_token_budget_behind_a_one_token_request_gets_no_token() -> None:
    requests = [Request((0,), 1), Request((0,), 0)]  # the first frees its slot at admission
    outputs, _ = _serve(requests, slots=1)  # the second was admitted into it and given a token before
    assert outputs == [serve_batch.solo(PARAMS, CONFIG, requests[0]), []]


VALID_REQUEST = st.builds(Request, prompt=st.lists(st.integers(0, 39), min_size=1, max_size=4).map(tuple),
                          max_new_tokens=st.integers(0, 4), arrival=st.integers(0, 3))
HOSTILE_FIELD = st.one_of(
    st.tuples(st.just("prompt"), st.lists(st.integers(-2, 45) | st.floats(0, 3) | st.booleans(), max_size=3).map(tuple)
              | st.text(max_size=2) | st.none()),
    st.tuples(st.just("max_new_tokens"), st.integers(-3, -1) | st.floats(0, 3) | st.booleans() | st.none()),
    st.tuples(st.just("arrival"), st.integers(-3, -1) | st.floats(0, 3) | st.text(max_size=1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(VALID_REQUEST, min_size=1, max_size=4), hostile=st.none() | st.tuples(st.integers(0, 3),
                                                                                               HOSTILE_FIELD),
       slots=st.one_of(*[st.integers(1, 3)] * 6, st.integers(-1, 0), st.floats(1, 3)),
       eos=st.one_of(*[st.none()] * 3, *[st.integers(0, 39)] * 3, st.integers(-1, 45), st.booleans()))
def test_serve_either_gives_every_request_its_solo_tokens_or_refuses_naming_it(
        requests: list[Request], hostile: tuple[int, tuple[str, Any]] | None, slots: Any, eos: Any) -> None:
    if hostile is not None:
        at, (field, value) = hostile
        at %= len(requests)
        requests[at] = dataclasses.replace(requests[at], **{field: value})
    try:
        outputs, _ = _serve(requests, slots, eos)
    except (ValueError, TypeError) as err:
        assert any(n in str(err) for n in ("requests[", "slots", "eos_token_id")), str(err)
        event("refused")
        return
    event("served")
    assert outputs == [serve_batch.solo(PARAMS, CONFIG, r, eos_token_id=eos) for r in requests]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change=st.one_of(*[st.just({})] * 4, st.sampled_from([{"n_layer": 1}, {"n_layer": 3}, {"d_state": 4},
                                                             {"headdim": 4}, {"d_conv": 2}])),
       dtype=st.one_of(*[st.just(np.float32)] * 4, st.sampled_from([np.float64, np.float16])),
       order=st.permutations(range(4)), batch=st.integers(1, 3),
       bad_slots=st.none() | st.none() | st.lists(st.integers(-1, 4) | st.floats(0, 3) | st.booleans(), max_size=3))
def test_write_state_writes_only_a_state_of_the_pools_kind_into_valid_slots(change: dict[str, int], dtype: Any,
                                                                            order: list[int], batch: int,
                                                                            bad_slots: list[Any] | None) -> None:
    new_state = state(dataclasses.replace(CONFIG, **change), batch, dtype)
    slots = order[:batch] if bad_slots is None else bad_slots
    try:
        pool = write_state(POOL, np.asarray(slots), new_state)
    except (ValueError, TypeError) as err:
        assert "state" in str(err) or "pool" in str(err), str(err)
        event("refused")
        return
    event("written")
    assert not change and dtype is np.float32 and len(set(slots)) == len(slots) == batch
    for got, was, row in zip((*pool.conv, *pool.ssm), (*POOL.conv, *POOL.ssm), (*new_state.conv, *new_state.ssm)):
        assert got.shape == was.shape and got.dtype == was.dtype
        np.testing.assert_array_equal(got[np.asarray(slots)], row)
