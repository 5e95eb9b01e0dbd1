"""HybridLM's generation options: the Mamba-2 model's checks, defaults and token choice
(:class:`portable_ssm.generation.TokenChooser`), held to transformers' generate on a tiny
Granite-4.0-H model and to the shared sampler for seeded sampling."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from portable_ssm.backends import load
from test_families import FAMILIES, NUMPY

import portable_ssm
from portable_ssm.generation import next_token
from portable_ssm.io import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT, NEW = 6, 6


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """A saved tiny Granite-4.0-H model (MoE, RoPE), its transformers twin and a prompt ``[2, 6]``."""
    config_cls, model_cls, kwargs = FAMILIES["granite_moe_rope"]()
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    for param in model.parameters():
        if param.ndim == 1:
            param.data = param.data + 0.1 * torch.randn_like(param)
    folder = tmp_path_factory.mktemp("granite")
    model.save_pretrained(folder)
    ids = torch.randint(1, 64, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    return dict(model=model, folder=str(folder), ids=ids)


def _hf(granite, **options) -> np.ndarray:
    with torch.no_grad():
        out = granite["model"].generate(granite["ids"], do_sample=False, max_new_tokens=NEW, **options)
    return out[:, PROMPT:].numpy()


def _new(xp, out, ids) -> np.ndarray:
    """The new tokens of ``generate``'s ``[b, l + new]`` result, once its first l columns are ``ids``."""
    out, ids = xp.numpy(out), xp.numpy(ids)
    np.testing.assert_array_equal(out[:, :ids.shape[1]], ids)
    return out[:, ids.shape[1]:]


def _load(xp, granite):
    return portable_ssm.load_pretrained(granite["folder"], backend=xp.name, device=xp.device)


def _model_and_ids(xp, granite):
    lm = _load(xp, granite)
    return lm, xp.asarray_from(granite["ids"].numpy(), "int64")


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.7),
    dict(min_new_tokens=4, eos_token_id=[7, 11]),
    dict(repetition_penalty=0.6, min_new_tokens=2),
], ids=["repetition_penalty", "min_new_tokens_and_eos_list", "penalty_below_one"])
def test_greedy_options_are_token_equal_to_transformers(xp, granite, options):
    lm, ids = _model_and_ids(xp, granite)
    plain = _hf(granite)
    if "eos_token_id" in options:  # eos ids the unconstrained run emits early, so min_new_tokens matters
        options = dict(options, eos_token_id=[int(plain[0, 1]), int(plain[1, 0])], pad_token_id=0)
    want = _hf(granite, **options)
    got = _new(xp, lm.generate(ids, **options, max_new_tokens=NEW), ids)
    np.testing.assert_array_equal(got, want[:, :got.shape[1]])
    assert got.shape[1] == want.shape[1] or (want[:, got.shape[1]:] == options.get("pad_token_id")).all()


def test_eos_list_stops_rows_and_pads_as_transformers(xp, granite):
    lm, ids = _model_and_ids(xp, granite)
    plain = _hf(granite)
    eos = [int(plain[0, 2]), int(plain[1, 1])]
    want = _hf(granite, eos_token_id=eos, pad_token_id=0)
    got = _new(xp, lm.generate(ids, NEW, eos_token_id=eos, pad_token_id=0), ids)
    np.testing.assert_array_equal(got, want[:, :got.shape[1]])
    assert (want[:, got.shape[1]:] == 0).all()


def test_a_stop_sequence_ends_the_row_after_it_then_pads(xp, granite):
    lm, ids = _model_and_ids(xp, granite)
    plain = _new(xp, lm.generate(ids, NEW, eos_token_id=None), ids)
    stop = [int(plain[0, 1]), int(plain[0, 2])]
    got = _new(xp, lm.generate(ids, NEW, eos_token_id=None, stop=[stop], pad_token_id=0), ids)
    np.testing.assert_array_equal(got[0, :3], plain[0, :3])
    assert (got[0, 3:] == 0).all()
    row1 = plain[1].tolist()
    ends = [t + 2 for t in range(NEW - 1) if row1[t:t + 2] == stop]
    np.testing.assert_array_equal(got[1, :ends[0] if ends else NEW], plain[1, :ends[0] if ends else NEW])


