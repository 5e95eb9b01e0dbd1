"""load_pretrained reads transformers and state-spaces checkpoints (and save_params files) and
matches transformers' Mamba2ForCausalLM: logits to 1e-4 and greedy tokens exactly, on every backend."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import assert_close, rel_err

import portable_ssm as ps
from portable_ssm.io import CheckpointError, load_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

SMALL = dict(hidden_size=32, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=4, conv_kernel=4)
CONFIGS = {  # prompt length 13 is not a multiple of either chunk size
    "groups2-tied": dict(SMALL, n_groups=2, chunk_size=8, vocab_size=50, tie_word_embeddings=True),
    "groups1-untied": dict(SMALL, n_groups=1, chunk_size=16, vocab_size=37, tie_word_embeddings=False),
}


def hf_model(seed: int = 0, **overrides):
    """A small random transformers Mamba2ForCausalLM, every weight perturbed (so norms, D, dt_bias matter)."""
    torch.manual_seed(seed)
    kw = dict(CONFIGS["groups2-tied"], eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**dict(kw, **overrides))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def write_transformers_checkpoint(folder, seed: int = 0, **overrides):
    """Saves :func:`hf_model` with ``save_pretrained`` (safetensors) into ``folder``; returns the model."""
    model = hf_model(seed, **overrides)
    model.save_pretrained(folder)
    return model


def prompt(vocab: int, b: int = 2, l: int = 13) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (b, l))


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def hf_greedy(model, ids: np.ndarray, new: int, **kw) -> np.ndarray:
    """transformers' own cached greedy decoding (attention mask given: no id counts as padding)."""
    ids = torch.as_tensor(ids)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              **kw).numpy()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, write_transformers_checkpoint(folder, **CONFIGS[request.param])


def test_transformers_checkpoint_logits_and_greedy_tokens_match_transformers(xp, hf_checkpoint):
    folder, model = hf_checkpoint
    lm = load_pretrained(folder, backend=xp.name, device=xp.device)
    vocab = model.config.vocab_size
    ids = prompt(vocab)
    xids = xp.asarray_from(ids, "int64")
    assert_close(xp, lm.logits(xids), hf_logits(model, ids), rtol=1e-4, dtype="float32", shape=(2, 13, vocab))
    out = lm.generate(xids, 6)
    np.testing.assert_array_equal(xp.numpy(out), hf_greedy(model, ids, 6))


def test_transformers_config_keys_map_to_the_core_config(tmp_path):
    model = write_transformers_checkpoint(tmp_path, use_bias=True, use_conv_bias=False,
                                          residual_in_fp32=False, layer_norm_epsilon=1e-3,
                                          time_step_limit=(0.01, 0.5))
    lm = load_pretrained(tmp_path)
    c = lm.config
    assert (c.d_model, c.n_layer, c.d_state, c.headdim, c.nheads, c.ngroups, c.d_conv, c.chunk_size) == \
        (32, 2, 16, 16, 4, 2, 4, 8)
    assert (c.bias, c.conv_bias, c.residual_in_fp32, c.norm_eps, c.dt_limit) == (True, False, False, 1e-3,
                                                                                   (0.01, 0.5))
    ids = prompt(50)
    assert rel_err(lm.logits(ids.tolist()), hf_logits(model, ids)) <= 1e-4


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    model = hf_model()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = prompt(50)
    assert rel_err(load_pretrained(tmp_path / "sharded").logits(ids), hf_logits(model, ids)) <= 1e-4


def test_bfloat16_checkpoint_is_widened_exactly_without_torch(tmp_path):
    model = hf_model().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    lm = load_pretrained(tmp_path)
    assert (lm.checkpoint_dtype, lm.dtype) == ("bfloat16", "float32")
    want = model.backbone.layers[1].mixer.in_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(lm.params["layers.1.mixer.in_proj.weight"], want)


def state_spaces_dir(folder, model, real_vocab: int, weights: str, tie: bool = True) -> None:
    """Writes ``model``'s weights in mamba_ssm's layout: config.json with ssm_cfg, ``backbone.embedding``."""
    c = model.config
    config = dict(d_model=c.hidden_size, n_layer=c.num_hidden_layers, vocab_size=real_vocab,
                  pad_vocab_size_multiple=16, tie_embeddings=tie, rms_norm=True, residual_in_fp32=True,
                  d_intermediate=0, attn_layer_idx=[],
                  ssm_cfg=dict(layer="Mamba2", d_state=c.state_size, d_conv=c.conv_kernel, expand=c.expand,
                               headdim=c.head_dim, ngroups=c.n_groups, chunk_size=c.chunk_size))
    (folder / "config.json").write_text(json.dumps(config))
    state = {k.replace("embeddings.", "embedding."): v.clone() for k, v in model.state_dict().items()}
    if weights.endswith(".bin"):
        torch.save(state, folder / weights)
    else:
        safetensors_numpy.save_file({k: v.numpy() for k, v in state.items()}, str(folder / weights))


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors", "mamba2-tiny.safetensors"])
def test_state_spaces_checkpoint_with_padded_vocab_matches_transformers(tmp_path, weights):
    model = hf_model(vocab_size=48)  # 37 real tokens padded to a multiple of 16
    state_spaces_dir(tmp_path, model, 37, weights)
    lm = load_pretrained(tmp_path)
    assert (lm.layout, lm.vocab_size, lm.config.padded_vocab_size) == ("state-spaces", 37, 48)
    ids = prompt(37)
    assert rel_err(lm.logits(ids), hf_logits(model, ids)) <= 1e-4
    padding = list(range(37, 48))
    np.testing.assert_array_equal(lm.generate(ids, 6), hf_greedy(model, ids, 6, suppress_tokens=padding))


