"""NumPy's native paths split over a thread pool: the split results equal the one-thread ones
and the array-API references, the BLAS is held at one thread only while the pool runs, and the
pool size comes from the environment."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rel_err
from portable_ssm.backends import load
from portable_ssm.backends.numpy import ops, threads

from portable_ssm import conv, norm, ssd
from portable_ssm._array import silu

XP = load("numpy").namespace()


@pytest.fixture(params=[1, 3], ids=["inline", "3-workers"])
def workers(request, monkeypatch):
    """The pool's size for the test (3: more workers than this machine may have cores)."""
    monkeypatch.setattr(threads, "workers", lambda: request.param)
    return request.param


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_row_ranges_cover_every_row_once_in_at_most_one_range_per_worker(workers):
    for n, least in ((0, 4), (7, 4), (100, 4), (1000, 64), (129, 64)):
        ranges = threads.row_ranges(n, least)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and len(ranges) <= max(workers, 1)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert len(ranges) == 1 or all(stop - start >= least for start, stop in ranges)


def test_run_all_keeps_the_items_order(workers):
    assert threads.run_all(lambda i: i * i, range(10)) == [i * i for i in range(10)]
    assert threads.run_all(lambda i: -i, range(5), blas=True) == [0, -1, -2, -3, -4]


@pytest.mark.parametrize("name, value, want", [("PORTABLE_SSM_NUM_THREADS", "3", 3), ("OMP_NUM_THREADS", "2", 2),
                                               ("OPENBLAS_NUM_THREADS", "5", 5), ("OMP_NUM_THREADS", "x", None)])
def test_workers_come_from_the_first_thread_variable_set(monkeypatch, name, value, want):
    for var in ("PORTABLE_SSM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    threads.workers.cache_clear()
    try:
        assert threads.workers() == (want or len(__import__("os").sched_getaffinity(0)))
    finally:
        threads.workers.cache_clear()


def test_run_all_on_a_worker_of_the_pool_runs_inline(workers):
    """A pass split over the pool from inside one of its items (an expert's MLP, whose activation
    kernel splits its rows too) runs on that worker instead of waiting for the pool it holds."""
    got = threads.run_all(lambda i: threads.run_all(lambda j: 10 * i + j, range(5)), range(6))
    assert got == [[10 * i + j for j in range(5)] for i in range(6)]


def test_the_blas_is_held_at_one_thread_only_inside_and_restored_after():
    blas = threads._openblas()
    if blas is None:
        pytest.skip("NumPy's BLAS here is not an OpenBLAS this module can limit")
    get, _ = blas
    before = get()
    with threads.one_blas_thread() as limited:
        with threads.one_blas_thread():
            assert limited and get() == 1
        assert get() == 1  # the outer call still holds it
    assert get() == before


@pytest.mark.parametrize("m", [3, 15, 16, 300])
@pytest.mark.parametrize("n", [70, 1024])
def test_linear_equals_the_matmul_for_one_range_and_split_rows(workers, m, n):
    rows = _rng(1).standard_normal((m, 48)).astype(np.float32)
    weight = _rng(2).standard_normal((n, 48)).astype(np.float32)
    out = ops.linear(rows, weight)
    assert out.shape == (m, n) and out.dtype == np.float32
    assert out.strides[0] == 4 * (n + (ops.ROW_PAD if n == 1024 else 0))  # rows 4 KiB apart: widened
    assert rel_err(out, rows.astype(np.float64) @ weight.T.astype(np.float64)) < 1e-5


def test_split_conv_and_norm_equal_their_references(workers, monkeypatch):
    b, l, d, k = 2, 300, 24, 4
    monkeypatch.setattr(ops, "TILE_ELEMENTS", b * 30 * d)  # 10 conv tiles of 30 steps, 10 norm tiles of 60 rows
    x, weight, bias, state = (_rng(seed).standard_normal(shape).astype(np.float32)
                              for seed, shape in ((3, (b, l, d)), (4, (d, k)), (5, (d,)), (6, (b, d, k))))
    y, last = ops.causal_conv1d_silu(x, weight, bias, state)
    want, want_last = conv.causal_conv1d_ref(x, weight, bias, state, xp=XP)
    assert rel_err(y, silu(want, xp=XP)) < 1e-5 and np.array_equal(last, want_last)
    z, w = _rng(7).standard_normal((b, l, d)).astype(np.float32), _rng(8).random(d).astype(np.float32)
    assert rel_err(ops.gated_rms_norm(x, z, w, 2, 1e-5), norm.gated_rms_norm_ref(x, z, w, 2, 1e-5, xp=XP)) < 1e-5


def test_split_head_blocks_of_the_scan_equal_the_reference(workers):
    b, l, h, p, g, n = 2, 70, 6, 4, 2, 8  # 3 heads per group: a block per worker and group
    rng = _rng(9)
    x = rng.standard_normal((b, l, h, p)).astype(np.float32)
    dt = (rng.random((b, l, h)) * 0.5).astype(np.float32)
    A = -rng.random(h).astype(np.float32)
    B, C = (rng.standard_normal((b, l, g, n)).astype(np.float32) for _ in range(2))
    D = rng.random(h).astype(np.float32)
    S0 = rng.standard_normal((b, h, p, n)).astype(np.float32)
    y, final = ops.ssd_chunked(x, dt, A, B, C, 16, S0, D=D)
    want_y, want_final = ssd.ssd_chunked_ref(x, dt, A, B, C, chunk_size=16, initial_states=S0, xp=XP, D=D)
    assert rel_err(y, want_y) < 1e-5 and rel_err(final, want_final) < 1e-5
