"""NumPy's whole-model batch-1 decode step (backends/numpy/decode.py, ``decode_model_run`` of the
shared C++ torch's op runs) against the core's array-API step, its reference twin."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from portable_ssm.backends import cpu_source
from portable_ssm.backends import numpy as backend
from portable_ssm.backends.cpu_source import ENV
from portable_ssm.backends.numpy import decode, kernels

import portable_ssm as ps

_SMALL_LM = dict(d_model=32, n_layer=2, d_state=16, headdim=16, ngroups=2, vocab_size=50, pad_vocab_size_multiple=1)


def _model(kind: str, **variant):
    config = ps.Mamba2Config(**{**_SMALL_LM, **variant})
    params = ps.init_params(config, seed=3, backend="numpy")
    if kind != "float32":
        params = ps.quantize(params, kind)
    ids = np.random.default_rng(4).integers(0, 50, (1, 11))
    _, state = ps.lm.logits(ids, params, config=config, return_state=True)
    return config, params, ids[:, -1], state


def _contiguous(state):
    """``state`` with contiguous arrays (the prompt's states are views of wider ones)."""
    return ps.Mamba2State(*([np.ascontiguousarray(s) for s in states] for states in state))


def _reference_step(monkeypatch, token, state, params, config):
    with monkeypatch.context() as m:
        m.delitem(backend.FAST_OPS, "decode_model")
        return ps.lm.logits_step(token, state, params, config=config)


def _count_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = decode.decode_model
    monkeypatch.setattr(decode, "decode_model", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(np.asarray(b, np.float64)).max(), 1e-30))


@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("variant", [
    dict(),
    dict(ngroups=1, D_has_hdim=True, conv_bias=False, dt_limit=(0.01, 0.3), tie_embeddings=False),
    dict(d_state=13, headdim=5, d_model=20, n_layer=3, ngroups=1),  # the 8-wide loops' scalar tails
])
def test_numpy_whole_model_step_equals_the_array_api_step_for_every_weight_kind(library, monkeypatch, kind,
                                                                                variant):
    config, params, token, state = _model(kind, **variant)
    calls = _count_calls(monkeypatch)
    got, got_state = ps.lm.logits_step(token, state, params, config=config)
    assert calls == [1]
    want, want_state = _reference_step(monkeypatch, token, state, params, config)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert _rel(got, want) < 2e-6
    for new, ref in zip((*got_state.conv, *got_state.ssm), (*want_state.conv, *want_state.ssm)):
        assert new.shape == ref.shape and _rel(new, ref) < 2e-6


def test_only_a_market_plan_keeps_tiles_and_int8_goes_through_vnni_only_where_it_can(library):
    """``tiles=True`` (a market stream's plan) keeps every weight in tile order, which the rows step
    reads: int8 through VNNI where the library has it and the weight holds no -128 (VNNI negates
    weight bytes: -128 has no byte negation), any other int8 widened from tiles as float32 and
    bfloat16 are; every plan's step equals the row kernel's within float32 rounding."""
    from portable_ssm.backends.numpy import kernels
    from portable_ssm.backends.numpy.rows import RowsStep

    config, params, token, state = _model("int8")
    int8 = decode.INT8_SYMMETRIC if kernels.vnni_products() else decode.INT8_TILES
    assert decode.plan(params, config).sizes[6 + 4:6 + 6].tolist() == [1, 1]  # layer 0's in_proj, out_proj
    assert decode.plan(params, config, tiles=True).sizes[6 + 4:6 + 6].tolist() == [int8] * 2
    name = "layers.0.mixer.in_proj.weight"
    data = params[name].data.copy()
    data[3, 5] = -128
    odd = {**params, name: replace(params[name], data=data)}
    assert decode.plan(odd, config, tiles=True).sizes[6 + 4:6 + 6].tolist() == [decode.INT8_TILES, int8]
    floats, halves = _model("float32")[1], _model("bfloat16")[1]
    assert decode.plan(floats, config).sizes[6 + 4:6 + 6].tolist() == [0, 0]
    assert decode.plan(floats, config, tiles=True).sizes[6 + 4:6 + 6].tolist() == [decode.FLOAT32_TILES] * 2
    assert decode.plan(halves, config, tiles=True).sizes[6 + 4:6 + 6].tolist() == [decode.BFLOAT16_TILES] * 2
    x = ps.lm.embed(token, params, xp=backend.xp)  # [1, d_model]
    for p in (params, odd, floats, halves):
        got, want = [], []
        for tiled, out in ((True, got), (False, want)):
            step = RowsStep(decode.plan(p, config, tiles=tiled), gemm_rows=0)
            step.bind([a.copy() for a in state.conv], [a.copy() for a in state.ssm])  # stepped in place
            out.append(step(x))
        assert _rel(got[0], want[0]) < 2e-6