def test_state_spaces_checkpoint_with_unpadded_rows_on_every_backend(xp, tmp_path):
    model = hf_model()  # 50 rows: not a multiple of 16, so the rows are taken as the vocabulary
    state_spaces_dir(tmp_path, model, 50, "pytorch_model.bin", tie=True)
    lm = load_pretrained(tmp_path, backend=xp.name, device=xp.device)
    assert (lm.vocab_size, lm.config.padded_vocab_size) == (50, 50)
    ids = prompt(50)
    got = lm.logits(xp.asarray_from(ids, "int64"))
    assert_close(xp, got, hf_logits(model, ids), rtol=1e-4, dtype="float32", shape=(2, 13, 50))


def test_state_spaces_D_per_channel_and_untied_head_are_read(tmp_path):
    config = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, ngroups=2, vocab_size=20,
                             pad_vocab_size_multiple=8, D_has_hdim=True, tie_embeddings=False)
    params = ps.init_params(config, seed=3, dtype="float64")
    raw = dict(d_model=16, n_layer=1, vocab_size=20, pad_vocab_size_multiple=8, tie_embeddings=False,
               ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, ngroups=2, D_has_hdim=True))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tensors = {("" if k == "lm_head.weight" else "backbone.") + k: v for k, v in params.items()}
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    lm = load_pretrained(tmp_path, dtype="float64")
    assert lm.config == config
    ids = prompt(20)
    assert rel_err(lm.logits(ids), ps.lm.logits(ids, params, config=config)) <= 1e-12


def test_save_params_file_round_trips_with_vocab_and_eos(tmp_path):
    model = hf_model(vocab_size=48)
    state_spaces_dir(tmp_path, model, 37, "model.safetensors")
    lm = load_pretrained(tmp_path)
    lm.eos_token_id = 5
    lm.save(tmp_path / "lm.safetensors")
    again = load_pretrained(tmp_path / "lm.safetensors")
    assert (again.vocab_size, again.eos_token_id, again.config) == (37, 5, lm.config)
    ids = prompt(37)
    np.testing.assert_array_equal(again.logits(ids), lm.logits(ids))


def test_a_bare_pretrained_weight_file_asks_for_its_directory(tmp_path):
    write_transformers_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not written by portable_ssm .* directory with config.json"):
        load_pretrained(tmp_path / "model.safetensors")


def edit_tensors(folder, edit) -> None:
    """Rewrites ``folder/model.safetensors`` with ``edit(dict of numpy arrays)`` applied."""
    from safetensors import safe_open

    path = str(folder / "model.safetensors")
    with safe_open(path, "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    safetensors_numpy.save_file(tensors, path)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("backbone.layers.1.mixer.A_log"), "'backbone.layers.1.mixer.A_log' is missing"),
    (lambda t: t.pop("lm_head.weight"), "'lm_head.weight' is missing"),
    (lambda t: t.update({"backbone.norm_f.weight": np.ones(31, np.float32)}),
     r"'backbone.norm_f.weight' has shape \(31,\), expected \[32\]"),
    (lambda t: t.update({"backbone.layers.0.mixer.extra": np.ones(2, np.float32)}),
     "unexpected tensor 'backbone.layers.0.mixer.extra'"),
    (lambda t: t.update({"backbone.embedding.weight": t["backbone.embeddings.weight"]}), "same parameter"),
], ids=["missing", "untied-head-missing", "shape", "unexpected", "both-embedding-names"])
def test_wrong_or_missing_tensor_is_named(tmp_path, edit, message):
    write_transformers_checkpoint(tmp_path, tie_word_embeddings=False)
    edit_tensors(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(tmp_path)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path):
    write_transformers_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pretrained(tmp_path)


def test_unsupported_state_spaces_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(d_model=16, n_layer=1, vocab_size=8, ssm_cfg={})))
    with pytest.raises(CheckpointError, match="ssm_cfg.layer: portable_ssm supports only 'Mamba2', "
                                              "got 'Mamba1'"):
        load_pretrained(tmp_path)


def test_missing_config_json_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)


class _Payload:
    """Unpickling this would create a file: the test proves it never happens."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_torch_bin_is_never_unpickled_beyond_tensors(tmp_path):
    model = hf_model(vocab_size=48)
    state_spaces_dir(tmp_path, model, 48, "pytorch_model.bin")
    marker = tmp_path / "unpickled"
    padding = torch.zeros(20_000)  # the file is as big as the config's weights: the unpickler runs
    torch.save({"backbone.norm_f.weight": _Payload(str(marker)), "padding": padding}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_pretrained(tmp_path)
    assert not marker.exists()


def test_torch_bin_without_torch_says_what_to_install(tmp_path, monkeypatch):
    state_spaces_dir(tmp_path, hf_model(vocab_size=48), 48, "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "portable_ssm.backends.torch", None)  # as where torch is absent
    with pytest.raises(ImportError, match=r"needs torch \(pip install 'portable-ssm\[torch\]'\)"):
        load_pretrained(tmp_path)


def test_inputs_are_checked_at_the_door(tmp_path):
    write_transformers_checkpoint(tmp_path)
    lm = load_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"input_ids\[0\]\[1\]: expected a token id in \[0, 50\), got 50"):
        lm.logits([[3, 50]])
    with pytest.raises(TypeError, match="params is a numpy array but input_ids is a torch array"):
        lm.generate(torch.zeros((1, 2), dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="input_ids: expected an integer dtype"):
        lm.logits(np.zeros((1, 2), np.float32))
