"""Generation: a cached prefill plus one step per token gives the tokens of recomputing the full
forward every step; sampling is seeded, backend-independent and follows softmax, top-k and top-p."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import portable_ssm as ps
from portable_ssm import generation
from portable_ssm._array import array_backend
from portable_ssm.generation import generate, next_token, stream
from portable_ssm.lm import logits

# The dims of test_pretrained's tied transformers model, so jax (eager) reuses its compiled ops.
CONFIG = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16, ngroups=2, chunk_size=8,
                         vocab_size=50, pad_vocab_size_multiple=1)
PADDED = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, vocab_size=23,
                         pad_vocab_size_multiple=8)  # 24 logits rows, 23 tokens
HOST = ps.init_params(CONFIG, seed=0)


def prompt(b: int = 2, l: int = 13, vocab: int = 50) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (b, l))


def greedy_by_full_forward(ids: np.ndarray, params, config, new: int, vocab: int) -> np.ndarray:
    """The oracle: the whole sequence through ``logits`` again for every new token (numpy)."""
    for _ in range(new):
        last = logits(ids, params, config=config)[:, -1, :vocab]  # [b, vocab]
        ids = np.concatenate([ids, np.argmax(last, axis=-1)[:, None]], axis=1)
    return ids


def test_greedy_tokens_equal_argmax_of_the_full_forward_at_every_step(xp):
    params = ps.cast_params(HOST, "float32", backend=xp.name, device=xp.device)
    ids = prompt()
    out = generate(xp.asarray_from(ids, "int64"), params, config=CONFIG, max_new_tokens=5)
    assert array_backend(out) == xp.name and tuple(out.shape) == (2, 18)
    np.testing.assert_array_equal(xp.numpy(out), greedy_by_full_forward(ids, HOST, CONFIG, 5, 50))


@pytest.mark.parametrize("case", ["whole", "token-blocks", "left-padded"])
def test_prompt_pass_gives_the_last_logits_and_the_state_of_the_full_forward(xp, case, monkeypatch):
    """``lm.prefill`` runs the last layer for the last position only (its scan is ``ssd_last``): its
    logits and states equal the full forward's, over the whole prompt, in token blocks (each
    block's last layer at its last position) and for left-padded rows from given states."""
    from portable_ssm import model
    from portable_ssm.generation import left_pad
    from portable_ssm.lm import prefill

    if case == "token-blocks":
        monkeypatch.setattr(model, "BLOCK_TOKENS", 5)  # 13 tokens: blocks of 5, 5 and 3
    ids, pad, start, mask = prompt(), None, None, None
    if case == "left-padded":
        padded, mask = left_pad([[5, 7, 1, 9, 33, 2, 41], [3, 17], [44, 6, 12, 0]], pad_token_id=3)
        ids, mask = np.asarray(padded), np.asarray(mask)
        pad = xp.asarray_from((mask == 0).sum(axis=1), "int64")
        rng = np.random.default_rng(2)
        zero = ps.empty_state(CONFIG, 3, np.zeros(1, np.float32))
        start = ps.Mamba2State(conv=tuple(xp.asarray_from(rng.standard_normal(a.shape), "float32") for a in zero.conv),
                               ssm=tuple(xp.asarray_from(rng.standard_normal(a.shape), "float32") for a in zero.ssm))
    params = ps.cast_params(HOST, "float32", backend=xp.name, device=xp.device)
    x_ids = xp.asarray_from(ids, "int64")
    want, want_state = logits(x_ids, params, config=CONFIG, return_state=True, initial_state=start,
                              attention_mask=None if mask is None else xp.asarray_from(mask))
    got, state = xp.call(prefill, x_ids, start, pad, params, config=CONFIG, xp=xp.namespace)
    assert_close(xp, got, xp.numpy(want)[:, -1], rtol=2e-5, dtype="float32")
    for a, b in zip((*state.conv, *state.ssm), (*want_state.conv, *want_state.ssm)):
        assert_close(xp, a, xp.numpy(b), rtol=2e-5, dtype="float32")


