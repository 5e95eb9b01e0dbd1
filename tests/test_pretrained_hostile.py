"""load_pretrained on hostile files, config fidelity and the Hugging Face cache.

Hostile checkpoints (shard names that climb out of the directory, malformed config.json, index
and metadata JSON, configs far larger than their files, integer weights) only ever raise
CheckpointError naming the file and the key or tensor. config.json's initializer_range,
rescale_prenorm_residual and eos_token_id (one id or several) are read through, and generation
stops at the checkpoint's eos like transformers' generate. Hub ids are found in a fake local
cache laid out as huggingface_hub lays it out (snapshots symlinked into blobs/).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import threading

import numpy as np
import pytest
from conftest import rel_err
from test_pretrained import (
    edit_tensors,
    hf_greedy,
    hf_logits,
    hf_model,
    prompt,
    state_spaces_dir,
    write_transformers_checkpoint,
)

import portable_ssm as ps
from portable_ssm.cli import main
from portable_ssm.io import CheckpointError, load_pretrained
from portable_ssm.io.pretrained import hub_cache

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny transformers checkpoint (and its model), written once; tests edit copies of it."""
    folder = tmp_path_factory.mktemp("pristine")
    return folder, write_transformers_checkpoint(folder)


@pytest.fixture
def checkpoint(pristine, tmp_path):
    """A fresh copy of :func:`pristine`'s directory: ``tmp_path / "model"``."""
    folder = tmp_path / "model"
    shutil.copytree(pristine[0], folder)
    return folder


