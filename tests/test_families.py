"""Hybrid families against transformers: tiny random models built at test time (no network),
saved with save_pretrained, loaded with load_pretrained on every backend, and held to
transformers' logits (float32, rel err < 1e-4), greedy tokens, cached steps and ragged rows."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

import portable_ssm
from portable_ssm.io import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
              eos_token_id=None, bos_token_id=None)


def _granite(experts: int, rope: str | None) -> tuple:
    return transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM, dict(
        COMMON, **MAMBA, intermediate_size=16, shared_intermediate_size=24, num_hidden_layers=3,
        num_local_experts=experts, num_experts_per_tok=2, position_embedding_type=rope, mamba_n_groups=2,
        layer_types=["mamba", "attention", "mamba"], attention_multiplier=0.3, residual_multiplier=0.7,
        embedding_multiplier=2.0, logits_scaling=3.0)


def _bamba() -> tuple:
    return transformers.BambaConfig, transformers.BambaForCausalLM, dict(
        COMMON, **MAMBA, intermediate_size=48, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_groups=2)


def _nemotron_h() -> tuple:
    # an SSM width of 48 = 1.5 x hidden_size, as Nemotron-Nano-9B-v2 has 10240 = 2.29 x 4480
    return transformers.NemotronHConfig, transformers.NemotronHForCausalLM, dict(
        COMMON, layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
        head_dim=8, intermediate_size=40, mamba_num_heads=3, mamba_head_dim=16, ssm_state_size=8, n_groups=3,
        chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        moe_shared_expert_intermediate_size=20, routed_scaling_factor=1.7)


def _falcon_h1() -> tuple:
    return transformers.FalconH1Config, transformers.FalconH1ForCausalLM, dict(
        COMMON, intermediate_size=40, num_hidden_layers=2, mamba_d_ssm=48, mamba_n_heads=3, mamba_d_state=8,
        mamba_n_groups=3, mamba_chunk_size=8, mamba_rms_norm=True, embedding_multiplier=1.5, lm_head_multiplier=0.7,
        ssm_multipliers=[0.5, 1.2, 0.8, 1.3, 0.9], mlp_multipliers=[1.1, 0.6], key_multiplier=0.8,
        attention_in_multiplier=1.3, attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.8)


def _zamba2() -> tuple:
    return transformers.Zamba2Config, transformers.Zamba2ForCausalLM, dict(
        COMMON, num_key_value_heads=4, num_hidden_layers=5, intermediate_size=40, mamba_d_state=8, n_mamba_heads=4,
        mamba_ngroups=2, chunk_size=8, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
        num_mem_blocks=2, adapter_rank=4, use_mem_rope=True, use_shared_attention_adapter=True)


FAMILIES = {"granite_moe_rope": lambda: _granite(4, "rope"), "granite_dense_nope": lambda: _granite(0, None),
            "bamba": _bamba, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
            "zamba2": _zamba2}
#: Per family: config.json edits each refused with a CheckpointError naming the field.
REFUSALS = {
    "granite_moe_rope": [("hidden_act", "gelu"), ("rope_parameters", {"rope_type": "yarn"}), ("mamba_n_heads", 3),
                         ("layer_types", ["mamba"])],
    "granite_dense_nope": [("hidden_act", "gelu"), ("position_embedding_type", "alibi"), ("mamba_n_heads", 3)],
    "bamba": [("hidden_act", "gelu"), ("rope_parameters", {"rope_type": "yarn"}), ("attn_layer_indices", [7]),
              ("mlp_bias", True)],
    "falcon_h1": [("hidden_act", "gelu"), ("mlp_bias", True), ("projectors_bias", True),
                  ("ssm_multipliers", [1.0, 2.0]), ("rope_parameters", {"rope_type": "yarn"})],
    "zamba2": [("hidden_act", "relu"), ("add_bias_linear", True), ("use_long_context", True),
               ("layers_block_type", ["mamba", "transformer"]), ("rope_parameters", {"rope_type": "yarn"})],
    "nemotron_h": [("mlp_hidden_act", "gelu"), ("moe_latent_size", 16), ("n_group", 2), ("mamba_hidden_act", "gelu"),
                   ("layers_block_type", ["mamba", "ssm"]), ("num_nextn_predict_layers", 1)],
}
PROMPT, SHORT, NEW = 9, 5, 5


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    """A saved tiny model with transformers' outputs: full logits, a row alone, greedy tokens."""
    config_cls, model_cls, kwargs = FAMILIES[request.param]()
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    for param in model.parameters():  # the init leaves norms at one and D at one: vary them
        if param.ndim == 1:
            param.data = param.data + 0.1 * torch.randn_like(param)
    for module in model.modules():  # a router bias of zeros would not show whether it is applied
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = 0.3 * torch.randn_like(module.e_score_correction_bias)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    ids = torch.randint(1, 64, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits.numpy()
        alone = model(ids[1:, PROMPT - SHORT:]).logits.numpy()[0]
        tokens = [model.generate(ids[i:i + 1, start:], max_new_tokens=NEW, do_sample=False)[0, PROMPT - start:].numpy()
                  for i, start in ((0, 0), (1, PROMPT - SHORT))]
    return dict(name=request.param, folder=str(folder), ids=ids.numpy(), full=full, alone=alone, tokens=tokens)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _load(xp, case):
    return portable_ssm.load_pretrained(case["folder"], backend=xp.name, device=xp.device)


def test_logits_match_transformers(xp, case):
    lm = _load(xp, case)
    got = lm.logits(xp.asarray_from(case["ids"], "int64"))
    assert got.dtype == xp.float32 and tuple(got.shape) == case["full"].shape
    assert _rel(xp.numpy(got), case["full"]) < 1e-4


def test_prefill_then_one_token_steps_match_the_whole_sequence(xp, case):
    lm = _load(xp, case)
    ids = xp.asarray_from(case["ids"], "int64")
    first, state = lm.prefill(ids[:, :4], max_len=PROMPT)
    second, state = lm.prefill(ids[:, 4:6], state=state)
    steps = [xp.numpy(first), xp.numpy(second)]
    for t in range(6, PROMPT):
        logits, state = lm.step(ids[:, t], state)
        steps.append(xp.numpy(logits)[:, None, :])
    assert _rel(np.concatenate(steps, axis=1), case["full"]) < 1e-4
    with pytest.raises(ValueError, match="max_len"):
        lm.step(ids[:, 0], state)


class _Numpy:
    """The numpy row of the xp fixture, for tests that run on one backend."""

    def asarray_from(self, host, dtype):
        return np.asarray(host, dtype=dtype)

    def numpy(self, a):
        return np.asarray(a)


NUMPY = _Numpy()


def _ragged(xp, case):
    ids = case["ids"].copy()
    mask = np.ones_like(ids)
    mask[1, :PROMPT - SHORT] = 0
    ids[1, :PROMPT - SHORT] = 0
    return xp.asarray_from(ids, "int64"), xp.asarray_from(mask, "int64")


def test_left_padded_rows_give_what_each_row_gives_alone(xp, case):
    lm = _load(xp, case)
    ids, mask = _ragged(xp, case)
    got = xp.numpy(lm.logits(ids, attention_mask=mask))
    assert _rel(got[1, PROMPT - SHORT:], case["alone"]) < 1e-4
    assert _rel(got[0], case["full"][0]) < 1e-4
    assert np.isfinite(got).all()


def test_greedy_generation_is_token_equal_to_transformers_for_ragged_rows(xp, case):
    lm = _load(xp, case)
    ids, mask = _ragged(xp, case)
    got = xp.numpy(lm.generate(ids, max_new_tokens=NEW, attention_mask=mask))  # [b, l + new]
    np.testing.assert_array_equal(got[:, :PROMPT], xp.numpy(ids))
    np.testing.assert_array_equal(got[:, PROMPT:], np.stack(case["tokens"]))


def test_generation_continues_from_a_returned_state(xp, case):
    lm = _load(xp, case)
    ids = xp.asarray_from(case["ids"][:1], "int64")
    first, state = lm.generate(ids[:, :PROMPT - 2], max_new_tokens=1, return_state=True,
                               state=lm.empty_state(1, PROMPT + NEW))
    logits, _ = lm.prefill(ids[:, PROMPT - 2:], state=state)
    assert _rel(xp.numpy(logits)[0], case["full"][0, PROMPT - 2:]) < 1e-4


def _edited(case, tmp_path, **changes):
    folder = tmp_path / "edited"
    folder.mkdir(parents=True)
    with open(f"{case['folder']}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").symlink_to(f"{case['folder']}/model.safetensors")
    return folder


def test_unsupported_config_options_are_refused_naming_the_field(case, tmp_path):
    for n, (field, value) in enumerate(REFUSALS[case["name"]]):
        folder = _edited(case, tmp_path / str(n), **{field: value})
        with pytest.raises(CheckpointError, match=field) as err:
            portable_ssm.load_pretrained(folder)
        assert "config.json" in str(err.value)


def test_mamba2_with_many_groups_uses_the_per_group_gated_norm_as_transformers(xp, tmp_path):
    """Codestral-shaped (n_groups = 8): transformers 5.25's Mamba2RMSNormGated normalises each of
    the n_groups slices alone, as mamba_ssm's RMSNormGated(group_size=d_ssm/ngroups) does; the
    loader applies that (Mamba2Config.ngroups drives the gated norm)."""
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8,
                                    num_heads=8, n_groups=8, chunk_size=8, eos_token_id=None, bos_token_id=None,
                                    pad_token_id=None)
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits.numpy()
    lm = portable_ssm.load_pretrained(tmp_path, backend=xp.name, device=xp.device)
    assert lm.config.ngroups == 8
    got = xp.numpy(lm.logits(xp.asarray_from(ids.numpy(), "int64")))
    assert _rel(got, want) < 1e-4