@pytest.mark.parametrize(("dtype", "g"), [(np.int8, 4), (np.int8, 1), (np.float32, 1), (np.uint16, 1)])
@pytest.mark.parametrize(("out", "n"), [(1, 1), (37, 9), (64, 8), (130, 5)])
def test_a_tiled_weight_holds_its_rows_then_its_tiles_in_the_documented_order(out, n, dtype, g):
    """A market plan's weight data (shared.h): the rows, zeros to 64 bytes, then per 64 rows a tile
    of B blocks of 16 rows as [groups][B][16][g] (g = 4 int8 columns for VNNI, else 1); every weight
    at its place, zeros elsewhere."""
    rng = np.random.default_rng(out + n)
    w = rng.integers(-127 if dtype == np.int8 else 0, 128, (out, n)).astype(dtype)
    data = decode.with_tiles(w, g)
    size = np.dtype(dtype).itemsize
    at = -(-out * n * size // 64) * 64 // size  # tiles_at, in elements
    groups = -(-n // g)
    assert data.dtype == dtype and data.size == at + -(-out // 16) * 16 * groups * g
    np.testing.assert_array_equal(data[:out * n], w.reshape(-1))
    assert not data[out * n:at].any()
    expected = np.zeros(data.size - at, dtype)
    for r in range(out):
        first = r // 64 * 64
        blocks = min(4, -(-(out - first) // 16))
        for c in range(n):
            group, j, b, i = c // g, c % g, (r - first) // 16, r % 16
            expected[first * groups * g + ((group * blocks + b) * 16 + i) * g + j] = w[r, c]
    np.testing.assert_array_equal(data[at:], expected)


@pytest.mark.parametrize("threads", [1, 2, 3, 9])  # 9: more threads than the model's 4 heads
def test_numpy_whole_model_step_is_the_same_on_any_thread_count_and_leaves_its_inputs(library, monkeypatch, threads):
    config, params, token, state = _model("int8")
    model = decode.plan(params, config)
    x = ps.lm.embed(token, params, xp=backend.xp)  # [1, d_model]
    state = _contiguous(state)
    before = [s.copy() for s in (x, *state.conv, *state.ssm)]
    logits, convs, ssms = decode.decode_model(x, list(state.conv), list(state.ssm), model, threads=threads)
    assert all(np.array_equal(a, b) for a, b in zip(before, (x, *state.conv, *state.ssm)))
    want, want_state = _reference_step(monkeypatch, token, state, params, config)
    assert _rel(logits, want) < 2e-6
    assert all(_rel(a, b) < 2e-6 for a, b in zip((*convs, *ssms), (*want_state.conv, *want_state.ssm)))
    one, _, _ = decode.decode_model(x, list(state.conv), list(state.ssm), model, threads=1)
    assert np.array_equal(logits, one)  # the same arithmetic on every share of the rows


def test_numpy_whole_model_step_refusals_name_the_array(library):
    config, params, token, state = _model("float32")
    with pytest.raises(ValueError, match=r"layers\.1\.mixer\.A_log"):
        decode.plan({**params, "layers.1.mixer.A_log": params["layers.1.mixer.A_log"][:2]}, config)
    with pytest.raises(ValueError, match=r"layers\.0\.mixer\.out_proj\.weight"):
        decode.plan({**params, "layers.0.mixer.out_proj.weight": params["layers.0.mixer.out_proj.weight"].T}, config)
    with pytest.raises(ValueError, match=r"layers\.0\.mixer\.in_proj\.bias"):
        decode.plan({**params, "layers.0.mixer.in_proj.bias": np.zeros(3, np.float32)}, config)
    with pytest.raises(ValueError, match=r"norm_f\.weight"):
        decode.plan({**params, "norm_f.weight": params["norm_f.weight"].astype(np.float64)}, config)
    model = decode.plan(params, config)
    x, state = np.zeros((1, config.d_model), np.float32), _contiguous(state)
    with pytest.raises(ValueError, match=r"ssm_states\[1\]"):
        decode.decode_model(x, list(state.conv), [state.ssm[0], state.ssm[1][..., :-1]], model)
    with pytest.raises(ValueError, match=r"conv_states must hold one array per layer"):
        decode.decode_model(x, list(state.conv[:1]), list(state.ssm), model)
    with pytest.raises(ValueError, match=r"\bx must"):
        decode.decode_model(np.zeros((2, config.d_model), np.float32), list(state.conv), list(state.ssm), model)


def test_a_step_takes_the_states_it_made_as_they_are_and_checks_any_other(library):
    """A decode loop's state (the arrays the last step made) is recognised without a check per
    array; copies of it, its arrays in another order or of another model's shapes are not, and
    every one of them steps to the same floats as the loop's own state."""
    config, params, token, state = _model("int8")
    model = decode.plan(params, config)
    x = np.random.default_rng(5).standard_normal((1, config.d_model)).astype(np.float32)
    _, convs, ssms = decode.decode_model(x, *map(list, _contiguous(state)), model)
    assert decode.made_addresses(convs, ssms, model.conv_shapes, model.ssm_shapes) is not None
    copies = [[a.copy() for a in convs], [a.copy() for a in ssms]]
    assert decode.made_addresses(*copies, model.conv_shapes, model.ssm_shapes) is None
    assert decode.made_addresses(convs[::-1], ssms[::-1], model.conv_shapes, model.ssm_shapes) is None
    other_config, other_params, _, _ = _model("int8", d_state=8)
    other = decode.plan(other_params, other_config)
    assert decode.made_addresses(convs, ssms, other.conv_shapes, other.ssm_shapes) is None
    with pytest.raises(ValueError, match=r"conv_states\[0\]"):
        decode.decode_model(x, convs, ssms, other)  # checked, refused by name
    made = decode.decode_model(x, convs, ssms, model)
    copied = decode.decode_model(x, *copies, model)
    for a, b in zip((made[0], *made[1], *made[2]), (copied[0], *copied[1], *copied[2])):
        np.testing.assert_array_equal(a, b)


def test_a_small_model_steps_on_one_thread_and_a_large_one_on_every_worker(library, monkeypatch):
    """The default thread count gives each thread at least BYTES_PER_THREAD of weights: a tiny
    model's step never waits at the three barriers a layer that splitting it would cost."""
    monkeypatch.setattr(decode, "workers", lambda: 4)
    config, params, _, _ = _model("float32")
    small = decode.plan(params, config)
    assert small.weight_bytes < decode.BYTES_PER_THREAD and decode.default_threads(small) == 1
    assert decode.default_threads(replace(small, weight_bytes=3 * decode.BYTES_PER_THREAD)) == 3
    assert decode.default_threads(replace(small, weight_bytes=100 * decode.BYTES_PER_THREAD)) == 4


def test_numpy_decode_falls_back_to_the_array_api_step_with_the_kernels_off(library, monkeypatch):
    config, params, token, state = _model("bfloat16")
    calls = _count_calls(monkeypatch)
    monkeypatch.setenv(ENV, "0")
    got, _ = ps.lm.logits_step(token, state, params, config=config)
    assert calls == []
    monkeypatch.delenv(ENV)
    want, _ = _reference_step(monkeypatch, token, state, params, config)
    assert _rel(got, want) < 2e-6


def test_numpy_decode_hook_declines_float64_and_variants_the_kernel_does_not_compute(library, monkeypatch):
    calls = _count_calls(monkeypatch)
    config, params, token, state = _model("float32", d_ssm=32)  # a gated MLP: the core's step
    ps.lm.logits_step(token, state, params, config=config)
    config64 = ps.Mamba2Config(**_SMALL_LM)
    params64 = ps.init_params(config64, seed=3, backend="numpy", dtype="float64")
    _, state64 = ps.lm.logits(np.array([[1, 2]]), params64, config=config64, return_state=True)
    got, _ = ps.lm.logits_step(np.array([2]), state64, params64, config=config64)
    assert calls == [] and got.dtype == np.float64


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_numpy_step_of_rows_in_place_equals_the_step_with_new_states(library, threads):
    config, params, token, state = _model("float32", ngroups=1)
    model = decode.plan(params, config)
    rng = np.random.default_rng(5)
    batch = ps.Mamba2State(*([rng.standard_normal((3, *s.shape[1:])).astype(np.float32) for s in states]
                             for states in state))  # [3, ...] per layer
    x = rng.standard_normal((2, config.d_model)).astype(np.float32)
    rows = np.array([2, 0])
    want = [decode.decode_model(x[j:j + 1], [a[r:r + 1] for a in batch.conv], [a[r:r + 1] for a in batch.ssm],
                                model, threads=1) for j, r in enumerate(rows)]
    untouched = [a[1].copy() for a in (*batch.conv, *batch.ssm)]
    logits = decode.decode_rows_in_place(x, list(batch.conv), list(batch.ssm), rows, model, threads=threads)
    for j, r in enumerate(rows):
        assert np.array_equal(logits[j], want[j][0][0])
        for whole, new in zip((*batch.conv, *batch.ssm), (*want[j][1], *want[j][2])):
            assert np.array_equal(whole[r], new[0])
    assert all(np.array_equal(a[1], b) for a, b in zip((*batch.conv, *batch.ssm), untouched))
    with pytest.raises(ValueError, match=r"rows must be 2 integers in \[0, 3\)"):
        decode.decode_rows_in_place(x, list(batch.conv), list(batch.ssm), np.array([0, 3]), model)


def test_each_instruction_set_has_its_own_library_and_a_bad_one_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_source.ISA_ENV, "avx2")
    avx2 = kernels.library_path("c++")
    monkeypatch.setattr(cpu_source, "cpu_features", lambda: dict.fromkeys(cpu_source.ISA_FEATURES["avx512"], True))
    monkeypatch.setenv(cpu_source.ISA_ENV, "avx512")
    assert kernels.library_path("c++") != avx2 and "-mavx512f" in kernels.flags()
    monkeypatch.setattr(cpu_source, "cpu_features", lambda: {"AVX2": True, "FMA3": True})
    with pytest.warns(RuntimeWarning, match="lacks AVX512F"):
        assert kernels.library_path("c++") == avx2
    monkeypatch.setenv(cpu_source.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="PORTABLE_SSM_CPU_ISA"):
        kernels.library_path("c++")


def test_torch_kernels_take_the_asked_instruction_set_at_import(cpu_isa):
    pytest.importorskip("torch")
    code = "from portable_ssm.backends import torch_kernels; print(' '.join(torch_kernels.CFLAGS))"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, cpu_source.ISA_ENV: cpu_isa})
    assert ("-mavx512f" in shown.stdout.split()) == (cpu_isa == "avx512")