def edit_json(path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def shard(folder, names: dict[str, str]) -> None:
    """Replaces ``folder``'s single weight file by an index whose weight_map sends every tensor of
    ``model.safetensors`` to ``names[tensor]`` (default: the file as it is)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        keys = list(f.keys())
    weight_map = {k: names.get(k, "model.safetensors") for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def raises_naming(path, *fragments):
    """pytest.raises(CheckpointError) whose message names ``path`` and every fragment."""
    return pytest.raises(CheckpointError, match="(?s)" + ".*".join(re.escape(str(f)) for f in (path, *fragments)))


# --- shard names in the index ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside/model.safetensors", "/etc/passwd", "../../../../etc/passwd",
                                  "sub/../../outside/model.safetensors", "C:/model.safetensors",
                                  "..\\outside\\model.safetensors", "", "./model.safetensors"],
                         ids=["parent", "absolute", "passwd", "parent-in-middle", "drive", "backslash",
                              "empty", "dot"])
def test_index_shard_names_outside_the_directory_are_refused_before_opening(checkpoint, tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(checkpoint / "model.safetensors", outside / "model.safetensors")
    shard(checkpoint, {"backbone.norm_f.weight": name})
    with raises_naming(checkpoint / "model.safetensors.index.json", "weight_map: shard",
                       "is not a relative path inside the model directory") as info:
        load_pretrained(checkpoint)
    assert "8 bytes" not in str(info.value) and "header" not in str(info.value)


def test_index_shard_under_a_directory_symlinked_outside_is_refused(checkpoint, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(checkpoint / "model.safetensors", outside / "model.safetensors")
    (checkpoint / "linked").symlink_to(outside, target_is_directory=True)
    names = all_tensors(outside / "model.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "linked/model.safetensors" for k in names}}))
    with raises_naming(checkpoint / "model.safetensors.index.json", "'linked/model.safetensors'",
                       "outside the model directory"):
        load_pretrained(checkpoint)


def all_tensors(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return list(f.keys())


def test_index_shard_in_a_nested_directory_and_a_symlinked_file_load(pristine, checkpoint, tmp_path):
    elsewhere = tmp_path / "disk2"
    elsewhere.mkdir()
    (checkpoint / "shards").mkdir()
    shutil.move(checkpoint / "model.safetensors", elsewhere / "weights.safetensors")
    (checkpoint / "shards" / "model-1.safetensors").symlink_to(elsewhere / "weights.safetensors")
    names = all_tensors(elsewhere / "weights.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "shards/model-1.safetensors" for k in names}}))
    ids = prompt(50)
    assert rel_err(load_pretrained(checkpoint).logits(ids), hf_logits(pristine[1], ids)) <= 1e-4


@pytest.mark.parametrize("text,fragment", [
    ("[1, 2]", "weight_map: expected a non-empty JSON object"),
    ('{"metadata": {}}', "weight_map: expected a non-empty JSON object"),
    ('{"weight_map": ["model.safetensors"]}', "weight_map: expected a non-empty JSON object"),
    ('{"weight_map": {"backbone.norm_f.weight": 5}}', "shard 5 is not a relative path"),
    ('{"weight_map": {"backbone.norm_f.weight": null}}', "shard None is not a relative path"),
    ('{"weight_map": ', "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deep)"),
    ('{"weight_map": {"backbone.norm_f.weight": "model-2.safetensors"}}', "'model-2.safetensors' is listed but"),
    ('{"weight_map": {"backbone.nothing": "model.safetensors"}}', "tensor 'backbone.nothing' is listed but not"),
], ids=["list", "no-weight-map", "weight-map-list", "shard-int", "shard-null", "truncated", "nested",
        "missing-shard", "tensor-not-in-shard"])
def test_malformed_index_json_is_a_checkpoint_error_naming_the_index(checkpoint, text, fragment):
    (checkpoint / "model.safetensors.index.json").write_text(text)
    with raises_naming(checkpoint / "model.safetensors.index.json", fragment):
        load_pretrained(checkpoint)


# --- config.json --------------------------------------------------------------------------------

def _set(**items):
    return lambda raw: raw.update(items)


@pytest.mark.parametrize("edit,fragment", [
    (_set(hidden_size="16"), "hidden_size: expected an int, got '16'"),
    (_set(hidden_size=32.0), "hidden_size: expected an int, got 32.0"),
    (_set(num_hidden_layers=True), "num_hidden_layers: expected an int, got True"),
    (_set(state_size=None), "state_size: expected an int, got None"),
    (_set(n_groups=0), "Mamba2Config.ngroups: expected a positive int, got 0"),
    (_set(vocab_size=-3), "Mamba2Config.vocab_size: expected a positive int or None, got -3"),
    (_set(num_hidden_layers=10**9), "Mamba2Config.n_layer: expected a positive int, got 1000000000"),
    (_set(use_bias="false"), "use_bias: expected true or false, got 'false'"),
    (_set(tie_word_embeddings=1), "tie_word_embeddings: expected true or false, got 1"),
    (_set(time_step_min=float("nan")), "time_step_min: expected a finite number, got nan"),
    (_set(layer_norm_epsilon=float("inf")), "layer_norm_epsilon: expected a finite number, got inf"),
    (_set(initializer_range="0.1"), "initializer_range: expected a finite number, got '0.1'"),
    (_set(rescale_prenorm_residual="no"), "rescale_prenorm_residual: expected true or false"),
    (_set(time_step_limit=[0.0]), "time_step_limit: expected a list of two numbers, got [0.0]"),
    (_set(time_step_limit=[0.0, float("nan")]), "time_step_limit: expected a list of two numbers"),
    (_set(time_step_limit={"low": 0}), "time_step_limit: expected a list of two numbers"),
    (_set(hidden_act=["silu"]), "hidden_act: only 'silu' is supported, got ['silu']"),
    (_set(eos_token_id="2"), "eos_token_id: expected null, an int or a list of ints, got '2'"),
    (_set(eos_token_id=[]), "eos_token_id: expected null, an int or a list of ints, got []"),
    (_set(eos_token_id=[0, True]), "eos_token_id: expected null, an int or a list of ints"),
    (_set(eos_token_id=[0, 50]), "eos_token_id: expected None or an int in [0, 50)"),
    (lambda raw: raw.pop("num_hidden_layers"), "misses the key 'num_hidden_layers'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_transformers_config_is_a_checkpoint_error_naming_the_key(checkpoint, edit, fragment):
    edit_json(checkpoint / "config.json", edit)
    with raises_naming(checkpoint, "config.json", fragment):
        load_pretrained(checkpoint)


@pytest.mark.parametrize("text,fragment", [
    ("[1, 2]", "config.json: expected a JSON object, got list"),
    ('"hidden_size"', "config.json: expected a JSON object, got str"),
    ("[" * 100_000 + "]" * 100_000, "config.json: not valid JSON (nested too deep)"),
    ('{"hidden_size": 32,', "config.json: not valid JSON"),
    (b"\xff\xfe{}", "config.json: not valid JSON"),
    ('{"hidden_size": 32, "hidden_size": 64}', "config.json: not valid JSON (the key 'hidden_size' appears twice)"),
], ids=["list", "string", "nested", "truncated", "not-utf8", "repeated-key"])
def test_config_json_that_is_no_json_object_is_a_checkpoint_error(checkpoint, text, fragment):
    path = checkpoint / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with raises_naming(checkpoint, fragment):
        load_pretrained(checkpoint)


def state_spaces_raw(**ssm):
    return dict(d_model=32, n_layer=2, vocab_size=50, pad_vocab_size_multiple=1, tie_embeddings=True,
                ssm_cfg=dict(dict(layer="Mamba2", d_state=16, headdim=16, ngroups=2, chunk_size=8), **ssm))


@pytest.mark.parametrize("raw,fragment", [
    (dict(state_spaces_raw(), ssm_cfg=["Mamba2"]), "ssm_cfg: expected a JSON object, got list"),
    (state_spaces_raw(d_state="16"), "ssm_cfg.d_state: expected an int, got '16'"),
    (state_spaces_raw(ngroups=0), "Mamba2Config.ngroups: expected a positive int, got 0"),
    (state_spaces_raw(dt_limit=[0.0, "x"]), "ssm_cfg.dt_limit: expected a list of two numbers"),
    (state_spaces_raw(A_init_range=[1.0, float("inf")]), "Mamba2Config.A_init_range: expected finite"),
    (state_spaces_raw(dt_max=float("nan")), "ssm_cfg.dt_max: expected a finite number, got nan"),
    (state_spaces_raw(bias=0), "ssm_cfg.bias: expected true or false, got 0"),
    (state_spaces_raw(layer=["Mamba2"]), "ssm_cfg.layer: portable_ssm supports only 'Mamba2'"),
    (dict(state_spaces_raw(), pad_vocab_size_multiple=0),
     "Mamba2Config.pad_vocab_size_multiple: expected a positive int, got 0"),
    (dict(state_spaces_raw(), n_layer=2.0), "n_layer: expected an int, got 2.0"),
    (dict(state_spaces_raw(), initializer_cfg=[]), "initializer_cfg: expected a JSON object, got list"),
    (dict(state_spaces_raw(), initializer_cfg={"initializer_range": float("inf")}),
     "initializer_cfg.initializer_range: expected a finite number, got inf"),
    (dict(state_spaces_raw(), rms_norm=1), "rms_norm: portable_ssm supports only True, got 1"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_state_spaces_config_is_a_checkpoint_error_naming_the_key(pristine, checkpoint, raw, fragment):
    (checkpoint / "config.json").write_text(json.dumps(raw))
    with raises_naming(checkpoint, "config.json", fragment):
        load_pretrained(checkpoint)


def returns_quickly(call, seconds: float = 30.0):
    """``call()``'s exception, asserting it came within a generous ``seconds`` (a hang fails, not a slow run)."""
    result = {}

    def run():
        try:
            call()
        except Exception as err:  # noqa: BLE001 (handed back to the test)
            result["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    return result.get("error")


@pytest.mark.parametrize("items", [dict(num_hidden_layers=10**9), dict(num_hidden_layers=4096),
                                   dict(hidden_size=2**16, num_heads=2**13), dict(vocab_size=2**25)],
                         ids=["n_layer-1e9", "n_layer-4096", "d_model-65536", "vocab-2^25"])
def test_a_config_larger_than_its_weight_files_fails_fast_before_reading_them(checkpoint, items):
    edit_json(checkpoint / "config.json", _set(**items))
    error = returns_quickly(lambda: load_pretrained(checkpoint))
    assert isinstance(error, CheckpointError), error
    assert str(checkpoint) in str(error) and "config.json" in str(error)
    assert "n_layer: expected a positive int" in str(error) or "the weight files hold" in str(error)


# --- weights and metadata -----------------------------------------------------------------------

def test_int8_weights_are_a_checkpoint_error_naming_the_tensor(checkpoint):
    edit_tensors(checkpoint, lambda t: t.update({"backbone.norm_f.weight": np.ones(32, np.int8)}))
    with raises_naming(checkpoint / "model.safetensors", "tensor 'backbone.norm_f.weight' has dtype int8"):
        load_pretrained(checkpoint)


def test_int8_weights_in_a_torch_bin_are_a_checkpoint_error_naming_the_tensor(tmp_path):
    model = hf_model(vocab_size=48)
    state_spaces_dir(tmp_path, model, 48, "pytorch_model.bin")
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    state["backbone.norm_f.weight"] = torch.ones(32, dtype=torch.int8)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with raises_naming(tmp_path / "pytorch_model.bin", "tensor 'backbone.norm_f.weight' has dtype int8"):
        load_pretrained(tmp_path)


def test_int8_weights_in_a_save_params_file_are_a_checkpoint_error_naming_the_tensor(tmp_path):
    config = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, vocab_size=50, pad_vocab_size_multiple=1)
    params = dict(ps.init_params(config), **{"norm_f.weight": np.ones(16, np.int8)})
    meta = {"format": "portable_ssm.v1", "config": json.dumps(config.to_dict()), "dtype": "float32"}
    ps.io.save_arrays(tmp_path / "lm.safetensors", params, metadata=meta)
    with raises_naming(tmp_path / "lm.safetensors", "tensor 'norm_f.weight' has dtype I8, expected a float"):
        load_pretrained(tmp_path / "lm.safetensors")


@pytest.mark.parametrize("meta,fragment", [
    (dict(eos_token_id='"2"'), "metadata: eos_token_id: expected null, an int or a list of ints, got '2'"),
    (dict(eos_token_id="[" * 100_000), "metadata 'eos_token_id' is not valid JSON"),
    (dict(eos_token_id="[0, 99]"), "metadata: eos_token_id: expected None or an int in [0, 50)"),
    (dict(vocab_size="50.0"), "metadata 'vocab_size': expected an int, got 50.0"),
    (dict(vocab_size="{"), "metadata 'vocab_size' is not valid JSON"),
    (dict(eos_token_id="NaN"), "metadata 'eos_token_id' is not valid JSON (NaN is not a JSON number)"),
], ids=["eos-string", "eos-nested", "eos-outside-vocab", "vocab-float", "vocab-truncated", "eos-nan"])
def test_malformed_save_params_metadata_is_a_checkpoint_error_naming_the_key(tmp_path, meta, fragment):
    config = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, vocab_size=50, pad_vocab_size_multiple=1)
    ps.save_params(tmp_path / "lm.safetensors", ps.init_params(config), config, metadata=meta)
    with raises_naming(tmp_path / "lm.safetensors", fragment):
        load_pretrained(tmp_path / "lm.safetensors")