def test_jax_compiles_the_hybrid_prefill_once_per_shape_and_the_step_once(granite):
    pytest.importorskip("jax")
    from portable_ssm.backends import jax as jax_backend

    lm = portable_ssm.load_pretrained(granite["folder"], backend="jax")
    ids = load("jax").asarray(granite["ids"].numpy(), "int64", None)
    before = dict(jax_backend.TRACES)
    got = lm.generate(ids, NEW, eos_token_id=None)
    traced = dict(jax_backend.TRACES)
    for name in ("hybrid prefill", "hybrid step"):  # once, or not at all where an earlier test traced these shapes
        assert before.get(name, 0) <= traced.get(name, 0) <= before.get(name, 0) + 1 and traced.get(name, 0) >= 1
    again = lm.generate(ids, NEW, eos_token_id=None)
    assert dict(jax_backend.TRACES) == traced  # the second call reuses the compiled prefill and step
    host = portable_ssm.load_pretrained(granite["folder"], backend="numpy")
    want = host.generate(granite["ids"].numpy(), NEW, eos_token_id=None)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(again), want)
    every = lm.logits(ids)  # [b, l, V]
    traced = dict(jax_backend.TRACES)
    kept, _ = lm.prefill(ids, logits_to_keep=ids.shape[1] + 3)
    assert dict(jax_backend.TRACES) == traced  # keeping l or more positions is the compiled call that keeps all
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(every))


def test_seeded_sampling_draws_what_the_shared_sampler_draws(xp, granite):
    lm, ids = _model_and_ids(xp, granite)
    options = dict(temperature=0.8, top_k=20, top_p=0.9)
    got = _new(xp, lm.generate(ids, NEW, do_sample=True, seed=5, eos_token_id=None, **options), ids)
    rng, seq = load("numpy").rng(5), ids
    want = []
    for _ in range(NEW):  # the whole sequence recomputed each step, the token from the shared sampler
        token = next_token(lm.logits(seq)[:, -1, :], rng=rng, **options)
        want.append(xp.numpy(token))
        seq = xp.concat([seq, xp.astype(token, seq.dtype)[:, None]], axis=1)
    np.testing.assert_array_equal(got, np.stack(want, axis=1))
    again = _new(xp, lm.generate(ids, NEW, do_sample=True, seed=5, eos_token_id=None, **options), ids)
    np.testing.assert_array_equal(got, again)


def test_list_prompts_are_left_padded_and_give_each_row_alone(xp, granite):
    lm, ids = _model_and_ids(xp, granite)
    host = granite["ids"].numpy()
    prompts = [host[0].tolist(), host[1, 3:].tolist()]
    got = xp.numpy(lm.generate(prompts, NEW, eos_token_id=None))  # [2, 6 + NEW], row 1 left-padded with 0
    alone = xp.numpy(lm.generate([prompts[1]], NEW, eos_token_id=None))  # [1, 3 + NEW]
    np.testing.assert_array_equal(got[1], [0, 0, 0, *alone[0]])
    np.testing.assert_array_equal(got[0], xp.numpy(lm.generate(ids[0:1, :], NEW, eos_token_id=None))[0])
    streamed = np.stack([xp.numpy(t) for t, _ in lm.stream(prompts, NEW, eos_token_id=None)], axis=1)
    np.testing.assert_array_equal(streamed, got[:, PROMPT:])


@pytest.mark.parametrize("options, error, named", [
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=2, top_k=1.5, do_sample=True), TypeError, "top_k"),
    (dict(max_new_tokens=2, temperature=float("nan")), ValueError, "temperature"),
    (dict(max_new_tokens=2, seed=-1), ValueError, "seed"),
    (dict(max_new_tokens=2, eos_token_id=[3, 64]), ValueError, "eos_token_id"),
    (dict(max_new_tokens=2, stop=[[]]), ValueError, "stop"),
    (dict(max_new_tokens=2, repetition_penalty=0), ValueError, "repetition_penalty"),
    (dict(max_new_tokens=2, logits_processor="greedy"), TypeError, "logits_processor"),
    (dict(max_new_tokens=2, beams=4), TypeError, "beams"),
    (dict(max_new_tokens=2, compile=True), ValueError, "compile"),
    (dict(), ValueError, "max_new_tokens"),
])
def test_hostile_options_are_refused_naming_them(granite, options, error, named):
    lm = portable_ssm.load_pretrained(granite["folder"])
    with pytest.raises(error, match=named):
        lm.generate(granite["ids"].numpy(), **options)
    with pytest.raises(error, match=named):
        next(lm.stream(granite["ids"].numpy(), **options))


