"""seq_idx: a packed row computes exactly what each of its sequences computes alone.

The reference runs every sequence by itself (``selective_scan``, the conv, ``forward`` without
``seq_idx``) and concatenates; the packed call must equal it: the scans, the conv window, the
whole stack and the language model. Incoming states feed each row's first sequence, returned
states are its last sequence's.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, tol

import portable_ssm as ps
import portable_ssm.ssd as ssd_module
from portable_ssm._array import namespace
from portable_ssm.conv import causal_conv1d
from portable_ssm.lm import logits

H, P, G, N = 4, 2, 2, 3  # heads, headdim, groups (> 1), state size


def ids(rows: list[list[int]], first: int = 0, gap: int = 1) -> np.ndarray:
    """``[b, l]`` non-decreasing ids for rows of sequence lengths (ids first, first+gap, ...)."""
    return np.stack([np.repeat(first + gap * np.arange(len(r)), r) for r in rows])


def pieces(rows: list[list[int]]):
    """``(row, slice, is_first, is_last)`` for every sequence of every row."""
    for i, row in enumerate(rows):
        ends = np.cumsum(row)
        for j, (end, size) in enumerate(zip(ends, row, strict=True)):
            yield i, slice(int(end - size), int(end)), j == 0, j == len(row) - 1


def scan_inputs(seed: int, b: int, l: int) -> dict:
    rng = np.random.default_rng(seed)
    return dict(x=rng.standard_normal((b, l, H, P)), dt=rng.standard_normal((b, l, H)),
                A=-np.exp(rng.uniform(-1.0, 1.5, H)), B=rng.standard_normal((b, l, G, N)),
                C=rng.standard_normal((b, l, G, N)), D=rng.standard_normal(H),
                z=rng.standard_normal((b, l, H, P)), dt_bias=rng.standard_normal(H),
                initial_states=rng.standard_normal((b, H, P, N)))


PER_STEP = ("x", "dt", "B", "C", "z")


def scan_alone(host: dict, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence through ``selective_scan`` on its own (the initial state for the first one
    of its row), concatenated; the final state of each row's last sequence."""
    y = np.zeros_like(host["x"])
    final = np.zeros_like(host["initial_states"])
    for i, sl, is_first, is_last in pieces(rows):
        part = {k: v[i:i + 1, sl] if k in PER_STEP else v for k, v in host.items()}
        part["initial_states"] = host["initial_states"][i:i + 1] if is_first else None
        y_i, s_i = ps.selective_scan(**part, dt_softplus=True, return_final_states=True)
        y[i:i + 1, sl] = y_i
        if is_last:
            final[i:i + 1] = s_i
    return y, final


PACKINGS = [  # two rows of 16 steps each
    [[16], [16]],  # one sequence per row
    [[4, 4, 4, 4], [8, 8]],  # boundaries on chunk edges (Q = 4, 8)
    [[3, 5, 1, 7], [2, 13, 1]],  # boundaries inside chunks, a length-1 sequence
    [[1] * 16, [15, 1]],  # every step its own sequence
    [[1, 15], [5, 11]],
]
CHUNKS = [1, 2, 3, 4, 5, 8, 16, 64, None]


@pytest.mark.parametrize("rows", PACKINGS)
def test_packed_scans_equal_each_sequence_alone_in_float64(rows):
    host = scan_inputs(len(rows[0]) + 7 * len(rows[1]), 2, 16)
    y_ref, s_ref = scan_alone(host, rows)
    seq_idx = ids(rows)
    kw = dict(dt_softplus=True, return_final_states=True, seq_idx=seq_idx)
    for Q in CHUNKS:
        y, s = ps.ssd_scan(**host, chunk_size=Q, **kw)
        assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max(), f"chunk_size={Q}"
        assert np.abs(s - s_ref).max() <= 1e-10 * np.abs(s_ref).max(), f"chunk_size={Q}"
    y, s = ps.selective_scan(**host, **kw)
    assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max()
    assert np.abs(s - s_ref).max() <= 1e-10 * np.abs(s_ref).max()


def test_packed_scan_resets_across_segment_edges(monkeypatch):
    monkeypatch.setattr(ssd_module, "SEGMENT_TOKENS", 8)  # segments of 8 steps: 3 of them over l=20
    rows = [[8, 8, 4], [3, 10, 7]]  # boundaries on and inside segment edges, a sequence spanning two
    host = scan_inputs(5, 2, 20)
    y_ref, s_ref = scan_alone(host, rows)
    for Q in (1, 3, 4, 8):
        y, s = ps.ssd_scan(**host, chunk_size=Q, dt_softplus=True, return_final_states=True,
                           seq_idx=ids(rows))
        assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max(), f"chunk_size={Q}"
        assert np.abs(s - s_ref).max() <= 1e-10 * np.abs(s_ref).max(), f"chunk_size={Q}"


