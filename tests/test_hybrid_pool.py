"""HybridLM's state pool: a step over ``state_batch_indices`` slots of a pool of HybridStates
(SSM, conv and KV caches, per-slot positions) gives each request what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
from test_families import case  # noqa: F401  (the module-scoped tiny model of each family)

import portable_ssm

pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_LEN = 16


def _alone(lm, xp, prompt, tokens):
    """The logits of ``prompt`` then each of ``tokens`` stepped alone: ``[len(tokens) + 1, V]``."""
    logits, state = lm.prefill(xp.asarray_from(prompt[None, :], "int64"), max_len=MAX_LEN)
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
    scale = np.abs(want_a).max()
    assert np.abs(np.stack(got_a) - want_a[1:]).max() <= 1e-4 * scale
    assert np.abs(np.stack(got_b) - want_b[1:]).max() <= 1e-4 * scale


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
