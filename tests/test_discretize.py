"""Discretization: Δ per head and per step, Ā = exp(Δ·A) (zero-order hold), float32 at least."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import portable_ssm as ps


def test_delta_is_per_head_and_per_step_never_averaged(xp):
    dt = np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 10 - 1.0
    delta, _ = ps.discretize(xp.asarray_from(dt, "float64"), xp.asarray_from(-np.ones(4), "float64"))
    assert_close(xp, delta, np.maximum(dt, 0.0), rtol=0, dtype="float64", shape=(2, 3, 4))
    assert len(np.unique(xp.numpy(delta)[xp.numpy(delta) > 0])) == int((dt > 0).sum())


def test_a_bar_is_exp_of_delta_a_not_first_order(xp):
    dt, A = np.array([[0.5, 2.0, 8.0]]), np.array([-1.0, -3.0, -0.25])
    _, a_bar = ps.discretize(xp.asarray_from(dt, "float64"), xp.asarray_from(A, "float64"))
    assert_close(xp, a_bar, np.exp(dt * A), rtol=1e-15)
    assert np.all(xp.numpy(a_bar) > 0)  # 1 + Δ·A would be negative here: -5, ...
    assert not np.allclose(xp.numpy(a_bar), 1 + dt * A)


def test_softplus_bias_and_limit(xp):
    dt, bias = np.array([[-3.0, 0.0, 2.0, 40.0]]), np.array([0.5, -0.5, 0.0, 1.0])
    delta, _ = ps.discretize(xp.asarray_from(dt, "float64"), xp.asarray_from(-np.ones(4), "float64"),
                             dt_bias=xp.asarray_from(bias, "float64"), dt_softplus=True, dt_limit=(0.1, 10.0))
    assert_close(xp, delta, np.clip(np.log1p(np.exp(dt + bias)), 0.1, 10.0), rtol=1e-14)


def test_softplus_is_finite_for_huge_arguments():
    dt = np.array([[-1e4, -80.0, 0.0, 80.0, 1e4]], dtype=np.float32)
    delta, a_bar = ps.discretize(dt, -np.ones(5, np.float32), dt_softplus=True)
    assert np.isfinite(delta).all() and np.isfinite(a_bar).all()
    np.testing.assert_allclose(delta[0, 3:], [80.0, 1e4], rtol=1e-6)
    assert delta[0, 0] == 0.0 and a_bar[0, -1] == 0.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_dt_is_discretized_in_float32(dtype):
    torch = pytest.importorskip("torch")
    dt = torch.linspace(-2, 2, 8, dtype=getattr(torch, dtype)).reshape(2, 4)
    delta, a_bar = ps.discretize(dt, -torch.ones(4, dtype=getattr(torch, dtype)), dt_softplus=True)
    assert delta.dtype == torch.float32 and a_bar.dtype == torch.float32


def test_float64_stays_float64(xp):
    delta, a_bar = ps.discretize(xp.asarray_from(np.ones((1, 2)), "float64"),
                                 xp.asarray_from(-np.ones(2), "float64"))
    assert_close(xp, delta, np.ones((1, 2)), rtol=0, dtype="float64")
    assert_close(xp, a_bar, np.exp(-np.ones((1, 2))), rtol=1e-15, dtype="float64")
