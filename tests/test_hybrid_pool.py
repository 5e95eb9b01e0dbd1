"""HybridLM's state pool: a step over ``state_batch_indices`` slots of a pool of HybridStates
(SSM, conv and KV caches, per-slot positions) gives each request what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
from test_families import NUMPY, case  # noqa: F401  (the module-scoped tiny model of each family)

import portable_ssm

pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_LEN = 16


def _alone(lm, xp, prompt, tokens, max_len=MAX_LEN):
    """The logits of ``prompt`` then each of ``tokens`` stepped alone: ``[len(tokens) + 1, V]``."""
    logits, state = lm.prefill(xp.asarray_from(prompt[None, :], "int64"), max_len=max_len)
    out = [xp.numpy(logits)[0, -1]]
    for t in tokens:
        logits, state = lm.step(xp.asarray_from(np.array([t]), "int64"), state)
        out.append(xp.numpy(logits)[0])
    return np.stack(out)


def test_pool_steps_give_each_request_what_it_gets_alone(xp, case):  # noqa: F811
    lm = portable_ssm.load_pretrained(case["folder"], backend=xp.name, device=xp.device)
    a, b = case["ids"][0, :6], case["ids"][1, 2:5]
    ta, tb = [5, 9, 11, 3, 6], [7, 2, 8]
    pool = lm.empty_state(3, MAX_LEN)
    for slot, prompt in ((2, a), (0, b)):
        _, rows = lm.prefill(xp.asarray_from(prompt[None, :], "int64"), max_len=MAX_LEN)
        pool = lm.pool_put(pool, xp.asarray_from(np.array([slot]), "int64"), rows)
    got_a, got_b = [], []
    # both step, then only a (b waits), then both again with the rows in the other order
    for which in (("a", "b"), ("a",), ("b", "a"), ("b", "a"), ("a",)):
        rows = [(2, ta[len(got_a)]) if w == "a" else (0, tb[len(got_b)]) for w in which]
        slots = xp.asarray_from(np.array([s for s, _ in rows]), "int64")
        logits, pool = lm.step(xp.asarray_from(np.array([t for _, t in rows]), "int64"), pool,
                               state_batch_indices=slots)
        for w, row in zip(which, xp.numpy(logits)):
            (got_a if w == "a" else got_b).append(row)
    want_a, want_b = _alone(lm, xp, a, ta), _alone(lm, xp, b, tb)
    _assert_as_alone(got_a, want_a)
    _assert_as_alone(got_b, want_b)


def _assert_as_alone(got, want):
    """A request's pool-step logits ``got`` match its steps alone ``want[1:]`` (1e-4 of its largest)."""
    assert len(got) == len(want) - 1
    assert np.abs(np.stack(got) - want[1:]).max() <= 1e-4 * np.abs(want).max()


def _put(lm, xp, pool, slot, prompt, max_len):
    """``pool`` with ``prompt``'s prefill state (of ``max_len`` slots) in ``slot``."""
    _, rows = lm.prefill(xp.asarray_from(prompt[None, :], "int64"), max_len=max_len)
    return lm.pool_put(pool, xp.asarray_from(np.array([slot]), "int64"), rows)


def _pool_step(lm, xp, pool, pairs):
    """One pool step of ``pairs`` ``[(slot, token)]``: ``(logits rows [len(pairs), V], new pool)``."""
    slots = xp.asarray_from(np.array([s for s, _ in pairs]), "int64")
    logits, pool = lm.step(xp.asarray_from(np.array([t for _, t in pairs]), "int64"), pool, state_batch_indices=slots)
    return xp.numpy(logits), pool


