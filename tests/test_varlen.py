"""cu_seqlens: a packed batch-1 row with one incoming and one final state per sequence computes
exactly what each sequence computes alone from its own state.

The reference runs every sequence by itself (``selective_scan``, the conv, ``forward`` and
``logits`` without packing, each from that sequence's state) and concatenates; the packed call
must equal it in its outputs and in every per-sequence final state. Lengths are random (no empty
sequence) and the chunk sizes make sequences start, end and run across chunk boundaries.
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
from portable_ssm.varlen import varlen_of

H, P, G, N = 4, 2, 2, 3  # heads, headdim, groups (> 1), state size
PER_STEP = ("x", "dt", "B", "C", "z")


def random_lengths(seed: int, n: int, longest: int = 11) -> list[int]:
    return [int(v) for v in np.random.default_rng(seed).integers(1, longest + 1, n)]


def cumulative(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def scan_inputs(seed: int, lengths: list[int]) -> dict:
    rng = np.random.default_rng(seed)
    l = sum(lengths)
    return dict(x=rng.standard_normal((1, l, H, P)), dt=rng.standard_normal((1, l, H)),
                A=-np.exp(rng.uniform(-1.0, 1.5, H)), B=rng.standard_normal((1, l, G, N)),
                C=rng.standard_normal((1, l, G, N)), D=rng.standard_normal(H),
                z=rng.standard_normal((1, l, H, P)), dt_bias=rng.standard_normal(H),
                initial_states=rng.standard_normal((len(lengths), H, P, N)))


def scan_alone(host: dict, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence through the sequential ``selective_scan`` from its own initial state:
    ``(y [1, l, h, p], final states [n_seq, h, p, n])``."""
    cu = cumulative(lengths)
    y, finals = np.zeros_like(host["x"]), np.zeros_like(host["initial_states"])
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        part = {k: v[:, sl] if k in PER_STEP else v for k, v in host.items()}
        part["initial_states"] = host["initial_states"][i:i + 1]
        y[:, sl], finals[i:i + 1] = ps.selective_scan(**part, dt_softplus=True, return_final_states=True)
    return y, finals


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_scan_with_per_sequence_states_equals_each_sequence_alone_on_every_backend(xp, dtype, seed):
    lengths = random_lengths(seed, 5)
    host = scan_inputs(seed, lengths)
    cdtype = "float64" if dtype == "float64" else "float32"
    host = {k: v.astype(cdtype) for k, v in host.items()}  # the reference sees the rounded inputs
    y_ref, finals_ref = scan_alone({k: v.astype(np.float64) for k, v in host.items()}, lengths)
    args = {k: xp.asarray_from(v, dtype) for k, v in host.items() if k != "initial_states"}
    args["initial_states"] = xp.asarray_from(host["initial_states"], cdtype)
    cu = xp.asarray_from(cumulative(lengths), "int32")
    for Q in (1, 3, 4, 64):  # every step a chunk, boundaries inside and across chunks, one chunk
        y, last, finals = xp.call(ps.ssd_scan, **args, chunk_size=Q, dt_softplus=True, cu_seqlens=cu,
                                  return_final_states=True, return_varlen_states=True)
        assert_close(xp, y, y_ref, rtol=tol(dtype), dtype=dtype, shape=(1, sum(lengths), H, P))
        assert_close(xp, finals, finals_ref, rtol=tol(dtype), dtype=cdtype, shape=(len(lengths), H, P, N))
        assert_close(xp, last, finals_ref[-1:], rtol=tol(dtype), dtype=cdtype, shape=(1, H, P, N))


@pytest.mark.parametrize("seed", range(6))
def test_random_packings_straddling_chunks_and_segments_in_float64(seed, monkeypatch):
    monkeypatch.setattr(ssd_module, "SEGMENT_TOKENS", 8)  # several segments: states carried across them
    lengths = random_lengths(100 + seed, int(np.random.default_rng(seed).integers(1, 9)), longest=17)
    host = scan_inputs(seed, lengths)
    y_ref, finals_ref = scan_alone(host, lengths)
    for Q in (1, 2, 3, 5, 8, None):
        y, finals = ps.ssd_scan(**host, chunk_size=Q, dt_softplus=True, cu_seqlens=cumulative(lengths),
                                return_varlen_states=True)
        assert np.abs(y - y_ref).max() <= 1e-10 * np.abs(y_ref).max(), f"chunk_size={Q}"
        assert np.abs(finals - finals_ref).max() <= 1e-10 * np.abs(finals_ref).max(), f"chunk_size={Q}"


