"""Hostile input to the generation surfaces: only the documented errors, naming what is wrong, before any compute.

Surfaces: ``Mamba2LM.generate`` / ``stream`` / ``logits``, ``portable_ssm.generation.generate`` /
``stream``, ``left_pad``, ``lm.logits``, every generation option, list prompts and masks, the
``logits_processor``'s result, and ``generation_config.json`` read by ``load_pretrained`` (a
CheckpointError naming the file and the key). Each case breaks one input and asserts the error
type and that the message names the argument; the property tests throw arbitrary values at the
options, the prompts and the masks and assert that nothing but a ValueError or TypeError naming
the argument comes out (or a valid result).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import portable_ssm as ps
from portable_ssm import lm
from portable_ssm.generation import generate, left_pad, stream
from portable_ssm.io import CheckpointError, load_pretrained

CONFIG = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, vocab_size=40, pad_vocab_size_multiple=8)
PARAMS = ps.init_params(CONFIG, seed=0)  # 48 embedding rows, 40 real tokens
MODEL = ps.Mamba2LM(PARAMS, CONFIG)
IDS = np.asarray([[1, 2, 3]])


def _gen(**options: Any) -> Callable[[], Any]:
    """``stream`` (never iterated: everything must be checked before it returns) with ``options``."""
    options = {"max_new_tokens": 2} | options
    return lambda: stream(options.pop("input_ids", IDS), PARAMS, config=CONFIG, **options)


def _processor(result: Callable[[np.ndarray], Any]) -> Callable[[], Any]:
    """Greedy generation whose logits_processor returns ``result(scores)``."""
    return lambda: generate(IDS, PARAMS, config=CONFIG, max_new_tokens=2,
                            logits_processor=lambda ids, scores: result(scores))


def _torch_scores(scores: np.ndarray) -> Any:
    return pytest.importorskip("torch").as_tensor(scores)


CASES: list[tuple[str, type[Exception], str, Callable[[], Any]]] = [
    # token ids in list prompts: never truncated, parsed or read as 0/1
    ("list-ids-float", TypeError, "input_ids[0][0]", lambda: MODEL.generate([[1.5, 2]], 2)),
    ("list-ids-whole-float", TypeError, "input_ids[0][1]", lambda: MODEL.generate([[1, 2.0]], 2)),
    ("list-ids-bool", TypeError, "input_ids[0][0]", lambda: MODEL.generate([[True, False]], 2)),
    ("list-ids-str", TypeError, "input_ids[0][1]", lambda: MODEL.generate([[1, "2"]], 2)),
    ("list-ids-None", TypeError, "input_ids[0][0]", lambda: MODEL.generate([[None, 2]], 2)),
    ("list-ids-nested", TypeError, "input_ids[0][1]", lambda: MODEL.generate([[1, [2]]], 2)),
    ("list-ids-flat", TypeError, "input_ids[0]", lambda: MODEL.generate([1, 2], 2)),
    ("list-ids-negative", ValueError, "input_ids[1][0]", lambda: MODEL.generate([[1], [-1, 2]], 2)),
    ("list-ids-past-rows", ValueError, "input_ids[0][1]", lambda: MODEL.generate([[1, 48]], 2)),
    ("list-ids-huge", ValueError, "input_ids[0][0]", lambda: MODEL.generate([[2**70]], 2)),
    ("list-ids-empty", ValueError, "input_ids", lambda: MODEL.generate([], 2)),
    ("list-ids-empty-prompt", ValueError, "input_ids[1]", lambda: MODEL.generate([[1], []], 2)),
    ("list-ids-logits-float", TypeError, "input_ids[0][0]", lambda: MODEL.logits([[1.5, 2]])),
    ("list-ids-stream-bool", TypeError, "input_ids[0][0]", lambda: MODEL.stream([[True]], 2)),
    ("array-ids-None", TypeError, "input_ids", lambda: generate(None, PARAMS, config=CONFIG, max_new_tokens=1)),
    ("lm-logits-ids-None", TypeError, "input_ids", lambda: lm.logits(None, PARAMS, config=CONFIG)),
    # attention masks: 0/1 or bool exactly, the ids' shape
    ("list-mask-fractional", TypeError, "attention_mask[0][0]",
     lambda: MODEL.generate([[1, 2, 3]], 2, attention_mask=[[0.5, 1, 1]])),
    ("list-mask-float-ones", TypeError, "attention_mask[0][0]",
     lambda: MODEL.logits([[1, 2, 3]], attention_mask=[[1.0, 1.0, 1.0]])),
    ("list-mask-two", ValueError, "attention_mask[0][0]",
     lambda: MODEL.logits([[1, 2, 3]], attention_mask=[[2, 1, 1]])),
    ("list-mask-str", TypeError, "attention_mask[0][0]",
     lambda: MODEL.logits([[1, 2, 3]], attention_mask=[["1", 1, 1]])),
    ("list-mask-short-row", ValueError, "attention_mask", lambda: MODEL.logits([[1, 2, 3]], attention_mask=[[1, 1]])),
    ("list-mask-rows", ValueError, "attention_mask", lambda: MODEL.logits([[1, 2, 3]], attention_mask=[[1, 1, 1]] * 2)),
    ("list-mask-ragged-prompts", ValueError, "attention_mask",
     lambda: MODEL.generate([[1, 2, 3], [1]], 2, attention_mask=[[1, 1, 1], [1]])),
    ("array-mask-fractional", TypeError, "attention_mask",
     lambda: MODEL.logits([[1, 2, 3]], attention_mask=np.asarray([[0.5, 1, 1]]))),
    ("array-mask-shape", ValueError, "attention_mask", _gen(attention_mask=np.ones((1, 2), np.int64))),
    # left_pad
    ("left_pad-float", TypeError, "prompts[0][0]", lambda: left_pad([[1.5, 2]])),
    ("left_pad-bool", TypeError, "prompts[0][0]", lambda: left_pad([[True]])),
    ("left_pad-str-prompt", TypeError, "prompts[0]", lambda: left_pad(["ab"])),
    ("left_pad-array", TypeError, "prompts", lambda: left_pad(np.asarray([[1, 2]]))),
    ("left_pad-pad-bool", TypeError, "pad_token_id", lambda: left_pad([[1]], pad_token_id=True)),
    ("left_pad-pad-float", TypeError, "pad_token_id", lambda: left_pad([[1], [1, 2]], pad_token_id=0.5)),
    ("left_pad-pad-negative", ValueError, "pad_token_id", lambda: left_pad([[1]], pad_token_id=-1)),
    # options: validated at the door, naming the option
    ("max-new-bool", TypeError, "max_new_tokens", _gen(max_new_tokens=True)),
    ("max-new-float", TypeError, "max_new_tokens", _gen(max_new_tokens=2.0)),
    ("max-length-str", TypeError, "max_length", _gen(max_new_tokens=None, max_length="9")),
    ("min-new-negative", ValueError, "min_new_tokens", _gen(min_new_tokens=-1)),
    ("temperature-empty-str", TypeError, "temperature", _gen(temperature="")),
    ("temperature-nan-greedy", ValueError, "temperature", _gen(temperature=math.nan, do_sample=False)),
    ("temperature-bool", TypeError, "temperature", _gen(temperature=True)),
    ("top-k-negative", ValueError, "top_k", _gen(temperature=1.0, top_k=-3)),
    ("top-k-bool", TypeError, "top_k", _gen(temperature=1.0, top_k=True)),
    ("top-p-above-one", ValueError, "top_p", _gen(temperature=1.0, top_p=1.01)),
    ("top-p-str", TypeError, "top_p", _gen(temperature=1.0, top_p="0.9")),
    ("seed-negative", ValueError, "seed", _gen(temperature=1.0, seed=-1)),
    ("seed-bool", TypeError, "seed", _gen(temperature=1.0, seed=False)),
    ("penalty-inf", ValueError, "repetition_penalty", _gen(repetition_penalty=math.inf)),
    ("penalty-str", TypeError, "repetition_penalty", _gen(repetition_penalty="1.2")),
    ("do-sample-int", TypeError, "do_sample", _gen(do_sample=1)),
    ("eos-past-vocab", ValueError, "eos_token_id", _gen(eos_token_id=40)),
    ("eos-bool-in-list", ValueError, "eos_token_id", _gen(eos_token_id=[3, True])),
    ("pad-past-rows", ValueError, "pad_token_id", _gen(pad_token_id=48)),
    ("pad-float", TypeError, "pad_token_id", _gen(pad_token_id=1.0)),
    ("stop-empty-sequence", ValueError, "stop[1]", _gen(stop=[[1], []], eos_token_id=1)),
    ("stop-float-id", TypeError, "stop[0][1]", _gen(stop=[[1, 2.0]], eos_token_id=1)),
    ("stop-bool-id", TypeError, "stop[0][0]", _gen(stop=[[True]], eos_token_id=1)),
    ("stop-past-vocab", ValueError, "stop[0][0]", _gen(stop=[[45]], eos_token_id=1)),
    ("stop-str", TypeError, "stop", _gen(stop="ab", eos_token_id=1)),
    ("stop-flat", TypeError, "stop", _gen(stop=[1, 2], eos_token_id=1)),
    ("logits-processor-int", TypeError, "logits_processor", _gen(logits_processor=3)),
    ("compile-int", TypeError, "compile", _gen(compile=1)),
    ("vocab-size-bool", TypeError, "vocab_size", _gen(vocab_size=True)),
    ("unknown-option", TypeError, "top_kk", _gen(top_kk=3)),
    ("return-state-str", TypeError, "return_state", _gen(return_state="yes")),
    ("return-state-int", TypeError, "return_state",
     lambda: generate(IDS, PARAMS, config=CONFIG, max_new_tokens=1, return_state=1)),
    ("lm-logits-return-state-str", TypeError, "return_state",
     lambda: lm.logits(IDS, PARAMS, config=CONFIG, return_state="no")),
    ("model-generate-option-none-is-unset", ValueError, "max_new_tokens", lambda: MODEL.generate([[1]], None)),
    # the logits_processor's result: the shape, dtype, backend and device of the scores it was given
    ("processor-None", TypeError, "logits_processor", _processor(lambda s: None)),
    ("processor-list", TypeError, "logits_processor", _processor(lambda s: s.tolist())),
    ("processor-shape", ValueError, "logits_processor", _processor(lambda s: s[:, :3])),
    ("processor-int-dtype", ValueError, "logits_processor", _processor(lambda s: s.astype(np.int32))),
    ("processor-float64", ValueError, "logits_processor", _processor(lambda s: s.astype(np.float64))),
    ("processor-torch", TypeError, "logits_processor", _processor(_torch_scores)),
    ("processor-nan", ValueError, "logits_processor", _processor(lambda s: s * np.nan)),
    ("processor-all-masked", ValueError, "logits_processor", _processor(lambda s: np.full_like(s, -np.inf))),
    # the model's own defaults
    ("model-generation-config-top-p", ValueError, "generation_config['top_p']",
     lambda: ps.Mamba2LM(PARAMS, CONFIG, generation_config={"top_p": 2.0})),
    ("model-generation-config-unknown", TypeError, "generation_config['topk']",
     lambda: ps.Mamba2LM(PARAMS, CONFIG, generation_config={"topk": 2})),
    ("model-generation-config-list", TypeError, "generation_config",
     lambda: ps.Mamba2LM(PARAMS, CONFIG, generation_config=[("top_k", 2)])),
    ("model-generation-config-sample-at-zero", ValueError, "generation_config['temperature']",
     lambda: ps.Mamba2LM(PARAMS, CONFIG, generation_config={"do_sample": True, "temperature": 0})),
    ("model-vocab-size-bool", ValueError, "vocab_size", lambda: ps.Mamba2LM(PARAMS, CONFIG, vocab_size=True)),
    ("model-vocab-size-float", ValueError, "vocab_size", lambda: ps.Mamba2LM(PARAMS, CONFIG, vocab_size=30.0)),
    ("model-layout", ValueError, "layout", lambda: ps.Mamba2LM(PARAMS, CONFIG, layout="gguf")),
]


@pytest.mark.parametrize("name, error, argument, call", CASES, ids=[c[0] for c in CASES])
def test_hostile_generation_input_raises_the_documented_error_naming_it(name: str, error: type[Exception],
                                                                      argument: str, call: Callable[[], Any]) -> None:
    with pytest.raises(error) as info:
        call()
    assert argument in str(info.value), f"{name}: the message does not name {argument!r}: {info.value}"


def test_a_negative_seed_is_refused_before_the_prompt_is_read(monkeypatch) -> None:
    import portable_ssm.generation as generation

    def no_prefill(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the prompt was prefilled before the options were checked")

    monkeypatch.setattr(generation, "_prefiller", no_prefill)
    with pytest.raises(ValueError, match=r"seed: expected an int >= 0 or None, got -1"):
        stream(IDS, PARAMS, config=CONFIG, max_new_tokens=2, temperature=1.0, seed=-1)


def test_valid_list_prompts_and_masks_give_the_array_results() -> None:
    ids, mask = left_pad([[5, 7, 1], [3]], pad_token_id=np.int64(2))
    assert ids == [[5, 7, 1], [2, 2, 3]] and mask == [[1, 1, 1], [0, 0, 1]]
    as_lists = MODEL.generate(ids, 3, attention_mask=[[True, True, True], [False, False, True]])
    np.testing.assert_array_equal(as_lists, MODEL.generate(np.asarray(ids), 3, attention_mask=np.asarray(mask)))
    np.testing.assert_array_equal(MODEL.generate([(np.int64(5), 7, 1)], 2), MODEL.generate(np.asarray([[5, 7, 1]]), 2))


def test_numpy_numbers_are_taken_as_the_numbers_they_are() -> None:
    want = generate(IDS, PARAMS, config=CONFIG, max_new_tokens=3, temperature=0.5, top_k=5, seed=1, eos_token_id=4)
    got = generate(IDS, PARAMS, config=CONFIG, max_new_tokens=np.int64(3), temperature=np.float32(0.5),
                   top_k=np.int32(5), seed=np.uint8(1), eos_token_id=np.int16(4))
    np.testing.assert_array_equal(got, want)


def test_quantize_keeps_the_generation_defaults() -> None:
    model = ps.Mamba2LM(PARAMS, CONFIG, generation_config={"max_new_tokens": 3})
    assert model.quantize("int8").generation_config == {"max_new_tokens": 3}
    assert model.quantize("int8").generate([[1, 2]]).shape == (1, 5)


# --- generation_config.json ---

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_pretrained import write_transformers_checkpoint

    folder = tmp_path_factory.mktemp("hostile-generation")
    write_transformers_checkpoint(folder)  # vocab_size 50
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def _with_generation_config(checkpoint, tmp_path, text: str):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    (folder / "generation_config.json").write_text(text)
    return folder


@pytest.mark.parametrize("fields, key", [
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"temperature": "0.7"}, "temperature"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"eos_token_id": 50}, "eos_token_id"),
    ({"eos_token_id": []}, "eos_token_id"),
    ({"eos_token_id": [1, True]}, "eos_token_id"),
    ({"pad_token_id": 10**6}, "pad_token_id"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"min_new_tokens": -2}, "min_new_tokens"),
    ({"do_sample": "true"}, "do_sample"),
    ({"do_sample": True, "temperature": 0.0}, "temperature"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_generation_config_json_field_is_a_checkpoint_error_naming_file_and_key(checkpoint, tmp_path,
                                                                                   fields, key):
    folder = _with_generation_config(checkpoint, tmp_path, json.dumps(fields))
    with pytest.raises(CheckpointError) as info:
        load_pretrained(folder)
    message = str(info.value)
    assert f"generation_config.json: key '{key}'" in message and "config.json:" not in message.replace(
        "generation_config.json:", ""), message


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_temperature_in_generation_config_json_is_named(checkpoint, tmp_path, value):
    folder = _with_generation_config(checkpoint, tmp_path, f'{{"temperature": {value}}}')
    with pytest.raises(CheckpointError, match=r"generation_config.json: key 'temperature': expected a number >= 0"):
        load_pretrained(folder)


def test_generation_config_json_reads_transformers_defaults_and_ignores_unknown_fields(checkpoint, tmp_path):
    fields = {"top_k": 0, "top_p": 1.0, "temperature": 1.0, "do_sample": False, "max_new_tokens": 3,
              "bos_token_id": 0, "transformers_version": "5.0", "num_beams": 1, "eos_token_id": None,
              "stop_strings": ["x"], "seed": "not read"}
    folder = _with_generation_config(checkpoint, tmp_path, json.dumps(fields))
    model = load_pretrained(folder)
    assert model.generation_config == {"top_p": 1.0, "temperature": 1.0, "do_sample": False, "max_new_tokens": 3}
    assert model.generate([[1, 2]]).shape == (1, 5)


# --- property tests ---

ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 60) | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner),
    max_leaves=6)
OPTIONS = ["max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed",
           "repetition_penalty", "eos_token_id", "pad_token_id", "stop", "vocab_size"]


HOSTILE_ID = st.sampled_from([-1, 48, 2**70, True, 1.0, 1.5, "1", None, [1]])
ID_LIKE = st.one_of(*[st.integers(0, 47)] * 6, HOSTILE_ID)
PROMPTS = st.one_of(*[st.lists(st.lists(ID_LIKE, min_size=1, max_size=4), min_size=1, max_size=3)] * 3,
                    st.lists(st.lists(ID_LIKE, max_size=4), max_size=3), ANY_VALUE)
MASK_ENTRY = st.sampled_from([0, 1, 1, True, False, 0.5, 1.0, 2, "1", None])
MASKS = st.one_of(st.none(), st.none(), st.lists(st.lists(MASK_ENTRY, max_size=4), max_size=3), ANY_VALUE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option=st.sampled_from(OPTIONS), value=ANY_VALUE)
def test_any_value_of_any_option_runs_or_raises_an_error_naming_the_option(option: str, value: Any) -> None:
    try:
        out = generate(IDS, PARAMS, config=CONFIG, **{"max_new_tokens": 2, "eos_token_id": 1, "temperature": 1.0,
                                                      "seed": 0, option: value})  # sampling: every option is read
    except (ValueError, TypeError) as err:
        assert option in str(err), str(err)
        return
    assert out.shape[0] == 1 and 3 <= out.shape[1] and bool(((out >= 0) & (out < 48)).all())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=PROMPTS, mask=MASKS)
def test_any_list_prompt_and_mask_runs_or_raises_an_error_naming_them(prompts: Any, mask: Any) -> None:
    try:
        out = MODEL.generate(prompts, 1, attention_mask=mask, eos_token_id=None)
    except (ValueError, TypeError) as err:
        assert "input_ids" in str(err) or "attention_mask" in str(err), str(err)
        event("refused")
        return
    event("generated")
    assert out.shape == (len(prompts), max(len(p) for p in prompts) + 1)
    np.testing.assert_array_equal(out[:, :-1][:, -len(prompts[0]):][0], prompts[0])


@settings(max_examples=60, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(OPTIONS + ["num_beams", "bos_token_id"]), ANY_VALUE, max_size=3))
def test_any_generation_config_is_checked_when_the_model_is_built(fields: dict[str, Any]) -> None:
    try:
        model = ps.Mamba2LM(PARAMS, CONFIG, generation_config=fields)
    except (ValueError, TypeError) as err:
        assert "generation_config" in str(err), str(err)
        return
    try:
        model.generate([[1, 2]], 2)
    except (ValueError, TypeError) as err:  # only what depends on the prompt: max_length below it, stop without filler
        assert "max_length" in str(err) or "stop" in str(err), str(err)
