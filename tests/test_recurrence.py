"""The sequential recurrence: hand-checked numbers, the state on the right side, a pure step."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, tol
from test_scan import on, oracle, scan_inputs

import portable_ssm as ps


def test_one_step_by_hand():
    # one head, p=2, n=3: H = exp(Δ·A)·H0 + Δ·outer(x, B); y = H @ C
    x, B, C = np.array([[[1.0, 2.0]]]), np.array([[[1.0, 0.0, -1.0]]]), np.array([[[0.5, 1.0, 2.0]]])
    H0 = np.arange(6.0).reshape(1, 1, 2, 3)
    dt, A = np.array([[0.5]]), np.array([-2.0])
    y, H = ps.ssd_step(H0, x, dt, A, B, C)
    H_expected = np.exp(-1.0) * H0 + 0.5 * np.outer([1.0, 2.0], [1.0, 0.0, -1.0])[None, None]
    np.testing.assert_allclose(H, H_expected, rtol=1e-15)
    np.testing.assert_allclose(y, (H_expected @ C[..., None])[..., 0], rtol=1e-15)  # [p, n] @ [n]


def test_step_loop_equals_selective_scan(xp, dtype):
    host = scan_inputs(21, 2, 11, 4, 3, 2, 5)
    y_ref, s_ref = oracle(host)
    args = on(xp, host, dtype)
    state, ys = args.pop("initial_states"), []
    for t in range(11):
        y_t, state = xp.call(ps.ssd_step, state, args["x"][:, t, ...], args["dt"][:, t, ...], args["A"],
                             args["B"][:, t, ...], args["C"][:, t, ...], D=args["D"], z=args["z"][:, t, ...],
                             dt_bias=args["dt_bias"], dt_softplus=True)
        ys.append(xp.numpy(y_t))
    assert_close(xp, state, s_ref, rtol=tol(dtype), dtype=dtype)
    np.testing.assert_allclose(np.stack(ys, axis=1), y_ref, rtol=0, atol=tol(dtype) * np.abs(y_ref).max())


def test_step_returns_a_new_state_and_leaves_the_input_untouched(xp):
    host = scan_inputs(2, 1, 1, 2, 2, 1, 3)
    args = on(xp, {k: v[:, 0] if k not in ("A", "D", "dt_bias", "initial_states") else v
                   for k, v in host.items()}, "float64")
    state = args.pop("initial_states")
    before = xp.numpy(state).copy()
    _, new_state = ps.ssd_step(state, **args, dt_softplus=True)
    assert np.array_equal(xp.numpy(state), before)
    assert not np.array_equal(xp.numpy(new_state), before)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs_compute_in_float32(dtype):
    torch = pytest.importorskip("torch")
    host = scan_inputs(4, 1, 40, 2, 4, 1, 4, with_state=False)
    t = {k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in host.items() if v is not None}
    y, state = ps.ssd_scan(**t, dt_softplus=True, return_final_states=True, chunk_size=16)
    assert y.dtype == getattr(torch, dtype) and state.dtype == torch.float32
    rounded = {k: v.float().double().numpy() for k, v in t.items()}
    y_ref, s_ref = ps.selective_scan(**rounded, dt_softplus=True, return_final_states=True)
    assert np.abs(state.double().numpy() - s_ref).max() <= 1e-4 * np.abs(s_ref).max()
    assert np.abs(y.double().numpy() - y_ref).max() <= 2e-2 * np.abs(y_ref).max()