def test_hostile_list_prompts_are_refused_naming_the_entry(granite):
    lm = portable_ssm.load_pretrained(granite["folder"])
    with pytest.raises(TypeError, match=r"input_ids\[1\]\[0\]"):
        lm.generate([[1, 2], [True]], 2)
    with pytest.raises(ValueError, match=r"input_ids\[0\]\[1\]"):
        lm.generate([[1, 64]], 2)
    with pytest.raises(ValueError, match="attention_mask"):
        lm.generate([[1, 2], [3]], 2, attention_mask=[[1, 1], [0, 1]])


def test_generation_config_json_sets_the_defaults_and_is_checked(granite, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copytree(granite["folder"], folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "repetition_penalty": 1.7}))
    lm = portable_ssm.load_pretrained(str(folder))
    assert lm.generation_config == {"max_new_tokens": 3, "repetition_penalty": 1.7}
    got = _new(NUMPY, lm.generate(granite["ids"].numpy(), eos_token_id=None), granite["ids"].numpy())
    np.testing.assert_array_equal(got, _hf(granite, repetition_penalty=1.7)[:, :3])
    assert lm.generate(granite["ids"].numpy(), 5, eos_token_id=None).shape == (2, PROMPT + 5)  # explicit wins
    (folder / "generation_config.json").write_text(json.dumps({"top_k": -2}))
    with pytest.raises(CheckpointError, match="generation_config.json.*top_k"):
        portable_ssm.load_pretrained(str(folder))


@pytest.fixture(scope="module")
def mamba2_folder(tmp_path_factory):
    """A saved tiny pure Mamba-2 model (transformers' Mamba2ForCausalLM) with Granite's vocabulary."""
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8,
                                    num_heads=8, n_groups=1, chunk_size=8, eos_token_id=None, bos_token_id=None,
                                    pad_token_id=None)
    folder = tmp_path_factory.mktemp("mamba2")
    transformers.Mamba2ForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def test_mamba2_and_hybrid_generate_return_the_prompt_then_the_new_tokens_alike(xp, granite, mamba2_folder):
    """One contract for both model kinds (and transformers'): ``[b, l + new]``, the prompt (lists
    left-padded with 0) then the new tokens, a row that stopped at eos padded after it; with
    ``return_state`` the same ids beside a state; none asked, the prompt alone. ``eos_token_id`` is
    each model's first greedy token of row 0, so that row stops after one token."""
    prompts = [[5, 9, 2, 7], [3, 8]]
    padded = np.asarray([[5, 9, 2, 7], [0, 0, 3, 8]])
    for folder in (mamba2_folder, granite["folder"]):
        lm = portable_ssm.load_pretrained(folder, backend=xp.name, device=xp.device)
        out = xp.numpy(lm.generate(prompts, NEW, eos_token_id=None))
        assert out.shape == (2, 4 + NEW), folder
        np.testing.assert_array_equal(out[:, :4], padded)
        ids = xp.asarray_from(padded, "int64")
        mask = xp.asarray_from(padded > 0, "int64")
        same, state = lm.generate(ids, NEW, attention_mask=mask, eos_token_id=None, return_state=True)
        assert same.dtype == ids.dtype and state is not None
        np.testing.assert_array_equal(xp.numpy(same), out)
        eos = int(out[0, 4])
        stopped = xp.numpy(lm.generate(prompts, NEW, eos_token_id=eos, pad_token_id=0))
        assert 5 <= stopped.shape[1] <= 4 + NEW
        np.testing.assert_array_equal(stopped[0], [*out[0, :5], *[0] * (stopped.shape[1] - 5)])
        np.testing.assert_array_equal(xp.numpy(lm.generate(prompts, 0)), padded)  # no new tokens: the prompt