@pytest.mark.parametrize("scan", [ps.ssd_scan, ps.selective_scan])
def test_only_changes_of_id_matter_not_the_gaps_between_ids(scan):
    host = scan_inputs(11, 2, 16)
    rows = [[3, 5, 1, 7], [2, 13, 1]]
    y_ref = scan(**host, dt_softplus=True, chunk_size=4, seq_idx=ids(rows))
    for seq_idx in (ids(rows, gap=7), ids(rows).astype(np.int8)):
        y = scan(**host, dt_softplus=True, chunk_size=4, seq_idx=seq_idx)
        assert np.array_equal(y, y_ref)


@pytest.mark.parametrize("scan", [ps.ssd_scan, ps.selective_scan])
def test_one_sequence_per_row_is_bit_identical_to_no_seq_idx(scan, monkeypatch):
    from portable_ssm.backends import numpy as numpy_backend

    # NumPy's native scan hands packed rows to the reference: compare the reference with itself
    monkeypatch.delitem(numpy_backend.FAST_OPS, "ssd_chunked")
    host = scan_inputs(12, 2, 16)
    kw = dict(dt_softplus=True, chunk_size=4, return_final_states=True)
    y, s = scan(**host, **kw, seq_idx=np.zeros((2, 16), dtype=np.int64))
    y_none, s_none = scan(**host, **kw)
    assert np.array_equal(y, y_none) and np.array_equal(s, s_none)


def test_packed_scans_on_every_backend(xp, dtype):
    rows = [[3, 6, 1], [1, 1, 8]]
    host = scan_inputs(13, 2, 10)
    cdtype = "float64" if dtype == "float64" else "float32"
    host = {k: v.astype(cdtype) for k, v in host.items()}  # the reference sees the rounded inputs
    y_ref, s_ref = scan_alone({k: v.astype(np.float64) for k, v in host.items()}, rows)
    args = {k: xp.asarray_from(v, dtype) for k, v in host.items() if k != "initial_states"}
    args["initial_states"] = xp.asarray_from(host["initial_states"], cdtype)
    kw = dict(dt_softplus=True, return_final_states=True, seq_idx=xp.asarray_from(ids(rows), "int32"))
    for scan, extra in ((ps.ssd_scan, dict(chunk_size=4)), (ps.selective_scan, {})):
        y, s = xp.call(scan, **args, **kw, **extra)
        assert_close(xp, y, y_ref, rtol=tol(dtype), dtype=dtype, shape=(2, 10, H, P))
        assert_close(xp, s, s_ref, rtol=tol(dtype), dtype=cdtype, shape=(2, H, P, N))


def test_conv_window_resets_at_boundaries(xp, dtype):
    rng = np.random.default_rng(3)
    rows, d, k = [[2, 5, 4, 1], [12]], 6, 4  # a last sequence shorter than the window
    x, w, bias = rng.standard_normal((2, 12, d)), rng.standard_normal((d, k)), rng.standard_normal(d)
    state = rng.standard_normal((2, d, k))
    on = {name: xp.asarray_from(v, dtype) for name, v in dict(x=x, w=w, bias=bias, state=state).items()}
    ns = namespace(x=on["x"])
    y, new_state = causal_conv1d(on["x"], on["w"], on["bias"], on["state"], xp=ns,
                                 seq_idx=xp.asarray_from(ids(rows), "int64"))
    y_ref, state_ref = np.zeros_like(x), np.zeros_like(state)
    for i, sl, is_first, is_last in pieces(rows):
        y_i, s_i = causal_conv1d(on["x"][i:i + 1, sl, :], on["w"], on["bias"],
                                 on["state"][i:i + 1, ...] if is_first else None, xp=ns)
        y_ref[i:i + 1, sl] = xp.numpy(y_i)
        if is_last:
            state_ref[i:i + 1] = xp.numpy(s_i)
    assert_close(xp, y, y_ref, rtol=tol(dtype), dtype=dtype, shape=(2, 12, d))
    assert_close(xp, new_state, state_ref, rtol=tol(dtype), dtype=dtype, shape=(2, d, k))


CFG = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, ngroups=2)


def forward_alone(x: np.ndarray, params: dict, rows: list[list[int]], config: ps.Mamba2Config,
                  initial_state: ps.Mamba2State | None = None) -> np.ndarray:
    """Each sequence through ``forward`` on its own (initial_state for each row's first one)."""
    y = np.zeros_like(x)
    for i, sl, is_first, _ in pieces(rows):
        state = None
        if initial_state is not None and is_first:
            state = ps.Mamba2State(*(tuple(a[i:i + 1] for a in arrays) for arrays in initial_state))
        y[i:i + 1, sl] = ps.forward(x[i:i + 1, sl], params, config=config, initial_state=state)
    return y