def test_no_initial_states_means_zero_states():
    lengths = [4, 9, 2]
    host = scan_inputs(7, lengths)
    kw = dict(chunk_size=4, dt_softplus=True, cu_seqlens=cumulative(lengths), return_varlen_states=True)
    given = dict(host, initial_states=np.zeros_like(host["initial_states"]))
    y, finals = ps.ssd_scan(**dict(host, initial_states=None), **kw)
    y_zero, finals_zero = ps.ssd_scan(**given, **kw)
    assert np.array_equal(y, y_zero) and np.array_equal(finals, finals_zero)
    assert not np.array_equal(y, ps.ssd_scan(**host, **kw)[0])  # the states do reach the outputs


def test_one_sequence_equals_the_unpacked_scan():
    host = scan_inputs(8, [13])
    y, finals = ps.ssd_scan(**host, chunk_size=4, dt_softplus=True, cu_seqlens=np.array([0, 13]),
                            return_varlen_states=True)
    y_one, final_one = ps.ssd_scan(**host, chunk_size=4, dt_softplus=True, return_final_states=True)
    assert np.abs(y - y_one).max() <= 1e-12 * np.abs(y_one).max()
    assert np.abs(finals - final_one).max() <= 1e-12 * np.abs(final_one).max()


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_conv_with_per_sequence_states_equals_each_sequence_alone(xp, dtype, seed):
    lengths = random_lengths(seed, 6, longest=6)  # sequences shorter and longer than the window
    l, d, k = sum(lengths), 6, 4
    rng = np.random.default_rng(seed)
    host = dict(x=rng.standard_normal((1, l, d)), w=rng.standard_normal((d, k)), bias=rng.standard_normal(d),
                states=rng.standard_normal((len(lengths), d, k)))
    on = {name: xp.asarray_from(v, dtype) for name, v in host.items()}
    ns = namespace(x=on["x"])
    cu = cumulative(lengths)
    y, states = causal_conv1d(on["x"], on["w"], on["bias"], on["states"], xp=ns,
                              varlen=varlen_of(xp.asarray_from(cu, "int64"), l, xp=ns))
    y_ref, states_ref = np.zeros_like(host["x"]), np.zeros_like(host["states"])
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        y_i, s_i = causal_conv1d(on["x"][:, sl, :], on["w"], on["bias"], on["states"][i:i + 1, ...], xp=ns)
        y_ref[:, sl], states_ref[i:i + 1] = xp.numpy(y_i), xp.numpy(s_i)
    assert_close(xp, y, y_ref, rtol=tol(dtype), dtype=dtype, shape=(1, l, d))
    assert_close(xp, states, states_ref, rtol=tol(dtype), dtype=dtype, shape=(len(lengths), d, k))


CFG = ps.Mamba2Config(d_model=8, n_layer=2, d_state=4, headdim=4, ngroups=2, chunk_size=4, vocab_size=30)


def sequence_state(state: ps.Mamba2State, i: int) -> ps.Mamba2State:
    return ps.Mamba2State(*(tuple(a[i:i + 1, ...] for a in arrays) for arrays in state))


def assert_states_close(xp, state: ps.Mamba2State, expected: list[ps.Mamba2State], dtype: str) -> None:
    """``state`` (batch n_seq) equals the per-sequence states ``expected`` (batch 1 each)."""
    for kind in ("conv", "ssm"):
        for layer, packed in enumerate(getattr(state, kind)):
            want = np.concatenate([xp.numpy(getattr(e, kind)[layer]) for e in expected], axis=0)
            assert_close(xp, packed, want, rtol=tol(dtype), shape=want.shape)


def test_packed_forward_with_per_sequence_states_equals_each_sequence_alone(xp, dtype):
    params = ps.cast_params(ps.init_params(CFG, seed=3, dtype="float64"), dtype, backend=xp.name, device=xp.device)
    lengths = random_lengths(3, 4, longest=9)
    l, cu = sum(lengths), cumulative(lengths)
    rng = np.random.default_rng(3)
    x = xp.asarray_from(rng.standard_normal((1, l, CFG.d_model)), dtype)
    _, start = xp.call(ps.forward, xp.asarray_from(rng.standard_normal((len(lengths), 5, CFG.d_model)), dtype),
                       params, config=CFG, return_state=True)
    y, state = xp.call(ps.forward, x, params, config=CFG, initial_state=start, return_state=True,
                       cu_seqlens=xp.asarray_from(cu, "int32"))
    alone = [xp.call(ps.forward, x[:, int(cu[i]):int(cu[i + 1]), :], params, config=CFG,
                     initial_state=sequence_state(start, i), return_state=True) for i in range(len(lengths))]
    assert_close(xp, y, np.concatenate([xp.numpy(y_i) for y_i, _ in alone], axis=1), rtol=tol(dtype),
                 dtype=dtype, shape=(1, l, CFG.d_model))
    assert_states_close(xp, state, [s_i for _, s_i in alone], dtype)