@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_prompt_pass_with_low_precision_weights_gives_the_full_forwards_last_logits(weights):
    """A quantized in_proj is projected whole in the last layer (only float weights are cut by rows)."""
    import array_api_compat.numpy as nxp

    from portable_ssm.lm import prefill

    params = ps.quantize(HOST, weights)
    want, want_state = logits(prompt(), params, config=CONFIG, return_state=True)
    got, state = prefill(prompt(), None, None, params, config=CONFIG, xp=nxp)
    np.testing.assert_allclose(got, want[:, -1], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for a, b in zip(state.ssm, want_state.ssm):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_generation_prefills_once_then_steps_one_token_at_a_time(monkeypatch):
    calls = []
    for name in ("prefill", "decode"):
        real = getattr(generation, name)
        monkeypatch.setattr(generation, name, lambda ids, *a, _real=real, _name=name, **k:
                            calls.append((_name, tuple(ids.shape))) or _real(ids, *a, **k))
    generate(prompt(), HOST, config=CONFIG, max_new_tokens=4)
    assert calls == [("prefill", (2, 13))] + [("decode", (2,))] * 3


def test_batch_rows_are_generated_as_they_would_be_alone():
    ids = prompt(b=3)
    together = generate(ids, HOST, config=CONFIG, max_new_tokens=6)
    alone = [generate(ids[i:i + 1], HOST, config=CONFIG, max_new_tokens=6)[0] for i in range(3)]
    np.testing.assert_array_equal(together, np.stack(alone))


def test_padding_rows_above_vocab_size_are_never_chosen():
    params = ps.init_params(PADDED, seed=2)
    ids = prompt(b=4, l=5, vocab=23)
    hot = dict(temperature=50.0, seed=0, max_new_tokens=30)
    assert generate(ids, params, config=PADDED, **hot).max() >= 23  # the rows exist and can be drawn
    assert generate(ids, params, config=PADDED, vocab_size=23, **hot).max() < 23
    np.testing.assert_array_equal(generate(ids, params, config=PADDED, max_new_tokens=4, vocab_size=23),
                                  greedy_by_full_forward(ids, params, PADDED, 4, 23))


def expected_with_eos(free: np.ndarray, l: int, eos: int) -> np.ndarray:
    """Each row of the eos-free result with eos after its first eos; cut where every row finished."""
    out, ends = free.copy(), []
    for row in out:
        hits = np.flatnonzero(row[l:] == eos)
        ends.append(l + hits[0] + 1 if hits.size else row.size)
        row[ends[-1]:] = eos
    return out[:, :max(ends)]


@pytest.mark.parametrize("b", [1, 2])
def test_finished_rows_keep_emitting_eos_and_all_finished_stops(b):
    ids = prompt(b=b)
    free = generate(ids, HOST, config=CONFIG, max_new_tokens=8)
    eos = int(free[0, 13 + 2])
    out = generate(ids, HOST, config=CONFIG, max_new_tokens=8, eos_token_id=eos)
    np.testing.assert_array_equal(out, expected_with_eos(free, 13, eos))
    if b == 1:
        assert out.shape[1] < free.shape[1]


def test_sampling_is_reproducible_from_the_seed_on_every_backend(xp):
    params = ps.cast_params(HOST, "float32", backend=xp.name, device=xp.device)
    ids = prompt()
    kw = dict(config=CONFIG, max_new_tokens=5, temperature=1.0, top_k=20, top_p=0.95)
    out = generate(xp.asarray_from(ids, "int64"), params, seed=7, **kw)
    on_numpy = generate(ids, HOST, seed=7, **kw)
    np.testing.assert_array_equal(xp.numpy(out), on_numpy)
    np.testing.assert_array_equal(generate(ids, HOST, seed=7, **kw), on_numpy)
    assert not np.array_equal(generate(ids, HOST, seed=8, **kw), on_numpy)


PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def draw(rows: int, backend: str = "numpy", device=None, **sampling) -> np.ndarray:
    """``rows`` tokens drawn from the logits ``log(PROBS)`` on ``backend``."""
    batch = ps.to_backend(np.tile(np.log(PROBS), (rows, 1)), backend, device=device, dtype="float32")
    tokens = next_token(batch, rng=ps.backends.load("numpy").rng(0), **sampling)
    assert array_backend(tokens) == backend and tuple(tokens.shape) == (rows,)
    return ps.backends.load(backend).to_numpy(tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    freq = np.bincount(draw(20000, temperature=temperature), minlength=4)
    want = PROBS ** (1 / temperature) / np.sum(PROBS ** (1 / temperature))
    np.testing.assert_allclose(freq / 20000, want, atol=0.01)


@pytest.mark.parametrize("sampling,allowed,freq", [
    (dict(top_k=2), {0, 1}, [0.625, 0.375]),
    (dict(top_p=0.7), {0, 1}, [0.625, 0.375]),
    (dict(top_p=0.5), {0}, [1.0]),
    (dict(top_k=3, top_p=0.9), {0, 1, 2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]),
])
def test_top_k_and_top_p_sample_only_their_set_renormalised(xp, sampling, allowed, freq):
    tokens = draw(2000, xp.name, xp.device, temperature=1.0, **sampling)
    assert set(np.unique(tokens)) == allowed
    np.testing.assert_allclose(np.bincount(tokens, minlength=len(freq))[:len(freq)] / 2000, freq, atol=0.05)


def test_temperature_zero_is_greedy_and_top_k_one_is_greedy_at_any_temperature():
    assert set(draw(100, temperature=0.0, top_k=3, top_p=0.9)) == {0}
    assert set(draw(100, temperature=100.0, top_k=1)) == {0}


def test_stream_yields_the_columns_generate_appends_and_zero_new_tokens_is_the_prompt():
    ids = prompt()
    out = generate(ids, HOST, config=CONFIG, max_new_tokens=3)
    np.testing.assert_array_equal(np.stack(list(stream(ids, HOST, config=CONFIG, max_new_tokens=3)), axis=1),
                                  out[:, 13:])
    np.testing.assert_array_equal(generate(ids, HOST, config=CONFIG, max_new_tokens=0), ids)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens: expected an int >= 0, got -1"),
    (dict(temperature=-0.5), ValueError, "temperature: expected a number >= 0"),
    (dict(top_k=0), ValueError, "top_k: expected a positive int, got 0"),
    (dict(top_p=0.0), ValueError, r"top_p: expected a number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p: expected a number in \(0, 1\]"),
    (dict(vocab_size=51), ValueError, r"vocab_size: expected an int in \[1, 50\]"),
    (dict(eos_token_id=50), ValueError, r"eos_token_id: expected None or an int in \[0, 50\)"),
    (dict(seed="7"), TypeError, "seed: expected an int or None, got str"),
    (dict(input_ids=prompt().astype(np.float32)), TypeError, "input_ids: expected an integer dtype"),
    (dict(input_ids=prompt()[0]), ValueError, r"input_ids: expected shape \[b, l\]"),
    (dict(input_ids=prompt()[:, :0]), ValueError, r"input_ids: expected shape \[b, l\] with l >= 1"),
    (dict(input_ids=prompt() + 40), ValueError, r"input_ids: expected token ids in \[0, 50\)"),
])
def test_bad_arguments_are_rejected_before_any_token(kwargs, error, message):
    args = dict(input_ids=prompt(), max_new_tokens=2) | kwargs
    with pytest.raises(error, match=message):
        stream(args.pop("input_ids"), HOST, config=CONFIG, **args)  # raises without being iterated