def test_packed_forward_equals_each_sequence_alone_in_float64():
    params = ps.init_params(CFG, seed=1, dtype="float64")
    rng = np.random.default_rng(1)
    rows = [[5, 1, 2, 9, 3], [1, 19]]
    x = rng.standard_normal((2, 20, CFG.d_model))
    _, start = ps.forward(rng.standard_normal((2, 6, CFG.d_model)), params, config=CFG, return_state=True)
    expected = forward_alone(x, params, rows, CFG, initial_state=start)
    y = ps.forward(x, params, config=CFG, seq_idx=ids(rows), initial_state=start)
    assert np.abs(y - expected).max() <= 1e-10 * np.abs(expected).max()


def test_returned_state_continues_the_last_sequence():
    params = ps.init_params(CFG, seed=2, dtype="float64")
    rng = np.random.default_rng(2)
    rows = [[7, 3, 2], [4, 7, 1], [12]]  # last sequences shorter than the conv window, one whole row
    x, token = rng.standard_normal((3, 12, CFG.d_model)), rng.standard_normal((3, CFG.d_model))
    _, state = ps.forward(x, params, config=CFG, seq_idx=ids(rows), return_state=True)
    y_next, _ = ps.step(token, state, params, config=CFG)
    for i, row in enumerate(rows):
        last = np.concatenate([x[i:i + 1, -row[-1]:], token[i:i + 1, None]], axis=1)
        expected = ps.forward(last, params, config=CFG)[:, -1]
        assert np.abs(y_next[i:i + 1] - expected).max() <= 1e-10 * np.abs(expected).max()


def test_packed_forward_on_every_backend(xp, dtype):
    config = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4, ngroups=2)
    params = ps.cast_params(ps.init_params(config, seed=3, dtype="float64"), dtype, backend=xp.name,
                            device=xp.device)
    rows = [[3, 5]]
    host = np.random.default_rng(3).standard_normal((1, 8, 8))
    x = xp.asarray_from(host, dtype)
    y = xp.call(ps.forward, x, params, config=config, seq_idx=xp.asarray_from(ids(rows), "int32"))
    alone = [xp.numpy(xp.call(ps.forward, x[:, sl, :], params, config=config))
             for _, sl, _, _ in pieces(rows)]
    assert_close(xp, y, np.concatenate(alone, axis=1), rtol=tol(dtype), dtype=dtype, shape=(1, 8, 8))


def test_packed_logits_equal_each_sequence_alone():
    config = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, vocab_size=40)
    params = ps.init_params(config, seed=4, dtype="float64")
    rows = [[4, 1, 7]]
    tokens = np.random.default_rng(4).integers(0, 40, (1, 12))
    out = logits(tokens, params, config=config, seq_idx=ids(rows))
    for _, sl, _, _ in pieces(rows):
        expected = logits(tokens[:, sl], params, config=config)
        assert np.abs(out[:, sl] - expected).max() <= 1e-10 * np.abs(expected).max()


def call_with(entry: str, seq_idx, *, x_backend: str = "numpy"):
    """Calls one public entry point on small valid inputs with the given ``seq_idx``."""
    host = scan_inputs(0, 2, 6)
    if entry in ("ssd_scan", "selective_scan"):
        x = ps.to_backend(host.pop("x"), x_backend)
        host = {k: ps.to_backend(v, x_backend) for k, v in host.items()}
        return getattr(ps, entry)(x, **host, seq_idx=seq_idx)
    if entry == "forward":
        config = ps.Mamba2Config(d_model=4, d_state=2, headdim=4)
        return ps.forward(np.zeros((2, 6, 4)), ps.init_params(config, dtype="float64"), config=config,
                          seq_idx=seq_idx)
    config = ps.Mamba2Config(d_model=4, d_state=2, headdim=4, vocab_size=10)
    return logits(np.zeros((2, 6), dtype=np.int64), ps.init_params(config), config=config, seq_idx=seq_idx)


ENTRIES = ["ssd_scan", "selective_scan", "forward", "logits"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_float_seq_idx_is_a_type_error_naming_it(entry):
    with pytest.raises(TypeError, match=r"seq_idx: expected an integer dtype.*float64"):
        call_with(entry, np.zeros((2, 6)))


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("shape", [(2, 7), (1, 6), (12,), (2, 6, 1)])
def test_misshapen_seq_idx_is_a_value_error_naming_it(entry, shape):
    with pytest.raises(ValueError, match=r"seq_idx: expected (rank 2 with )?shape \[b, l\] = \[2, 6\]"):
        call_with(entry, np.zeros(shape, dtype=np.int32))


@pytest.mark.parametrize("entry", ["ssd_scan", "forward"])
def test_seq_idx_from_another_backend_is_a_type_error_naming_both(entry):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"seq_idx is a torch array but x is a numpy array"):
        call_with(entry, torch.zeros((2, 6), dtype=torch.int32))
