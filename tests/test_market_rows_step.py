"""NumPy's market step of many rows in one call (backends/numpy/rows.py): the row kernel equals the
batch-1 whole-model step row by row bit for bit, sgemm equals it within float32 rounding, only the
named rows change, and bad inputs are refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from portable_ssm.backends.numpy import decode, kernels

import portable_ssm as ps

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="NumPy's compiled kernels are not built here")

CONFIG = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=8, expand=4, tie_embeddings=False)


def _plan_and_states(batch: int, seed: int = 0, kind: str = "float32", tiles: bool = False):
    params = ps.init_params(CONFIG, seed=seed, backend="numpy")
    rng = np.random.default_rng(seed)
    params = {**params, "lm_head.weight": rng.standard_normal((1, CONFIG.d_model)).astype(np.float32)}
    params = ps.quantize(params, kind)  # projections (and the head) as int8 or bfloat16 bits
    like = ps.empty_state(CONFIG, batch, params["norm_f.weight"])
    conv = [rng.standard_normal(a.shape).astype(np.float32) for a in like.conv]
    ssm = [rng.standard_normal(a.shape).astype(np.float32) for a in like.ssm]
    return decode.plan(params, CONFIG, tiles=tiles), conv, ssm


def _copies(arrays):
    return [a.copy() for a in arrays]


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("rows", [None, [4, 0, 7]], ids=["every row", "some rows out of order"])
def test_rows_stepped_together_by_the_row_kernel_equal_the_batch_1_step_bit_for_bit(rows, kind):
    from portable_ssm.backends.numpy.rows import RowsStep

    plan, conv, ssm = _plan_and_states(9, kind=kind)
    picked = np.arange(9) if rows is None else np.array(rows, dtype=np.int64)
    x = np.random.default_rng(1).standard_normal((picked.size, CONFIG.d_model)).astype(np.float32)
    conv_ref, ssm_ref = _copies(conv), _copies(ssm)
    want = decode.decode_rows_in_place(x, conv_ref, ssm_ref, picked, plan, threads=1)
    step = RowsStep(plan, gemm_rows=0)
    step.bind(conv, ssm)
    got = step(x, None if rows is None else picked)
    assert np.array_equal(got, want)
    for a, b in zip((*conv, *ssm), (*conv_ref, *ssm_ref)):
        assert np.array_equal(a, b)  # the rows not named are untouched in both


def test_rows_through_sgemm_equal_the_batch_1_step_within_float32_rounding():
    from portable_ssm.backends.numpy import rows as rows_module
    from portable_ssm.backends.numpy.threads import blas_sgemm

    if blas_sgemm() is None:
        pytest.skip("no OpenBLAS sgemm found beside NumPy")
    plan, conv, ssm = _plan_and_states(20)
    x = np.random.default_rng(2).standard_normal((20, CONFIG.d_model)).astype(np.float32)
    conv_ref, ssm_ref = _copies(conv), _copies(ssm)
    want = decode.decode_rows_in_place(x, conv_ref, ssm_ref, np.arange(20), plan, threads=1)
    step = rows_module.RowsStep(plan, gemm_rows=8)
    assert step._gemm_rows == 8
    step.bind(conv, ssm)
    got = step(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip((*conv, *ssm), (*conv_ref, *ssm_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_step_of_states_far_past_the_caches_streams_them_and_computes_the_same(monkeypatch):
    from portable_ssm.backends.numpy import rows as rows_module

    plan, conv, ssm = _plan_and_states(5)
    x = np.random.default_rng(3).standard_normal((5, CONFIG.d_model)).astype(np.float32)
    conv_ref, ssm_ref = _copies(conv), _copies(ssm)
    want = rows_module.RowsStep(plan, gemm_rows=0)
    want.bind(conv_ref, ssm_ref)
    monkeypatch.setattr(rows_module, "STREAM_BYTES", 0)
    step = rows_module.RowsStep(plan, gemm_rows=0)
    step.bind(conv, ssm)
    assert step._options[0] == 1
    assert np.array_equal(step(x), want(x))
    assert all(np.array_equal(a, b) for a, b in zip((*conv, *ssm), (*conv_ref, *ssm_ref)))


def test_bad_states_inputs_and_rows_are_refused_by_name():
    from portable_ssm.backends.numpy.rows import RowsStep

    plan, conv, ssm = _plan_and_states(3)
    step = RowsStep(plan)
    x = np.zeros((3, CONFIG.d_model), np.float32)
    with pytest.raises(ValueError, match="no states bound"):
        step(x)
    with pytest.raises(ValueError, match=r"ssm_states\[1\] must be a contiguous float32"):
        step.bind(conv, [ssm[0], ssm[1].astype(np.float64)])
    with pytest.raises(ValueError, match="conv_states must hold one array per layer"):
        step.bind(conv[:1], ssm)
    step.bind(conv, ssm)
    with pytest.raises(ValueError, match=r"u must be a contiguous float32 \[3, 32\]"):
        step(x[:, :16])
    with pytest.raises(ValueError, match=r"rows: expected int64 \[k\] in \[0, 3\)"):
        step(x[:1], np.array([3]))
    with pytest.raises(ValueError, match="rows: expected int64"):
        step(x[:1], np.array([1.0]))
    with pytest.raises(ValueError, match="gemm_rows"):
        RowsStep(plan, gemm_rows=-1)
    with pytest.raises(TypeError, match="decode.Plan"):
        RowsStep(dataclasses.asdict(plan))


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
def test_a_market_plans_rows_through_tiles_equal_each_row_stepped_alone_bit_for_bit(kind):
    """A market plan's weights (``tiles``: int8 through VNNI where the CPU has it): a row's logits and
    states do not depend on which rows step with it."""
    from portable_ssm.backends.numpy.rows import RowsStep

    plan, conv, ssm = _plan_and_states(9, kind=kind, tiles=True)
    x = np.random.default_rng(3).standard_normal((9, CONFIG.d_model)).astype(np.float32)
    together, alone = RowsStep(plan, gemm_rows=0), RowsStep(plan, gemm_rows=0)
    conv_alone, ssm_alone = _copies(conv), _copies(ssm)
    together.bind(conv, ssm)
    alone.bind(conv_alone, ssm_alone)
    got = together(x)
    for r in (4, 0, 8, 1, 2, 3, 5, 6, 7):
        assert np.array_equal(alone(x[r:r + 1], np.array([r])), got[r:r + 1])
    assert all(np.array_equal(a, b) for a, b in zip((*conv, *ssm), (*conv_alone, *ssm_alone)))


def test_a_market_bar_refuses_bad_maps_and_carried_arrays_by_name():
    from portable_ssm.backends.numpy.rows import MarketBar, RowsStep

    plan, conv, ssm = _plan_and_states(3)
    step = RowsStep(plan)
    d = CONFIG.d_model
    good = dict(mean=np.zeros(5), std=np.ones(5), inp_weight=np.zeros((d, 5), np.float32),
                inp_bias=np.zeros(d, np.float32), head_bias=np.zeros(1, np.float32))
    for name, bad in (("mean", np.zeros(4)), ("std", np.ones(5, np.float32)),
                      ("inp_weight", np.zeros((5, d), np.float32)), ("head_bias", np.zeros((), np.float32))):
        with pytest.raises(ValueError, match=f"MarketBar: {name} must be"):
            MarketBar(step, **{**good, name: bad})
    with pytest.raises(TypeError, match="RowsStep"):
        MarketBar(plan, **good)
    bar = MarketBar(step, **good)
    step.bind(conv, ssm)
    with pytest.raises(ValueError, match=r"carry must be a contiguous float64 \[2, 3\]"):
        bar.bind(np.zeros((3, 2)), np.zeros(3, bool))
    with pytest.raises(ValueError, match=r"seen must be a contiguous bool \[3\]"):
        bar.bind(np.zeros((2, 3)), np.zeros(3, np.uint8))
    bar.bind(np.full((2, 3), np.nan), np.zeros(3, bool))
    bar.fields(3)[:] = 1.0
    assert np.isnan(bar(None, 3)).all()  # every row's first bar: no prediction, nothing stepped
    with pytest.raises(ValueError, match="expected fields"):
        bar(np.array([0, 1]), 3)
    with pytest.raises(ValueError, match=r"int64 rows in \[0, 3\)"):
        bar(np.array([0, 1, 3]), 3)
    step.bind(_copies(conv), _copies(ssm))
    with pytest.raises(ValueError, match="states changed since bind"):
        bar(None, 3)