def test_packed_logits_with_per_sequence_states_equal_each_sequence_alone(xp, dtype):
    params = ps.cast_params(ps.init_params(CFG, seed=4, dtype="float64"), dtype, backend=xp.name, device=xp.device)
    lengths = random_lengths(4, 3, longest=9)
    l, cu = sum(lengths), cumulative(lengths)
    rng = np.random.default_rng(4)
    tokens = xp.asarray_from(rng.integers(0, 30, (1, l)), "int64")
    _, start = xp.call(logits, xp.asarray_from(rng.integers(0, 30, (len(lengths), 6)), "int64"), params,
                       config=CFG, return_state=True)
    out, state = xp.call(logits, tokens, params, config=CFG, initial_state=start, return_state=True,
                         cu_seqlens=xp.asarray_from(cu, "int64"))
    alone = [xp.call(logits, tokens[:, int(cu[i]):int(cu[i + 1])], params, config=CFG,
                     initial_state=sequence_state(start, i), return_state=True) for i in range(len(lengths))]
    assert_close(xp, out, np.concatenate([xp.numpy(o) for o, _ in alone], axis=1), rtol=tol(dtype),
                 dtype=dtype, shape=(1, l, CFG.padded_vocab_size))
    assert_states_close(xp, state, [s_i for _, s_i in alone], dtype)


def test_returned_states_continue_every_sequence_with_step():
    params = ps.init_params(CFG, seed=5, dtype="float64")
    rng = np.random.default_rng(5)
    lengths = [7, 1, 3, 10]  # sequences shorter than the conv window too
    cu = cumulative(lengths)
    x, tokens = rng.standard_normal((1, sum(lengths), CFG.d_model)), rng.standard_normal((len(lengths), CFG.d_model))
    _, state = ps.forward(x, params, config=CFG, cu_seqlens=cu, return_state=True)
    y_next, _ = ps.step(tokens, state, params, config=CFG)
    for i in range(len(lengths)):
        whole = np.concatenate([x[:, cu[i]:cu[i + 1]], tokens[i:i + 1, None]], axis=1)
        expected = ps.forward(whole, params, config=CFG)[:, -1]
        assert np.abs(y_next[i:i + 1] - expected).max() <= 1e-10 * np.abs(expected).max()


def call_with(entry: str, cu_seqlens, **kw):
    """One public entry on a batch-1 row of 6 steps (``kw`` overrides its arguments)."""
    if entry == "ssd_scan":
        host = scan_inputs(0, [6])
        host = {k: v for k, v in host.items() if k not in ("initial_states", "z")}
        return ps.ssd_scan(**{**host, **kw}, cu_seqlens=cu_seqlens)
    params = ps.init_params(CFG, dtype="float64")
    if entry == "forward":
        x = kw.pop("x", np.zeros((1, 6, CFG.d_model)))
        return ps.forward(x, params, config=CFG, cu_seqlens=cu_seqlens, **kw)
    ids = kw.pop("x", np.zeros((1, 6), dtype=np.int64))
    return logits(ids, params, config=CFG, cu_seqlens=cu_seqlens, **kw)


