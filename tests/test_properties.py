"""Property tests over shapes (hypothesis): for any shape, chunk size and split point the chunked scan
equals the recurrence, and scanning in two pieces with the carried state equals scanning at once."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_scan import scan_inputs

import portable_ssm as ps


@st.composite
def shapes(draw):
    g = draw(st.integers(1, 3))
    h = g * draw(st.integers(1, 3))
    return dict(b=draw(st.integers(1, 3)), l=draw(st.integers(1, 90)), h=h, p=draw(st.integers(1, 5)), g=g,
                n=draw(st.integers(1, 6)))


def close(a, b):
    if a.shape != b.shape:
        return False
    return a.size == 0 or np.abs(a - b).max() <= 1e-10 * max(np.abs(b).max(), 1e-300)


@settings(max_examples=60, deadline=None)
@given(s=shapes(), Q=st.one_of(st.none(), st.integers(1, 100)), seed=st.integers(0, 2**16))
def test_chunked_scan_equals_recurrence_for_any_shape(s, Q, seed):
    host = scan_inputs(seed, s["b"], s["l"], s["h"], s["p"], s["g"], s["n"], dt_scale=2.0)
    y_ref, s_ref = ps.selective_scan(**host, dt_softplus=True, return_final_states=True)
    y, final = ps.ssd_scan(**host, chunk_size=Q, dt_softplus=True, return_final_states=True)
    assert y.shape == y_ref.shape and final.shape == (s["b"], s["h"], s["p"], s["n"])
    assert close(y, y_ref) and close(final, s_ref)


@settings(max_examples=40, deadline=None)
@given(s=shapes(), cut=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
@example(s=dict(b=1, l=5, h=2, p=2, g=1, n=3), cut=1.0, seed=0)  # an empty second piece
@example(s=dict(b=1, l=5, h=2, p=2, g=1, n=3), cut=0.0, seed=0)  # an empty first piece
def test_split_scan_with_carried_state_equals_whole(s, cut, seed):
    host = scan_inputs(seed, s["b"], s["l"], s["h"], s["p"], s["g"], s["n"])
    k = int(cut * s["l"])
    whole, end = ps.ssd_scan(**host, dt_softplus=True, return_final_states=True)
    seq = ("x", "dt", "B", "C", "z")
    first = {k_: (v[:, :k] if k_ in seq else v) for k_, v in host.items()}
    second = {k_: (v[:, k:] if k_ in seq else v) for k_, v in host.items()}
    if k == 0:
        mid = host["initial_states"]
    else:
        y1, mid = ps.ssd_scan(**first, dt_softplus=True, return_final_states=True)
        assert close(y1, whole[:, :k])
    y2, end2 = ps.ssd_scan(**(second | {"initial_states": mid}), dt_softplus=True, return_final_states=True)
    assert close(y2, whole[:, k:]) and close(end2, end)