def test_config_ngroups_zero_non_finite_floats_and_non_bool_flags_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="Mamba2Config.ngroups: expected a positive int, got 0"):
        ps.Mamba2Config(d_model=16, ngroups=0)
    with pytest.raises(ValueError, match="Mamba2Config.dt_min: expected a finite number, got nan"):
        ps.Mamba2Config(d_model=16, dt_min=float("nan"))
    with pytest.raises(TypeError, match="Mamba2Config.bias: expected True or False, got 1"):
        ps.Mamba2Config(d_model=16, bias=1)
    with pytest.raises(ValueError, match=r"Mamba2Config.n_layer: expected a positive int, got 5000 \(at most 4_096\)"):
        ps.Mamba2Config(d_model=16, n_layer=5000)


# --- config fidelity and eos --------------------------------------------------------------------

def test_transformers_initializer_fields_and_eos_list_are_read_through(tmp_path, capsys):
    write_transformers_checkpoint(tmp_path, initializer_range=0.3, rescale_prenorm_residual=False,
                                  eos_token_id=[0, 2])
    lm = load_pretrained(tmp_path)
    assert (lm.config.initializer_range, lm.config.rescale_prenorm_residual) == (0.3, False)
    assert lm.eos_token_id == (0, 2)
    assert main(["info", str(tmp_path)]) == 0
    table = {line[:32].strip(): line[33:] for line in capsys.readouterr().out.splitlines()}
    assert (table["config.initializer_range"], table["config.rescale_prenorm_residual"], table["eos_token_id"]) == \
        ("0.3", "False", "(0, 2)")
    lm.save(tmp_path / "lm.safetensors")
    again = load_pretrained(tmp_path / "lm.safetensors")
    assert (again.eos_token_id, again.config.initializer_range, again.config.rescale_prenorm_residual) == \
        ((0, 2), 0.3, False)


