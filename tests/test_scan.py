"""The chunked scan, the sequential recurrence and the step agree, on every backend and dtype."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, tol

import portable_ssm as ps


def scan_inputs(rng, b, l, h, p, g, n, *, dt_scale=1.0, with_state=True):
    """Random float64 host inputs for the scans (A negative, as -exp(A_log))."""
    return dict(
        x=rng.standard_normal((b, l, h, p)),
        dt=dt_scale * rng.standard_normal((b, l, h)),
        A=-np.exp(rng.uniform(-1.0, 1.5, h)),
        B=rng.standard_normal((b, l, g, n)),
        C=rng.standard_normal((b, l, g, n)),
        D=rng.standard_normal(h),
        z=rng.standard_normal((b, l, h, p)),
        dt_bias=rng.standard_normal(h),
        initial_states=rng.standard_normal((b, h, p, n)) if with_state else None,
    )


def to_xp(xp, host, dtype):
    return {k: None if v is None else xp.asarray_from(v, dtype) for k, v in host.items()}


SHAPES = [  # (b, l, h, p, g, n, chunk_size)
    (1, 1, 1, 1, 1, 1, None),
    (2, 7, 4, 3, 2, 5, 3),
    (2, 64, 6, 4, 3, 8, 16),
    (1, 65, 4, 8, 1, 16, None),
    (3, 130, 8, 2, 4, 4, 32),
    (1, 300, 2, 4, 2, 6, 64),
]


@pytest.mark.parametrize("b,l,h,p,g,n,Q", SHAPES)
def test_ssd_scan_equals_selective_scan(xp, dtype, b, l, h, p, g, n, Q):
    host = scan_inputs(np.random.default_rng(l * 7 + h), b, l, h, p, g, n)
    args = to_xp(xp, host, dtype)
    args["initial_states"] = xp.asarray_from(host["initial_states"], dtype)
    kw = dict(dt_softplus=True, return_final_states=True)
    y_ref, s_ref = ps.selective_scan(**args, **kw)
    y, s = ps.ssd_scan(**args, chunk_size=Q, **kw)
    assert_close(xp, y, xp.numpy(y_ref), rtol=tol(dtype), dtype=dtype, shape=(b, l, h, p))
    assert_close(xp, s, xp.numpy(s_ref), rtol=tol(dtype), dtype=dtype, shape=(b, h, p, n))
