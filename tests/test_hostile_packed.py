"""Hostile packed batches: a non-finite value stays inside its own sequence.

A packed row (``cu_seqlens`` or ``seq_idx``), a left-padded batch (``attention_mask``) and a state
pool (``state_batch_indices``) each hold several requests in one call. A NaN or ±inf in one of them
(an input step, an incoming state) must leave every other request bit-equal to the call without it,
and the poisoned request's steps before it bit-equal too: no sequence reads another's state, taps or
chunk terms (0·nan is nan, so every boundary must select with ``where``, never multiply by a 0).
The clean packed call in turn equals each sequence run alone (``selective_scan`` per sequence, within
rounding), so with the NaN every other sequence still gives what it gives alone.

Checked for the scan (NumPy's native state passing and the array-API reference on every backend),
the conv, ``forward``, ``lm.logits``, generation over ragged prompts and the pooled decode step
(the compiled CPU kernels and NumPy's ufuncs). Malformed packed-batch arguments raise only the
documented ValueError/TypeError, naming the argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import Backend, assert_close, tol
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from portable_ssm.backends.cpu_source import ENV
from test_hostile_numerics import quiet
from test_varlen import cumulative, scan_alone, scan_inputs

import portable_ssm as ps
from portable_ssm import ssd
from portable_ssm._array import namespace
from portable_ssm.conv import causal_conv1d
from portable_ssm.generation import generate, left_pad
from portable_ssm.lm import logits, logits_step
from portable_ssm.varlen import varlen_of

BAD = (math.nan, math.inf, -math.inf)
SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HOST = Backend("numpy", "numpy", None)


@pytest.fixture(params=["native", "reference"])
def scan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``native``: the backend's own scan and state passing (NumPy's, reached by torch-cpu too);
    ``reference``: the array-API scan with its Python state passing, on every backend."""
    if request.param == "reference":
        monkeypatch.setattr(ssd, "fast_op", lambda xp, op: None)
    return request.param