@pytest.mark.parametrize("initializer_cfg,want", [(None, (0.02, True)),
                                                  ({"initializer_range": 0.05, "rescale_prenorm_residual": False},
                                                   (0.05, False))], ids=["mamba_ssm-defaults", "given"])
def test_state_spaces_initializer_cfg_is_read_through(tmp_path, initializer_cfg, want):
    state_spaces_dir(tmp_path, hf_model(vocab_size=48), 48, "model.safetensors")
    if initializer_cfg is not None:
        edit_json(tmp_path / "config.json", _set(initializer_cfg=initializer_cfg))
    c = load_pretrained(tmp_path).config
    assert (c.initializer_range, c.rescale_prenorm_residual) == want


def test_generate_stops_at_the_checkpoints_eos_ids_like_transformers(pristine, tmp_path):
    ids = prompt(50)
    free = load_pretrained(pristine[0]).generate(ids, 8)  # the checkpoint has no eos: 8 new tokens
    assert free.shape == (2, 21)
    new = free[:, 13:]
    unused = min(set(range(50)) - set(new.ravel().tolist()))
    eos = [unused, int(new[0, 2])]  # row 0 ends on the second id; row 1 is padded with the first once done
    model = write_transformers_checkpoint(tmp_path, eos_token_id=eos)
    lm = load_pretrained(tmp_path)
    assert lm.eos_token_id == tuple(eos)
    want = hf_greedy(model, ids, 8)
    got = lm.generate(ids, 8)
    np.testing.assert_array_equal(got, want)
    assert got[0, 15] == eos[1] and (got[0, 16:] == eos[0]).all()
    np.testing.assert_array_equal(np.stack(list(lm.stream(ids, 8)), axis=1), want[:, 13:])
    np.testing.assert_array_equal(lm.generate(ids, 8, eos_token_id=None), free)  # None: never stop early
    np.testing.assert_array_equal(lm.generate(ids, 8, eos_token_id=eos[1]),  # an explicit eos instead
                                  hf_greedy(model, ids, 8, eos_token_id=eos[1]))