def test_pool_of_max_len_m_serves_far_more_than_m_steps_each_request_as_alone(xp, case):  # noqa: F811
    """Requests of a few tokens enter free slots, step (not every pool step) and leave, over more
    than 3·M pool steps: each slot's KV caches fill per request, so max_len bounds each request."""
    lm = portable_ssm.load_pretrained(case["folder"], backend=xp.name, device=xp.device)
    m, ids = 6, case["ids"].reshape(-1)
    # 11 requests of m tokens each (prompt and new)
    requests = [(ids[r:r + 2 + r % 2], [int(ids[(r + 5 + k) % ids.size]) for k in range(m - 2 - r % 2)])
                for r in range(11)]
    pool, queue, active, got, steps = lm.empty_state(2, m), list(range(len(requests))), {}, {}, 0
    while queue or active:
        for slot in (0, 1):
            if slot not in active and queue:
                r = active[slot] = queue.pop(0)
                pool, got[r] = _put(lm, xp, pool, slot, requests[r][0], m), []
        # a slot waits one step in three; the rows go in turns of order
        pairs = [(s, requests[r][1][len(got[r])]) for s, r in active.items() if (steps + s) % 3 != 2]
        if pairs:
            logits, pool = _pool_step(lm, xp, pool, pairs[::-1] if steps % 2 else pairs)
            for (s, _), row in zip(pairs[::-1] if steps % 2 else pairs, logits):
                got[active[s]].append(row)
        active = {s: r for s, r in active.items() if len(got[r]) < len(requests[r][1])}
        steps += 1
    assert steps > 3 * m
    for r, (prompt, tokens) in enumerate(requests):
        _assert_as_alone(got[r], _alone(lm, xp, prompt, tokens, m))


def test_pool_request_entering_late_gets_the_whole_max_len(xp, case):  # noqa: F811
    """A request put into a slot after another filled its max_len still holds max_len tokens."""
    lm = portable_ssm.load_pretrained(case["folder"], backend=xp.name, device=xp.device)
    m, ids = 6, case["ids"]
    pool = _put(lm, xp, lm.empty_state(2, m), 0, ids[0, :2], m)
    for t in ids[1, :m - 2]:
        _, pool = _pool_step(lm, xp, pool, [(0, int(t))])
    late, tokens = ids[1, 2:4], [int(t) for t in ids[0, 3:3 + m - 2]]
    pool, got = _put(lm, xp, pool, 1, late, m), []
    for t in tokens:
        logits, pool = _pool_step(lm, xp, pool, [(1, t)])
        got.append(logits[0])
    _assert_as_alone(got, _alone(lm, xp, late, tokens, m))


def test_pool_row_without_room_is_named_with_its_slot(case):  # noqa: F811
    lm = portable_ssm.load_pretrained(case["folder"])
    pool = _put(lm, NUMPY, lm.empty_state(3, 4), 2, case["ids"][0, :4], 4)
    pool = _put(lm, NUMPY, pool, 0, case["ids"][1, :2], 4)
    with pytest.raises(ValueError, match=r"row 1 \(pool slot 2\) has 4 of its max_len = 4"):
        lm.step(np.array([3, 5]), pool, state_batch_indices=np.array([0, 2]))
    _, pool = lm.step(np.array([3]), pool, state_batch_indices=np.array([0]))  # slot 0 still has room


def test_pool_indices_are_checked_naming_them(case):  # noqa: F811
    lm = portable_ssm.load_pretrained(case["folder"])
    pool = lm.empty_state(2, MAX_LEN)
    token = np.array([1, 2])
    with pytest.raises(ValueError, match="state_batch_indices.*distinct"):
        lm.step(token, pool, state_batch_indices=np.array([1, 1]))
    with pytest.raises(ValueError, match=r"state_batch_indices.*\[0, 2\)"):
        lm.step(token, pool, state_batch_indices=np.array([0, 2]))
    with pytest.raises(TypeError, match="state_batch_indices"):
        lm.step(token, pool, state_batch_indices=np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="max_len"):
        lm.pool_put(pool, np.array([0]), lm.empty_state(1, MAX_LEN + 1))
