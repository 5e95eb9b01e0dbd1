"""transformers' Mamba2ForCausalLM is the oracle for serving: left-padded logits and cached greedy
generate with an attention mask, and generate's options (max_length, min_new_tokens,
repetition_penalty, several eos ids, pad_token_id, generation_config.json defaults)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import rel_err
from test_pretrained import hf_model

import portable_ssm as ps
from portable_ssm._array import array_backend
from portable_ssm.generation import left_pad
from portable_ssm.io import CheckpointError, load_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 7, 1, 9, 33, 2, 2, 41, 8, 11, 40, 3, 3], [3, 17, 29], [44, 6, 12, 12, 0, 27, 13], [19]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    model = hf_model(0)
    model.save_pretrained(folder)
    return folder, model


def hf_generate(model, ids, mask=None, **kw) -> np.ndarray:
    ids = torch.as_tensor(np.asarray(ids))
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(np.asarray(mask))
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, **kw).numpy()


def test_left_padded_logits_match_transformers_with_attention_mask(xp, checkpoint):
    folder, model = checkpoint
    lm = load_pretrained(folder, backend=xp.name, device=xp.device)
    ids, mask = (np.asarray(v) for v in left_pad(PROMPTS))
    out = lm.logits(xp.asarray_from(ids), attention_mask=xp.asarray_from(mask))
    with torch.no_grad():
        want = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert array_backend(out) == xp.name and tuple(out.shape) == (4, 13, 50)
    assert rel_err(xp.numpy(out)[real], want[real]) <= 1e-4


def test_ragged_greedy_generate_matches_transformers_left_padded_generate(xp, checkpoint):
    folder, model = checkpoint
    lm = load_pretrained(folder, backend=xp.name, device=xp.device)
    ids, mask = left_pad(PROMPTS)
    want = hf_generate(model, ids, mask, max_new_tokens=8)
    np.testing.assert_array_equal(xp.numpy(lm.generate(PROMPTS, 8)), want)


@pytest.mark.parametrize("options", [
    dict(max_length=17),
    dict(repetition_penalty=1.8, max_new_tokens=10),
    dict(repetition_penalty=0.7, max_new_tokens=6),
    dict(min_new_tokens=4, max_new_tokens=7, eos="first"),
    dict(max_new_tokens=7, eos="first", pad_token_id=49),
    dict(max_new_tokens=7, eos="two"),
], ids=["max_length", "penalty>1", "penalty<1", "min_new_tokens", "pad_token_id", "eos_list"])
def test_generate_options_match_transformers(checkpoint, options):
    folder, model = checkpoint
    lm = load_pretrained(folder)
    ids = np.asarray([PROMPTS[0], PROMPTS[0][::-1]])
    plain = hf_generate(model, ids, max_new_tokens=7)
    options = dict(options)
    eos = options.pop("eos", None)
    if eos == "first":  # row 0's first new token: it would finish at once
        options["eos_token_id"] = int(plain[0, 13])
    elif eos == "two":
        options["eos_token_id"] = [int(plain[1, 15]), int(plain[0, 16])]
    got = lm.generate(ids, **options)
    want = hf_generate(model, ids, **options)
    np.testing.assert_array_equal(got, want)


def test_generation_config_json_gives_the_defaults_transformers_uses(tmp_path):
    model = hf_model(0)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 5, "repetition_penalty": 1.5, "do_sample": False, "transformers_version": "5",
         "bos_token_id": None}))
    lm = load_pretrained(tmp_path)
    assert lm.generation_config == {"max_new_tokens": 5, "repetition_penalty": 1.5, "do_sample": False}
    ids = np.asarray([PROMPTS[2]])
    hf = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path).eval()
    want = hf_generate(hf, ids)  # transformers reads the same file
    assert want.shape == (1, 12)
    np.testing.assert_array_equal(lm.generate(ids), want)
    np.testing.assert_array_equal(lm.generate(ids, 2), hf_generate(hf, ids, max_new_tokens=2))
    # as in transformers, the file's max_new_tokens wins over an explicit max_length
    np.testing.assert_array_equal(lm.generate(ids, max_length=9), hf_generate(hf, ids, max_length=9))
    assert lm.generate(ids, max_length=9).shape == (1, 12)


@pytest.mark.parametrize("field,value", [("max_new_tokens", "5"), ("do_sample", 1), ("top_p", True),
                                         ("eos_token_id", [1, "2"]), ("temperature", -1.0)])
def test_a_mistyped_generation_config_field_is_named(tmp_path, field, value):
    hf_model(0).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
    with pytest.raises(CheckpointError, match=rf"generation_config.json: key '{field}': expected"):
        load_pretrained(tmp_path)


def test_no_generation_config_means_no_defaults(tmp_path):
    hf_model(0).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    lm = load_pretrained(tmp_path)
    assert lm.generation_config == {}
    with pytest.raises(ValueError, match="max_new_tokens: expected max_new_tokens or max_length"):
        lm.generate([[1, 2]])
    assert ps.Mamba2LM(lm.params, lm.config).generation_config == {}