def test_model_eos_must_be_ids_of_its_vocabulary(pristine):
    lm = load_pretrained(pristine[0])
    for bad in (50, [], [1, -1]):
        with pytest.raises(ValueError, match=r"eos_token_id: expected None or an int in \[0, 50\)"):
            ps.Mamba2LM(lm.params, lm.config, eos_token_id=bad)
    for bad in ("2", True):
        with pytest.raises(TypeError, match=r"eos_token_id: expected None, an int or a list of ints"):
            ps.Mamba2LM(lm.params, lm.config, eos_token_id=bad)
    assert ps.Mamba2LM(lm.params, lm.config, eos_token_id=[3, 4]).eos_token_id == (3, 4)


# --- the Hugging Face cache ---------------------------------------------------------------------

def cache_snapshot(cache, repo_id: str, commit: str, source) -> None:
    """Lays ``source``'s files out as huggingface_hub caches them: ``blobs/<sha256>`` and
    ``snapshots/<commit>/<name>`` symlinked to ``../../blobs/<sha256>``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    for file in source.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, repo / "blobs" / digest)
        (repo / "snapshots" / commit / file.name).symlink_to(f"../../blobs/{digest}")


def set_ref(cache, repo_id: str, ref: str, commit: str) -> None:
    path = cache / ("models--" + repo_id.replace("/", "--")) / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)


MAIN, DEV = hashlib.sha1(b"main").hexdigest(), hashlib.sha1(b"dev").hexdigest()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A fake Hugging Face cache holding ``org/tiny``: ``main`` (a sharded checkpoint, seed 0) and
    branch ``dev`` and ref ``pr/1`` (seed 1); returns ``(cache, {commit: transformers model})``."""
    root = tmp_path_factory.mktemp("hub")
    cache, models = root / "cache", {}
    for seed, commit, ref in ((0, MAIN, "main"), (1, DEV, "dev")):
        source = root / ref
        models[commit] = hf_model(seed)
        models[commit].save_pretrained(source, **dict(max_shard_size="20KB") if ref == "main" else {})
        cache_snapshot(cache, "org/tiny", commit, source)
        set_ref(cache, "org/tiny", ref, commit)
    set_ref(cache, "org/tiny", "pr/1", DEV)  # a pull request's ref: a name with a slash
    assert (cache / "models--org--tiny" / "snapshots" / MAIN / "model.safetensors.index.json").is_symlink()
    return cache, models