ENTRIES = ["ssd_scan", "forward", "logits"]
MALFORMED = [
    (np.array([1, 3, 6]), r"cu_seqlens: expected 0 first, got 1"),
    (np.array([0, 4, 2, 6]), r"cu_seqlens: expected strictly increasing.*got 4 then 2 at index 1"),
    (np.array([0, 3, 3, 6]), r"cu_seqlens: expected strictly increasing.*got 3 then 3 at index 1"),
    (np.array([0, 3, 5]), r"cu_seqlens: expected l=6 .* last, got 5"),
    (np.array([0, 3, 7]), r"cu_seqlens: expected l=6 .* last, got 7"),
    (np.array([0]), r"cu_seqlens: expected shape \[n_seq \+ 1\] with n_seq >= 1, got \(1,\)"),
    (np.array([[0, 6]]), r"cu_seqlens: expected shape \[n_seq \+ 1\] with n_seq >= 1, got \(1, 2\)"),
]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("cu_seqlens", "message"), MALFORMED)
def test_malformed_cu_seqlens_is_a_value_error_naming_it(entry, cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        call_with(entry, cu_seqlens)


@pytest.mark.parametrize("entry", ENTRIES)
def test_float_cu_seqlens_is_a_type_error_naming_it(entry):
    with pytest.raises(TypeError, match=r"cu_seqlens: expected an integer dtype.*float64"):
        call_with(entry, np.array([0.0, 2.0, 6.0]))


@pytest.mark.parametrize("entry", ENTRIES)
def test_cu_seqlens_beside_seq_idx_is_a_value_error_naming_both(entry):
    with pytest.raises(ValueError, match=r"cu_seqlens: not supported together with seq_idx"):
        call_with(entry, np.array([0, 2, 6]), seq_idx=np.zeros((1, 6), dtype=np.int32))


@pytest.mark.parametrize("entry", ENTRIES)
def test_cu_seqlens_needs_a_batch_of_one(entry):
    x = {"ssd_scan": scan_inputs(0, [6, 6])["x"].reshape(2, 6, H, P),
         "forward": np.zeros((2, 6, CFG.d_model)), "logits": np.zeros((2, 6), dtype=np.int64)}[entry]
    if entry == "ssd_scan":
        host = scan_inputs(0, [12])
        host = {k: v.reshape(2, 6, *v.shape[2:]) if k in ("dt", "B", "C") else v for k, v in host.items()
                if k not in ("initial_states", "z", "x")}
        with pytest.raises(ValueError, match=r"x: expected batch 1 with cu_seqlens"):
            ps.ssd_scan(x, **host, cu_seqlens=np.array([0, 2, 6]))
        return
    with pytest.raises(ValueError, match=r"(x|input_ids): expected batch 1 with cu_seqlens.*b=2"):
        call_with(entry, np.array([0, 2, 6]), x=x)


def test_cu_seqlens_from_another_backend_is_a_type_error_naming_both():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"cu_seqlens is a torch array but x is a numpy array"):
        call_with("ssd_scan", torch.tensor([0, 2, 6]))


def test_initial_states_must_hold_one_state_per_sequence():
    host = scan_inputs(0, [2, 4])
    with pytest.raises(ValueError, match=r"initial_states: expected shape \[s, h, p, n\] = \[2, 4, 2, 3\], "
                                         r"got \(1, 4, 2, 3\) \(s=2 from cu_seqlens\)"):
        ps.ssd_scan(**dict(host, initial_states=host["initial_states"][:1]), cu_seqlens=np.array([0, 2, 6]))
    state = ps.empty_state(CFG, 3, np.zeros((1, 6, CFG.d_model)))
    with pytest.raises(ValueError, match=r"initial_state.conv\[0\]: expected shape \[s, .*\(s=2 from cu_seqlens\)"):
        call_with("forward", np.array([0, 2, 6]), initial_state=state)


def test_return_varlen_states_needs_cu_seqlens():
    with pytest.raises(ValueError, match=r"return_varlen_states: needs cu_seqlens"):
        call_with("ssd_scan", None, return_varlen_states=True)
    with pytest.raises(TypeError, match=r"return_varlen_states: expected True or False"):
        call_with("ssd_scan", np.array([0, 6]), return_varlen_states=1)


@pytest.mark.parametrize("entry", ["forward", "logits"])
def test_cu_seqlens_beside_attention_mask_is_a_value_error(entry):
    with pytest.raises(ValueError, match=r"attention_mask: not supported together with cu_seqlens"):
        call_with(entry, np.array([0, 2, 6]), attention_mask=np.ones((1, 6), dtype=bool))


def test_gradients_through_the_packed_scan_equal_each_sequence_alone():
    torch = pytest.importorskip("torch")
    lengths = [3, 6, 2]
    host = {k: torch.tensor(v, requires_grad=k in ("x", "initial_states"))
            for k, v in scan_inputs(9, lengths).items()}
    kw = dict(chunk_size=4, dt_softplus=True)
    y, finals = ps.ssd_scan(**host, **kw, cu_seqlens=torch.tensor(cumulative(lengths)), return_varlen_states=True)
    packed = torch.autograd.grad((y * y).sum() + (finals * finals).sum(), (host["x"], host["initial_states"]))
    cu, loss = cumulative(lengths), 0
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        part = {k: v[:, sl] if k in PER_STEP else v for k, v in host.items()}
        y_i, s_i = ps.ssd_scan(**dict(part, initial_states=host["initial_states"][i:i + 1]), **kw,
                               return_final_states=True)
        loss = loss + (y_i * y_i).sum() + (s_i * s_i).sum()
    alone = torch.autograd.grad(loss, (host["x"], host["initial_states"]))
    for got, want in zip(packed, alone, strict=True):
        assert torch.abs(got - want).max() <= 1e-10 * torch.abs(want).max()