@pytest.fixture(params=["kernels", "ufuncs"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled CPU kernels as built here, or turned off (``PORTABLE_SSM_CPU_KERNELS=0``)."""
    if request.param == "ufuncs":
        monkeypatch.setenv(ENV, "0")
    return request.param


def skip_without_native_scan(xp, path: str) -> None:
    """Skips ``path == "native"`` where it would only repeat the reference: the CPU rows with a
    native scan or state passing are numpy, torch-cpu (NumPy's, through zero-copy views) and jax
    (``jax.lax.scan``)."""
    if path == "native" and not (xp.name in ("numpy", "jax") or (xp.name == "torch" and xp.device == "cpu")):
        pytest.skip("only numpy, torch-cpu and jax have a native scan or state passing on the CPU matrix")


def spans(lengths: list[int]) -> list[slice]:
    """Each sequence's steps in the packed row."""
    cu = cumulative(lengths)
    return [slice(int(cu[i]), int(cu[i + 1])) for i in range(len(lengths))]


def assert_isolated(y: np.ndarray, clean: np.ndarray, lengths: list[int], seq: int, t: int | None) -> None:
    """Every sequence but ``seq`` bit-equal in ``y [1, l, ...]`` and ``clean``; ``seq`` too before its step ``t``."""
    for i, sl in enumerate(spans(lengths)):
        if i != seq:
            np.testing.assert_array_equal(y[:, sl], clean[:, sl], err_msg=f"sequence {i} changed")
        elif t is not None:
            np.testing.assert_array_equal(y[:, sl.start:sl.start + t], clean[:, sl.start:sl.start + t],
                                          err_msg="an earlier step of the poisoned sequence changed")


def assert_rows_isolated(states: np.ndarray, clean: np.ndarray, seq: int) -> None:
    """Every row but ``seq`` of ``states [n, ...]`` bit-equal to ``clean``'s."""
    others = [i for i in range(states.shape[0]) if i != seq]
    np.testing.assert_array_equal(states[others], clean[others])


# --- the scan ------------------------------------------------------------------------------------


@st.composite
def packed_poisonings(draw):
    """Sequence lengths of one packed row, one poisoned entry (argument, sequence, step, value), the
    layout (cu_seqlens or seq_idx), a chunk size and a dtype."""
    lengths = draw(st.lists(st.integers(1, 30), min_size=2, max_size=5))
    seq = draw(st.integers(0, len(lengths) - 1))
    return dict(lengths=lengths, seq=seq, t=draw(st.integers(0, lengths[seq] - 1)),
                name=draw(st.sampled_from(("x", "dt", "B", "C", "initial_states"))), value=draw(st.sampled_from(BAD)),
                layout=draw(st.sampled_from(("cu_seqlens", "seq_idx"))), Q=draw(st.sampled_from((None, 1, 4, 16))),
                dtype=draw(st.sampled_from(("float64", "float32"))), seed=draw(st.integers(0, 2**16)))


def packed_args(host: dict, lengths: list[int], layout: str, xp) -> tuple[dict, dict]:
    """``(scan inputs on xp, packing keywords)``; with seq_idx the first sequence alone has a state."""
    on = {k: xp.asarray_from(v) for k, v in host.items() if k != "initial_states"}
    if layout == "cu_seqlens":
        on["initial_states"] = xp.asarray_from(host["initial_states"])
        return on, dict(cu_seqlens=xp.asarray_from(cumulative(lengths), "int32"), return_varlen_states=True)
    on["initial_states"] = xp.asarray_from(host["initial_states"][:1])
    ids = np.repeat(np.arange(len(lengths)), lengths)[None, :]  # [1, l]
    return on, dict(seq_idx=xp.asarray_from(ids, "int32"), return_final_states=True)


def check_packed_scan(xp, case: dict) -> None:
    """One poisoned entry in a packed row: the other sequences (outputs and, with cu_seqlens, final
    states) and the poisoned one's earlier steps bit-equal to the clean call, which equals each
    sequence alone (float64 ``selective_scan`` per sequence) within rounding."""
    lengths, seq, t, name = case["lengths"], case["seq"], case["t"], case["name"]
    host = {k: v.astype(case["dtype"]) for k, v in scan_inputs(case["seed"], lengths).items()}
    bad = {k: v.copy() for k, v in host.items()}
    rng = np.random.default_rng(case["seed"])
    if name == "initial_states":  # the incoming state of seq (with seq_idx: only the first has one)
        seq = seq if case["layout"] == "cu_seqlens" else 0
        bad[name][(seq, *(int(rng.integers(0, s)) for s in bad[name].shape[1:]))] = case["value"]
        t = None
    else:
        step = spans(lengths)[seq].start + t
        bad[name][(0, step, *(int(rng.integers(0, s)) for s in bad[name].shape[2:]))] = case["value"]
    kw = dict(chunk_size=case["Q"], dt_softplus=True)
    clean_args, packing = packed_args(host, lengths, case["layout"], xp)
    bad_args, _ = packed_args(bad, lengths, case["layout"], xp)
    clean = [xp.numpy(v) for v in xp.call(ps.ssd_scan, **clean_args, **kw, **packing)]
    got = [xp.numpy(v) for v in quiet(xp.call, ps.ssd_scan, **bad_args, **kw, **packing)]
    assert_isolated(got[0], clean[0], lengths, seq, t)
    if case["layout"] == "cu_seqlens":
        assert_rows_isolated(got[1], clean[1], seq)
        y_alone, finals_alone = scan_alone({k: v.astype(np.float64) for k, v in host.items()}, lengths)
        assert_close(xp, xp.asarray_from(clean[0]), y_alone, rtol=tol(case["dtype"]))
        assert_close(xp, xp.asarray_from(clean[1]), finals_alone, rtol=tol(case["dtype"]))
    if t is not None and not (name == "dt" and case["value"] == -math.inf):  # dt = -inf is Δ = 0: finite
        assert not np.isfinite(got[0][:, spans(lengths)[seq].start + t]).all()


@SETTINGS
@example(case=dict(lengths=[40, 90], seq=0, t=10, name="x", value=math.nan, layout="cu_seqlens", Q=None,
                   dtype="float32", seed=0))  # the issue's case: all of sequence 1 turned nan
@example(case=dict(lengths=[40, 90], seq=0, t=10, name="x", value=math.nan, layout="seq_idx", Q=None,
                   dtype="float64", seed=0))
@example(case=dict(lengths=[3, 5, 9], seq=1, t=2, name="B", value=math.inf, layout="cu_seqlens", Q=16,
                   dtype="float64", seed=1))  # an inf B of a sequence ending inside the chunk
@example(case=dict(lengths=[6, 7], seq=0, t=0, name="initial_states", value=math.nan, layout="cu_seqlens", Q=4,
                   dtype="float32", seed=2))
@given(case=packed_poisonings())
def test_a_non_finite_step_of_one_packed_sequence_leaves_the_others_bit_equal(xp, scan_path, case):
    skip_without_native_scan(xp, scan_path)
    check_packed_scan(xp, case)


def test_the_issue_case_also_holds_across_segments(monkeypatch):
    """Segments of 8 steps: the state carried from segment to segment is dropped at a boundary too."""
    monkeypatch.setattr(ssd, "SEGMENT_TOKENS", 8)
    for layout in ("cu_seqlens", "seq_idx"):
        check_packed_scan(HOST, dict(
            lengths=[11, 3, 19], seq=0, t=2, name="x", value=math.nan, layout=layout, Q=4, dtype="float64", seed=3))


# --- the conv ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("where", ["input", "state"])
def test_a_non_finite_conv_input_stays_in_its_sequence(xp, layout, where):
    lengths, d, k = [2, 5, 1, 6], 6, 4  # sequences shorter and longer than the window
    l = sum(lengths)
    rng = np.random.default_rng(4)
    host = dict(x=rng.standard_normal((1, l, d)), w=rng.standard_normal((d, k)), bias=rng.standard_normal(d),
                states=rng.standard_normal((len(lengths) if layout == "cu_seqlens" else 1, d, k)))
    seq, t = 1, 2
    bad = {name: v.copy() for name, v in host.items()}
    if where == "input":
        bad["x"][0, spans(lengths)[seq].start + t, 3] = math.nan
    else:  # with seq_idx the state belongs to the first sequence
        seq, t = (seq, None) if layout == "cu_seqlens" else (0, None)
        bad["states"][seq, 3, 2] = math.inf
    ns = None

    def run(v: dict) -> tuple[np.ndarray, np.ndarray]:
        nonlocal ns
        on = {name: xp.asarray_from(a) for name, a in v.items()}
        ns = namespace(x=on["x"])
        packing = (dict(varlen=varlen_of(xp.asarray_from(cumulative(lengths), "int32"), l, xp=ns))
                   if layout == "cu_seqlens" else
                   dict(seq_idx=xp.asarray_from(np.repeat(np.arange(len(lengths)), lengths)[None, :], "int32")))
        y, s = quiet(causal_conv1d, on["x"], on["w"], on["bias"], on["states"], xp=ns, **packing)
        return xp.numpy(y), xp.numpy(s)

    (y, states), (clean, clean_states) = run(bad), run(host)
    assert_isolated(y, clean, lengths, seq, t)
    if layout == "cu_seqlens":
        assert_rows_isolated(states, clean_states, seq)
    else:  # the returned state is the last sequence's
        np.testing.assert_array_equal(states, clean_states)


# --- forward, logits -----------------------------------------------------------------------------


CFG = ps.Mamba2Config(d_model=8, n_layer=2, d_state=4, headdim=4, ngroups=2, chunk_size=4, vocab_size=30)
LENGTHS = [50, 37, 9, 70]  # l = 166: three chunks of 56, sequences ending inside them


def packed_state(host_state: ps.Mamba2State, xp) -> ps.Mamba2State:
    return ps.Mamba2State(*(tuple(xp.asarray_from(a) for a in arrays) for arrays in host_state))


def poisoned_state(state: ps.Mamba2State, row: int, value: float) -> ps.Mamba2State:
    """A copy of the host ``state`` with one SSM entry of ``row`` in the last layer set to ``value``."""
    ssm = [a.copy() for a in state.ssm]
    ssm[-1][row, 1, 0, 2] = value
    return ps.Mamba2State(conv=tuple(a.copy() for a in state.conv), ssm=tuple(ssm))


def random_state(rows: int, seed: int) -> ps.Mamba2State:
    """A host state of ``rows`` rows from a forward of random inputs (float64)."""
    params = ps.init_params(CFG, seed=9, dtype="float64")
    x = np.random.default_rng(seed).standard_normal((rows, 6, CFG.d_model))
    return ps.forward(x, params, config=CFG, return_state=True)[1]


@pytest.mark.parametrize("layout", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("where", ["input", "state"])
def test_a_non_finite_packed_forward_input_stays_in_its_sequence(xp, layout, where):
    params = ps.init_params(CFG, seed=5, backend=xp.name, dtype="float64", device=xp.device)
    l = sum(LENGTHS)
    x = np.random.default_rng(5).standard_normal((1, l, CFG.d_model))
    start = random_state(len(LENGTHS) if layout == "cu_seqlens" else 1, seed=5)
    packing = (dict(cu_seqlens=xp.asarray_from(cumulative(LENGTHS), "int32")) if layout == "cu_seqlens" else
               dict(seq_idx=xp.asarray_from(np.repeat(np.arange(len(LENGTHS)), LENGTHS)[None, :], "int64")))
    seq, t, bad_x, bad_start = 1, 3, x.copy(), start
    if where == "input":
        bad_x[0, spans(LENGTHS)[seq].start + t, 2] = math.nan
    else:
        seq, t = (seq, None) if layout == "cu_seqlens" else (0, None)
        bad_start = poisoned_state(start, seq, math.nan)

    def run(v: np.ndarray, state: ps.Mamba2State) -> tuple[np.ndarray, ps.Mamba2State]:
        y, out = quiet(xp.call, ps.forward, xp.asarray_from(v), params, config=CFG,
                       initial_state=packed_state(state, xp), return_state=True, **packing)
        return xp.numpy(y), ps.Mamba2State(*(tuple(xp.numpy(a) for a in arrays) for arrays in out))

    (y, state), (clean, clean_state) = run(bad_x, bad_start), run(x, start)
    assert_isolated(y, clean, LENGTHS, seq, t)
    if layout == "cu_seqlens":  # one returned state per sequence
        for got, want in zip(state.conv + state.ssm, clean_state.conv + clean_state.ssm):
            assert_rows_isolated(got, want, seq)
    assert not np.isfinite(y[:, spans(LENGTHS)[seq]]).all()


@pytest.mark.parametrize("layout", ["cu_seqlens", "seq_idx"])
def test_a_non_finite_state_of_one_packed_prompt_leaves_the_other_logits_bit_equal(xp, layout):
    params = ps.init_params(CFG, seed=6, backend=xp.name, dtype="float64", device=xp.device)
    tokens = np.random.default_rng(6).integers(0, CFG.vocab_size, (1, sum(LENGTHS)))
    start = random_state(len(LENGTHS) if layout == "cu_seqlens" else 1, seed=6)
    seq = 1 if layout == "cu_seqlens" else 0  # sequence 1 is the last of chunk 0 and ends in chunk 1
    packing = (dict(cu_seqlens=xp.asarray_from(cumulative(LENGTHS), "int64")) if layout == "cu_seqlens" else
               dict(seq_idx=xp.asarray_from(np.repeat(np.arange(len(LENGTHS)), LENGTHS)[None, :], "int32")))

    def run(state: ps.Mamba2State) -> np.ndarray:
        return xp.numpy(quiet(xp.call, logits, xp.asarray_from(tokens, "int64"), params, config=CFG,
                              initial_state=packed_state(state, xp), **packing))

    out, clean = run(poisoned_state(start, seq, math.inf)), run(start)
    assert_isolated(out, clean, LENGTHS, seq, None)
    assert not np.isfinite(out[:, spans(LENGTHS)[seq]]).all()


# --- ragged prompts (attention_mask) and generation ------------------------------------------------


def test_a_non_finite_input_at_a_padded_position_leaves_its_row_bit_equal(xp):
    params = ps.init_params(CFG, seed=7, backend=xp.name, dtype="float64", device=xp.device)
    x = np.random.default_rng(7).standard_normal((2, 9, CFG.d_model))
    mask = np.ones((2, 9), dtype=np.int64)
    mask[0, :4] = 0  # row 0: four steps of left padding
    bad = x.copy()
    bad[0, 1, :] = math.nan

    def run(v: np.ndarray) -> tuple[np.ndarray, ...]:
        y, state = quiet(ps.forward, xp.asarray_from(v), params, config=CFG,  # a mask is checked on the host
                         attention_mask=xp.asarray_from(mask, "int64"), return_state=True)
        return (xp.numpy(y), *(xp.numpy(a) for a in state.conv + state.ssm))

    got, clean = run(bad), run(x)
    np.testing.assert_array_equal(got[0][0, 4:], clean[0][0, 4:])  # the row's tokens
    np.testing.assert_array_equal(got[0][1], clean[0][1])
    for a, b in zip(got[1:], clean[1:]):
        np.testing.assert_array_equal(a, b)


def test_generation_over_ragged_prompts_keeps_a_non_finite_state_in_its_row(xp, cpu_kernels):
    params = ps.init_params(CFG, seed=8, backend=xp.name, dtype="float32", device=xp.device)
    prompts = [[3, 7, 1], [5, 2, 9, 4, 8, 6], [11, 12]]
    ids, mask = left_pad(prompts)
    start = ps.Mamba2State(*(tuple(a.astype(np.float32) for a in arrays) for arrays in random_state(3, seed=8)))
    bad = poisoned_state(start, 1, math.nan)
    kw = dict(config=CFG, max_new_tokens=5)

    def run(state: ps.Mamba2State, prompt: list[list[int]], **extra) -> np.ndarray:
        return xp.numpy(quiet(generate, xp.asarray_from(np.asarray(prompt), "int64"), params,
                              initial_state=packed_state(state, xp), **extra, **kw))

    got = run(bad, ids, attention_mask=xp.asarray_from(np.asarray(mask), "int64"))
    clean = run(start, ids, attention_mask=xp.asarray_from(np.asarray(mask), "int64"))
    np.testing.assert_array_equal(got[[0, 2]], clean[[0, 2]])
    for row in (0, 2):  # and each row as it gets alone, unpadded
        alone = run(ps.Mamba2State(*(tuple(a[row:row + 1] for a in arrays) for arrays in start)), [prompts[row]])
        np.testing.assert_array_equal(got[row, -5:], alone[0, -5:])


# --- the state pool ------------------------------------------------------------------------------


@pytest.mark.parametrize("slot", [1, 4], ids=["named-slot", "idle-slot"])
def test_a_non_finite_pool_slot_reaches_no_other_row_or_slot(xp, cpu_kernels, slot):
    params = ps.init_params(CFG, seed=10, backend=xp.name, dtype="float32", device=xp.device)
    pool = ps.Mamba2State(*(tuple(a.astype(np.float32) for a in arrays) for arrays in random_state(5, seed=10)))
    bad = poisoned_state(pool, slot, math.nan)
    slots = np.asarray([3, 1, 0])  # slot 4 idle
    token = np.asarray([4, 17, 9])

    def run(state: ps.Mamba2State) -> tuple[np.ndarray, ...]:
        out, new = quiet(logits_step, xp.asarray_from(token, "int64"), packed_state(state, xp), params,
                         config=CFG, state_batch_indices=xp.asarray_from(slots, "int64"))
        return (xp.numpy(out), *(xp.numpy(a) for a in new.conv + new.ssm))

    got, clean = run(bad), run(pool)
    row = [int(i) for i in np.flatnonzero(slots == slot)]
    assert_rows_isolated(got[0], clean[0], row[0] if row else -1)
    for a, b in zip(got[1:], clean[1:]):
        assert_rows_isolated(a, b, slot)
    if row:
        assert not np.isfinite(got[0][row[0]]).all()


# --- malformed packed-batch arguments --------------------------------------------------------------


SCAN_HOST = {k: v for k, v in scan_inputs(0, [2, 4]).items()}  # l = 6, two sequences
INT_DTYPES = ("int8", "int32", "int64")


def call_entry(entry: str, xp: Backend = HOST, **packing):
    """One public entry point on small valid inputs (l = 6) on ``xp`` with the given packed-batch
    arguments (as they are: already on a backend)."""
    if entry == "ssd_scan":
        host = {k: xp.asarray_from(v) for k, v in SCAN_HOST.items()}
        if "initial_states" in packing:
            host["initial_states"] = packing.pop("initial_states")
        elif "cu_seqlens" not in packing:
            host.pop("initial_states")
        return ps.ssd_scan(**host, **packing)
    params = ps.init_params(CFG, seed=0, backend=xp.name, dtype="float64", device=xp.device)
    if entry == "forward":
        return ps.forward(xp.asarray_from(np.zeros((1, 6, CFG.d_model))), params, config=CFG, **packing)
    return logits(xp.asarray_from(np.zeros((1, 6)), "int64"), params, config=CFG, **packing)


MALFORMED = [  # (argument, value, error, message)
    ("cu_seqlens", np.array([0.0, 2.0, 6.0]), TypeError, r"cu_seqlens: expected an integer dtype.*float64"),
    ("cu_seqlens", np.array([False, True]), TypeError, r"cu_seqlens: expected an integer dtype.*bool"),
    ("cu_seqlens", np.array([[0, 2, 6]]), ValueError, r"cu_seqlens: expected shape \[n_seq \+ 1\].*\(1, 3\)"),
    ("cu_seqlens", np.array(6), ValueError, r"cu_seqlens: expected shape \[n_seq \+ 1\].*\(\)"),
    ("cu_seqlens", np.array([], dtype=np.int32), ValueError, r"cu_seqlens: expected shape .*\(0,\)"),
    ("cu_seqlens", np.array([1, 2, 6]), ValueError, r"cu_seqlens: expected 0 first, got 1"),
    ("cu_seqlens", np.array([0, 2, 5]), ValueError, r"cu_seqlens: expected l=6 .* last, got 5"),
    ("cu_seqlens", np.array([0, 4, 2, 6]), ValueError, r"cu_seqlens: expected strictly increasing.*4 then 2"),
    ("cu_seqlens", np.array([0, 2, 2, 6]), ValueError, r"cu_seqlens: expected strictly increasing.*2 then 2"),
    ("seq_idx", np.zeros((1, 6), dtype=np.float32), TypeError, r"seq_idx: expected an integer dtype.*float32"),
    ("seq_idx", np.zeros((1, 6), dtype=bool), TypeError, r"seq_idx: expected an integer dtype.*bool"),
    ("seq_idx", np.zeros(6, dtype=np.int32), ValueError, r"seq_idx: expected rank 2 with shape \[b, l\]"),
    ("seq_idx", np.zeros((1, 5), dtype=np.int32), ValueError, r"seq_idx: expected shape \[b, l\] = \[1, 6\]"),
    ("seq_idx", np.array([[0, 0, 1, 1, 0, 0]]), ValueError,
     r"seq_idx: expected non-decreasing ids along l, got 1 then 0 at row 0, steps 3 and 4"),
    ("seq_idx", np.array([[2, 2, 3, 3, 3, 3]]), ValueError, r"seq_idx: expected 0 at each row's first step, got 2"),
    ("seq_idx", np.array([[0, 1, 2, 3, 4, 3]]), ValueError, r"seq_idx: expected non-decreasing ids.*got 4 then 3"),
]


@pytest.mark.parametrize("entry", ["ssd_scan", "forward", "logits"])
@pytest.mark.parametrize(("argument", "value", "error", "message"), MALFORMED,
                         ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_packed_arguments_raise_naming_the_argument(xp, entry, argument, value, error, message):
    with pytest.raises(error, match=message):
        call_entry(entry, xp, **{argument: xp.asarray_from(value)})


@pytest.mark.parametrize(("states", "error", "message"), [
    (np.zeros((1, 4, 2, 3)), ValueError, r"initial_states: expected shape \[s, h, p, n\] = \[2, 4, 2, 3\]"),
    (np.zeros((2, 4, 2)), ValueError, r"initial_states: expected rank 4"),
    (np.zeros((2, 4, 2, 3), dtype=np.float32), TypeError, r"initial_states: expected the compute dtype float64"),
    (np.zeros((2, 4, 2, 3), dtype=np.int64), TypeError, r"initial_states: expected a real floating dtype"),
])
def test_malformed_per_sequence_initial_states_raise_naming_them(states, error, message):
    with pytest.raises(error, match=message):
        call_entry("ssd_scan", cu_seqlens=np.array([0, 2, 6]), initial_states=states)


def test_initial_states_from_another_backend_raise_naming_them():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"initial_states is a torch array but x is a numpy array"):
        call_entry("ssd_scan", cu_seqlens=np.array([0, 2, 6]), initial_states=torch.zeros((2, 4, 2, 3)))


@pytest.mark.parametrize(("slots", "error", "message"), [
    (np.array([1, 1]), ValueError, r"state_batch_indices: expected distinct slots"),
    (np.array([0, 3]), ValueError, r"state_batch_indices: expected slots in \[0, 3\)"),
    (np.array([-1, 0]), ValueError, r"state_batch_indices: expected slots in \[0, 3\)"),
    (np.array([0.0, 1.0]), TypeError, r"state_batch_indices: expected an integer dtype.*float64"),
    (np.array([True, False]), TypeError, r"state_batch_indices: expected an integer dtype.*bool"),
    (np.array([[0, 1]]), ValueError, r"state_batch_indices: expected shape \[b\] = \[2\]"),
])
def test_malformed_state_batch_indices_raise_naming_them(xp, slots, error, message):
    params = ps.init_params(CFG, seed=0, backend=xp.name, dtype="float64", device=xp.device)
    pool = packed_state(random_state(3, seed=0), xp)
    with pytest.raises(error, match=message):
        logits_step(xp.asarray_from(np.array([1, 2]), "int64"), pool, params, config=CFG,
                    state_batch_indices=xp.asarray_from(slots))


@st.composite
def packed_arguments(draw):
    """A packed-batch argument of any dtype, rank and values, mostly malformed."""
    argument = draw(st.sampled_from(("cu_seqlens", "seq_idx", "initial_states")))
    dtype = draw(st.sampled_from((*INT_DTYPES, "float32", "float64", "bool")))
    shape = draw(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple))
    values = draw(st.lists(st.integers(-3, 8), min_size=math.prod(shape), max_size=math.prod(shape)))
    return argument, np.asarray(values).astype(dtype).reshape(shape)


@settings(max_examples=150, deadline=None)
@given(entry=st.sampled_from(("ssd_scan", "forward", "logits")), drawn=packed_arguments())
def test_any_packed_argument_is_accepted_or_rejected_with_the_documented_errors(entry, drawn):
    argument, value = drawn
    packing = {argument: value}
    if argument == "initial_states":
        if entry != "ssd_scan":
            packing = {"initial_state": ps.Mamba2State(conv=(value,) * CFG.n_layer, ssm=(value,) * CFG.n_layer),
                       "cu_seqlens": np.array([0, 2, 6])}
        else:
            packing["cu_seqlens"] = np.array([0, 2, 6])
    try:
        quiet(call_entry, entry, **packing)
    except (ValueError, TypeError) as error:
        assert argument.rstrip("s") in str(error) or "initial_state" in str(error), str(error)


@settings(max_examples=60, deadline=None)
@given(slots=st.lists(st.integers(-2, 5), min_size=0, max_size=4),
       dtype=st.sampled_from((*INT_DTYPES, "float64", "bool")))
def test_any_state_batch_indices_are_accepted_or_rejected_with_the_documented_errors(slots, dtype):
    params = ps.init_params(CFG, seed=0, dtype="float64")
    pool = random_state(3, seed=0)
    indices = np.asarray(slots).astype(dtype)
    token = np.zeros(len(slots), dtype=np.int64)
    try:
        logits_step(token, pool, params, config=CFG, state_batch_indices=indices)
    except (ValueError, TypeError) as error:
        assert "state_batch_indices" in str(error) or "token" in str(error), str(error)