@pytest.mark.parametrize("revision,commit", [(None, MAIN), ("main", MAIN), ("dev", DEV), ("pr/1", DEV),
                                             (DEV, DEV)], ids=["default", "main", "branch", "pr", "commit"])
def test_hub_id_loads_the_snapshot_of_its_revision_from_the_local_cache(hub, monkeypatch, revision, commit):
    cache, models = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # no download possible: the cache is enough
    lm = load_pretrained("org/tiny", revision=revision)
    ids = prompt(50)
    assert rel_err(lm.logits(ids), hf_logits(models[commit], ids)) <= 1e-4


def test_hub_cache_is_hf_hub_cache_else_hf_home_hub_else_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "b"))
    assert hub_cache() == str(tmp_path / "a")
    monkeypatch.delenv("HF_HUB_CACHE")
    assert hub_cache() == str(tmp_path / "b" / "hub")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "c"))
    assert hub_cache() == str(tmp_path / "c" / ".cache" / "huggingface" / "hub")


@pytest.mark.parametrize("revision", ["v9", "0" * 40, "../dev"])
def test_missing_snapshot_without_huggingface_hub_says_what_to_run(hub, monkeypatch, revision):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(FileNotFoundError, match=(
            rf"org/tiny: no such local path, and the Hugging Face cache {hub[0]} holds no snapshot of it at "
            rf"revision '{revision}'; download it with: pip install 'portable-ssm\[hub\]' && "
            rf"hf download org/tiny --revision {revision}").replace(".", r"\.")):
        load_pretrained("org/tiny", revision=revision)


def test_missing_snapshot_is_downloaded_with_huggingface_hub_unless_local_files_only(hub, monkeypatch, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    cache, models = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    calls = []

    def snapshot_download(repo_id, **kw):  # stands in for the network
        calls.append((repo_id, kw["revision"]))
        return str(cache / "models--org--tiny" / "snapshots" / DEV)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(FileNotFoundError, match="hf download org/tiny --revision dev"):
        load_pretrained("org/tiny", revision="dev", local_files_only=True)
    assert calls == []
    lm = load_pretrained("org/tiny", revision="dev")
    assert calls == [("org/tiny", "dev")]
    ids = prompt(50)
    assert rel_err(lm.logits(ids), hf_logits(models[DEV], ids)) <= 1e-4


def test_revision_is_refused_for_a_local_path(pristine):
    with pytest.raises(ValueError, match="revision: only for a Hugging Face Hub id"):
        load_pretrained(pristine[0], revision="main")