def test_mixed_backends_and_missing_rng_are_type_errors():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="params is a numpy array but input_ids is a torch array"):
        generate(torch.as_tensor(prompt()), HOST, config=CONFIG, max_new_tokens=1)
    with pytest.raises(TypeError, match="rng: temperature > 0 needs a numpy.random.Generator"):
        next_token(np.zeros((1, 4), np.float32), temperature=1.0)


class _Counting:
    """NumPy's array-API namespace, counting the calls of each of its functions by name."""

    def __init__(self) -> None:
        import array_api_compat.numpy as xp

        self.xp, self.calls = xp, {}

    def __getattr__(self, name: str):
        value = getattr(self.xp, name)
        if not callable(value) or isinstance(value, type):
            return value

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return value(*args, **kwargs)
        return counted


@pytest.mark.parametrize("eos", [None, (7,)])
def test_token_chooser_adds_no_filler_work_a_token_until_a_row_finishes(eos):
    """Per token the chooser picks the ids and (with eos) reads how many rows finished: no filler
    ``where`` and no ``fed`` mask while every row is still running; once
    a row finishes it emits the filler there and reports the rows still fed."""
    xp = _Counting()
    ids = np.zeros((2, 3), dtype=np.int64)
    options = generation.check_options(3, 10, max_new_tokens=6, eos_token_id=eos)
    chooser = generation.TokenChooser(options, ids, None, xp=xp)
    last = np.zeros((2, 10), dtype=np.float32)
    last[:, 3] = 1.0  # both rows choose 3
    for _ in range(3):
        token, fed, done = chooser.next(last)
        assert token.tolist() == [3, 3] and fed is None and not done
    assert "where" not in xp.calls and "logical_not" not in xp.calls
    assert xp.calls["argmax"] == 3 and xp.calls.get("sum", 0) == (0 if eos is None else 3)
    if eos is None:
        return
    last[0, 7] = 2.0  # row 0 finishes with eos 7, row 1 goes on
    token, fed, done = chooser.next(last)
    assert token.tolist() == [7, 3] and fed is None and not done
    token, fed, done = chooser.next(last)
    assert token.tolist() == [7, 3] and fed.tolist() == [False, True] and not done  # row 0: the filler