def test_sharded_checkpoints_load_like_single_files(case, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(case["folder"])
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    lm = portable_ssm.load_pretrained(tmp_path)
    assert _rel(lm.logits(case["ids"]), case["full"]) < 1e-4


def test_a_config_larger_than_its_weight_files_is_refused_before_reading(case, tmp_path):
    folder = _edited(case, tmp_path, vocab_size=2**24)
    with pytest.raises(CheckpointError, match="needs at least"):
        portable_ssm.load_pretrained(folder)


def test_cli_info_names_the_family_and_the_gated_norm_the_loader_applies(case, capsys):
    from portable_ssm.cli import main

    assert main(["info", case["folder"]]) == 0
    shown = capsys.readouterr().out
    assert "family" in shown and "parameters" in shown
    assert "Mamba mixer:" in shown and "per group" in shown


Grads = dict[str, np.ndarray]
#: How transformers' gradient of one of its parameters follows from the core's gradients (``g``,
#: by core name) and transformers' weights (``w``, by its name).
Predict = Callable[[Grads, Grads], np.ndarray]


def _same(core: str) -> Predict:
    """A parameter the loader copies unchanged: the gradients are equal."""
    return lambda g, w: g[core]


def _scaled(core: str, factor: float | np.ndarray, rows: slice = slice(None)) -> Predict:
    """A parameter the loader folds a multiplier into (``W_core[rows] = factor · W``, the factor a
    scalar or one per row): by the chain rule ``dL/dW = factor · dL/dW_core[rows]``."""
    return lambda g, w: np.asarray(factor, np.float32).reshape(-1, 1) * g[core][rows]


def _summed(*cores: str) -> Predict:
    """A weight shared by several layers, copied into each by the loader: its gradient is the sum
    of the copies' gradients."""
    return lambda g, w: sum(g[c] for c in cores)


def _lora(core: str, adapter: str) -> dict[str, Predict]:
    """A LoRA adapter (transformers' ``<adapter>.0`` down ``[r, in]``, ``<adapter>.1`` up
    ``[out, r]``) folded into one layer's copy, ``W_core = W + up · down``: with ``G = dL/dW_core``,
    ``dL/d(down) = upᵀ · G`` and ``dL/d(up) = G · downᵀ``."""
    down, up = f"{adapter}.0.weight", f"{adapter}.1.weight"
    return {down: lambda g, w: w[up].T @ g[core], up: lambda g, w: g[core] @ w[down].T}


_FALCON = _falcon_h1()[2]
_F = _FALCON["intermediate_size"]  # the core's ffn.up packs [gate; up], 2 x _F rows
_GN = _FALCON["mamba_n_groups"] * _FALCON["mamba_d_state"]
_MUP = np.repeat(np.asarray(_FALCON["ssm_multipliers"], np.float32),  # in_proj rows [z, x, B, C, dt]
                 [_FALCON["mamba_d_ssm"]] * 2 + [_GN] * 2 + [_FALCON["mamba_n_heads"]]) * _FALCON["ssm_in_multiplier"]
_Z1, _Z3 = "model.layers.1.shared_transformer.", "model.layers.3.shared_transformer."
#: Per family, transformers' parameter -> its gradient predicted from the core's (one of each block kind).
GRADIENTS: dict[str, dict[str, Predict]] = {
    "granite_moe_rope": {"model.embed_tokens.weight": _same("embedding.weight"),
                         "model.layers.0.mamba.in_proj.weight": _same("layers.0.mixer.in_proj.weight"),
                         "model.layers.1.self_attn.q_proj.weight": _same("layers.1.mixer.q_proj.weight"),
                         "model.layers.2.block_sparse_moe.router.weight": _same("layers.2.ffn.router.weight")},
    "granite_dense_nope": {"model.layers.0.mamba.out_proj.weight": _same("layers.0.mixer.out_proj.weight"),
                           "model.layers.1.self_attn.v_proj.weight": _same("layers.1.mixer.v_proj.weight"),
                           "model.layers.2.shared_mlp.input_linear.weight": _same("layers.2.ffn.up.weight"),
                           "model.layers.1.shared_mlp.output_linear.weight": _same("layers.1.ffn.down.weight")},
    "bamba": {"model.layers.0.mamba.A_log": _same("layers.0.mixer.A_log"),
              "model.layers.1.self_attn.k_proj.weight": _same("layers.1.mixer.k_proj.weight"),
              "model.layers.2.feed_forward.down_proj.weight": _same("layers.2.ffn.down.weight")},
    "nemotron_h": {"model.layers.0.mixer.in_proj.weight": _same("layers.0.mixer.in_proj.weight"),
                   "model.layers.4.mixer.dt_bias": _same("layers.4.mixer.dt_bias"),
                   "model.layers.2.mixer.q_proj.weight": _same("layers.2.mixer.q_proj.weight"),
                   "model.layers.3.mixer.down_proj.weight": _same("layers.3.ffn.down.weight"),
                   "model.layers.1.mixer.gate.weight": _same("layers.1.ffn.router.weight"),
                   "model.layers.1.mixer.experts.up_proj": _same("layers.1.ffn.experts.up.weight"),
                   "model.layers.1.mixer.experts.down_proj": _same("layers.1.ffn.experts.down.weight"),
                   "model.layers.1.mixer.shared_experts.up_proj.weight": _same("layers.1.ffn.shared.up.weight")},
    "falcon_h1": {"model.layers.0.mamba.in_proj.weight": _scaled("layers.0.mixer.mamba.in_proj.weight", _MUP),
                  "model.layers.1.mamba.out_proj.weight": _scaled("layers.1.mixer.mamba.out_proj.weight",
                                                                  _FALCON["ssm_out_multiplier"]),
                  "model.layers.0.self_attn.k_proj.weight": _scaled(
                      "layers.0.mixer.attention.k_proj.weight",
                      _FALCON["attention_in_multiplier"] * _FALCON["key_multiplier"]),
                  "model.layers.1.self_attn.o_proj.weight": _scaled("layers.1.mixer.attention.o_proj.weight",
                                                                    _FALCON["attention_out_multiplier"]),
                  "model.layers.0.feed_forward.gate_proj.weight": _scaled("layers.0.ffn.up.weight",
                                                                          _FALCON["mlp_multipliers"][0], slice(_F)),
                  "model.layers.0.feed_forward.up_proj.weight": _scaled("layers.0.ffn.up.weight", 1.0, slice(_F, None)),
                  "model.layers.1.feed_forward.down_proj.weight": _scaled("layers.1.ffn.down.weight",
                                                                          _FALCON["mlp_multipliers"][1])},
    # hybrid layers 1, 3, 4: block 0 is stored under layer 1 and used by layers 1 and 4 (adapters 0
    # and 2), block 1 under layer 3 (adapter 1)
    "zamba2": {"model.layers.1.mamba_decoder.mamba.in_proj.weight": _same("layers.1.mixer.in_proj.weight"),
               "model.layers.4.linear.weight": _same("layers.4.shared.linear.weight"),
               _Z1 + "self_attn.q_proj.weight": _summed("layers.1.shared.attention.q_proj.weight",
                                                        "layers.4.shared.attention.q_proj.weight"),
               _Z1 + "self_attn.o_proj.weight": _summed("layers.1.shared.attention.o_proj.weight",
                                                        "layers.4.shared.attention.o_proj.weight"),
               _Z3 + "feed_forward.down_proj.weight": _same("layers.3.shared.ffn.down.weight"),
               **_lora("layers.4.shared.attention.k_proj.weight", _Z1 + "self_attn.linear_k_adapter_list.2"),
               **_lora("layers.3.shared.ffn.up.weight", _Z3 + "feed_forward.gate_up_proj_adapter_list.1")},
}


@pytest.mark.parametrize("family", sorted(GRADIENTS))
def test_torch_autograd_gradients_match_transformers(family, tmp_path):
    """One cross-entropy step through transformers' model and the loaded one: each listed
    transformers gradient equals the one its core parameters imply. Where the loader maps a
    tensor 1:1 the gradients are equal; where it folds a muP multiplier in (Falcon-H1),
    transformers' gradient is the multiplier times the core's; a Zamba2 shared block copied into
    several hybrid layers has the sum of the copies' gradients; a LoRA factor folded into one
    layer's copy (``W + up · down``) has ``upᵀ · G`` or ``G · downᵀ`` of that copy's gradient ``G``."""
    config_cls, model_cls, kwargs = FAMILIES[family]()
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).train()
    model.save_pretrained(tmp_path)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    lm = portable_ssm.load_pretrained(tmp_path, backend="torch")
    for p in lm.params.values():
        p.requires_grad_(True)
    logits = lm.logits(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    hf = dict(model.named_parameters())
    core = {name: p.grad.numpy() for name, p in lm.params.items() if p.grad is not None}
    weights = {name: p.detach().numpy() for name, p in hf.items()}
    for name, predict in GRADIENTS[family].items():
        want = hf[name].grad.numpy()
        got = predict(core, weights)
        assert got.shape == want.shape and np.abs(want).max() > 0, name
        assert _rel(got, want) < 1e-4, name


def test_one_token_step_traces_under_jax_jit_with_static_shapes(case):
    """The whole step (KV-cache write by one-hot slots, top-k by argmax rounds, the Mamba step)
    compiles once under jax.jit and gives the eager step's logits: no data-dependent shape."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    lm = portable_ssm.load_pretrained(case["folder"], backend="jax")
    ids = jax.numpy.asarray(case["ids"])
    _, state = lm.prefill(ids[:, :6], max_len=PROMPT)
    jitted = jax.jit(lm.step)
    eager_logits, _ = lm.step(ids[:, 6], state)
    logits, state2 = jitted(ids[:, 6], state)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(eager_logits), rtol=1e-5, atol=1e-6)
    logits, _ = jitted(ids[:, 7], state2)  # the same trace, the next position
    assert _rel(np.asarray(logits), case["full"][:, 7]) < 1e-4
    assert jitted._cache_size() == 1


def test_half_precision_weights_compute_in_float32_and_stay_close(case):
    """bfloat16 parameters on torch: attention scores, routing, norms and the scan run in float32
    inside, so the logits stay finite and near transformers' float32 ones."""
    lm = portable_ssm.load_pretrained(case["folder"], backend="torch", dtype="bfloat16")
    logits = lm.logits(torch.as_tensor(case["ids"]))
    assert logits.dtype == torch.bfloat16
    got = logits.float().numpy()
    assert np.isfinite(got).all()
    assert _rel(got, case["full"]) < 0.05  # 0.6-2.1% measured: bfloat16 weights and activations


def _cut_at(tokens: np.ndarray, eos: int, pad: int) -> tuple[np.ndarray, int]:
    """A row's greedy tokens with everything after its first eos replaced by pad; its length to there."""
    hits = np.flatnonzero(tokens == eos)
    end = len(tokens) if not len(hits) else hits[0] + 1
    return np.where(np.arange(len(tokens)) < end, tokens, pad), end


def test_rows_stop_at_eos_then_pad_and_the_stream_ends_when_all_did(case):
    """The first row's second greedy token made eos: each ragged row emits pad_token_id after its
    first eos (transformers' generate), and generation ends once every row has emitted it."""
    lm = portable_ssm.load_pretrained(case["folder"])
    eos = int(case["tokens"][0][1])
    ids, mask = _ragged(NUMPY, case)
    got = lm.generate(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    rows = [_cut_at(t, eos, 0) for t in case["tokens"]]
    assert got.shape == (2, PROMPT + max(end for _, end in rows))
    np.testing.assert_array_equal(got[:, :PROMPT], ids)
    np.testing.assert_array_equal(got[:, PROMPT:], np.stack([r for r, _ in rows])[:, :got.shape[1] - PROMPT])
    tokens = [t for t, _ in lm.stream(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=None)]
    np.testing.assert_array_equal(np.stack(tokens, axis=1), np.stack(case["tokens"]))
