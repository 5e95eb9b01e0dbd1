"""mamba_ssm's own hybrid checkpoints (state-spaces ``config.json`` with ``attn_layer_idx``,
``attn_cfg`` and ``d_intermediate``) against transformers' Bamba, without mamba_ssm installed.

Bamba is the same architecture (Mamba-2 layers, attention at some indices, a SwiGLU MLP after
every layer, RoPE on half of each head, rotate_half style), so a tiny random Bamba built at test
time is converted here into mamba_ssm's layout — q, k, v packed into ``in_proj``, fc1 = ``[up;
gate]``, ``backbone.``/``norm``/``norm2``/``mlp``/``norm_f`` names — with its config.json, and the
loaded model is held to Bamba's logits, greedy tokens, cached steps and ragged rows by
test_families' own tests (imported below, run on this module's ``case``). The ``attention_conv``
variant (MHA's ``d_conv``, which Bamba lacks) swaps Bamba's attention layer for
:class:`ConvMHA`, a plain-torch transcription of MHA's forward."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_families import (  # noqa: F401 (the imported tests run here on this module's case fixture)
    COMMON,
    MAMBA,
    NEW,
    PROMPT,
    SHORT,
    _rel,
    test_cli_info_names_the_family_and_the_gated_norm_the_loader_applies,
    test_generation_continues_from_a_returned_state,
    test_greedy_generation_is_token_equal_to_transformers_for_ragged_rows,
    test_half_precision_weights_compute_in_float32_and_stay_close,
    test_left_padded_rows_give_what_each_row_gives_alone,
    test_logits_match_transformers,
    test_one_token_step_traces_under_jax_jit_with_static_shapes,
    test_prefill_then_one_token_steps_match_the_whole_sequence,
    test_rows_stop_at_eos_then_pad_and_the_stream_ends_when_all_did,
)

import portable_ssm
from portable_ssm.blocks import AttentionSpec, KVCache
from portable_ssm.hybrid_lm import HybridLM
from portable_ssm.io import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HD = COMMON["hidden_size"] // COMMON["num_attention_heads"]  # 8
SSM_CFG = dict(layer="Mamba2", d_state=MAMBA["mamba_d_state"], headdim=MAMBA["mamba_d_head"], ngroups=2,
               chunk_size=MAMBA["mamba_chunk_size"], expand=2)

#: name -> Bamba's config edits, mamba_ssm's config edits, attention biases kept (None: both as
#: Bamba), the MLP kept, the weights file's name.
VARIANTS = {
    # tied head, a vocabulary of 60 padded to 64 rows, MLPs of 128, no attention biases
    "mlp_tied_padded": dict(
        bamba=dict(intermediate_size=128, tie_word_embeddings=True), vocab=60, mlp=True, qkv_bias=False,
        out_bias=False, attn_cfg=dict(num_heads=4, num_heads_kv=2, head_dim=HD, rotary_emb_dim=HD // 2, causal=True,
                                      qkv_proj_bias=False, out_proj_bias=False), file="model.safetensors"),
    # d_intermediate 0: Bamba with its MLPs' down_proj zeroed is the same model; MHA's default
    # biases (both on), head_dim from d_model / num_heads; an untied head; pytorch_model.bin
    "attention_only_biases": dict(
        bamba=dict(intermediate_size=16, tie_word_embeddings=False, attention_bias=True), vocab=64, mlp=False,
        qkv_bias=True, out_bias=True, attn_cfg=dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=HD // 2, causal=True),
        file="pytorch_model.bin"),
    # two attention layers, biases on q/k/v only (Bamba's o_proj bias zeroed), an explicit scale
    "qkv_bias_only": dict(
        bamba=dict(intermediate_size=128, tie_word_embeddings=True, attention_bias=True, attn_layer_indices=[0, 2]),
        vocab=64, mlp=True, qkv_bias=True, out_bias=False,
        attn_cfg=dict(num_heads=4, num_heads_kv=2, head_dim=HD, rotary_emb_dim=HD // 2, causal=True,
                      out_proj_bias=False, softmax_scale=HD ** -0.5, rotary_emb_base=10000),
        file="model.safetensors"),
    # state-spaces/mamba2attn-2.7b's attn_cfg keys, scaled down: a d_conv 4 over the packed q/k/v,
    # kv heads = heads, half-head RoPE, no biases; the attention layer is ConvMHA, not Bamba's
    "attention_conv": dict(
        bamba=dict(intermediate_size=128, tie_word_embeddings=True), vocab=64, mlp=True, qkv_bias=False,
        out_bias=False, conv=True,
        attn_cfg=dict(causal=True, d_conv=4, head_dim=HD, num_heads=4, out_proj_bias=False, qkv_proj_bias=False,
                      rotary_emb_dim=HD // 2), file="model.safetensors"),
    # MHA's inner MLP: mlp_dim 200 rounded up to 256 rows of in_proj ([up; gate], no conv on them),
    # out_proj reading 128 more columns; a d_conv of 3, GQA, MHA's default biases (both on)
    "attention_conv_mlp": dict(
        bamba=dict(intermediate_size=128, tie_word_embeddings=True), vocab=64, mlp=True, qkv_bias=True,
        out_bias=True, conv=True,
        attn_cfg=dict(causal=True, d_conv=3, mlp_dim=200, head_dim=HD, num_heads=4, num_heads_kv=2,
                      rotary_emb_dim=HD // 2), file="model.safetensors"),
}


class ConvMHA(torch.nn.Module):
    """mamba_ssm's MHA forward with ``d_conv`` (no cache) in plain torch, Bamba's attention's call
    signature: ``in_proj`` -> depthwise causal ``F.conv1d`` over packed ``[q; k; v]`` (bias, no
    activation) -> heads -> RoPE (rotate_half) on the first rotary_emb_dim channels at positions
    0..l-1 -> causal softmax attention -> ``out_proj``; with ``mlp_dim`` (rounded up to 256)
    in_proj's last rows are ``[up; gate]`` and out_proj reads ``[context; up · silu(gate)]``.
    Rows are unpadded (no mask is read)."""

    def __init__(self, d: int, cfg: dict) -> None:
        super().__init__()
        self.h, self.hd, self.r, self.k = cfg["num_heads"], cfg["head_dim"], cfg["rotary_emb_dim"], cfg["d_conv"]
        self.kv = cfg.get("num_heads_kv", self.h)
        c, self.m = (self.h + 2 * self.kv) * self.hd, -(-cfg.get("mlp_dim", 0) // 256) * 256
        self.in_proj = torch.nn.Linear(d, c + self.m, bias=cfg.get("qkv_proj_bias", True))
        self.conv1d = torch.nn.Conv1d(c, c, self.k, groups=c)
        self.out_proj = torch.nn.Linear(self.h * self.hd + self.m // 2, d, bias=cfg.get("out_proj_bias", True))

    def forward(self, hidden_states, **_):
        b, l, _ = hidden_states.shape
        F = torch.nn.functional
        qkv, mlp = self.in_proj(hidden_states).split([self.conv1d.weight.shape[0], self.m], dim=-1)
        up, gate = mlp.chunk(2, dim=-1)
        qkv = qkv.transpose(1, 2)  # [b, c, l]
        qkv = F.conv1d(qkv, self.conv1d.weight, self.conv1d.bias, padding=self.k - 1, groups=qkv.shape[1])
        qkv = qkv[..., :l].transpose(1, 2)  # the causal outputs, [b, l, c]
        q, k, v = qkv.split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q, k, v = (t.reshape(b, l, -1, self.hd).transpose(1, 2) for t in (q, k, v))  # [b, heads, l, hd]
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.r, 2, dtype=torch.float32) / self.r)
        angles = torch.arange(l, dtype=torch.float32)[:, None] * inv_freq  # [l, r/2]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rope(t):
            rot, rest = t[..., :self.r], t[..., self.r:]
            half = torch.cat([-rot[..., self.r // 2:], rot[..., :self.r // 2]], -1)
            return torch.cat([rot * cos + half * sin, rest], -1)

        q, k = rope(q), rope(k)
        k, v = (t.repeat_interleave(self.h // self.kv, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) * self.hd ** -0.5
        scores = scores.masked_fill(~torch.ones(l, l, dtype=torch.bool).tril(), float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, l, self.h * self.hd)
        return self.out_proj(torch.cat([context, up * F.silu(gate)], dim=-1)), None


def _bamba(variant: dict, seed: int = 0):
    """A tiny random Bamba (1-D parameters varied off their init), with the parts this variant's
    mamba_ssm model lacks zeroed: the MLPs' down_proj, a projection's bias."""
    config = transformers.BambaConfig(**dict(COMMON, **MAMBA, num_hidden_layers=3, attn_layer_indices=[1],
                                             mamba_n_groups=2) | variant["bamba"])
    torch.manual_seed(seed)
    model = transformers.BambaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
        for name, param in model.named_parameters():
            if (not variant["mlp"] and name.endswith("down_proj.weight")
                    or not variant["qkv_bias"] and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))
                    or not variant["out_bias"] and name.endswith("o_proj.bias")):
                param.zero_()
        if variant.get("conv"):
            for i in config.attn_layer_indices:
                model.model.layers[i].self_attn = ConvMHA(config.hidden_size, variant["attn_cfg"])
    return model


def mamba_ssm_state_dict(model, variant: dict) -> dict:
    """Bamba's weights in mamba_ssm's names and packing."""
    sd, cfg = model.state_dict(), model.config
    out = {"backbone.embedding.weight": sd["model.embed_tokens.weight"],
           "backbone.norm_f.weight": sd["model.final_layernorm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = sd[src + "input_layernorm.weight"]
        if i in cfg.attn_layer_indices and variant.get("conv"):
            out.update({dst + "mixer." + k[len(src + "self_attn."):]: v for k, v in sd.items()
                        if k.startswith(src + "self_attn.")})  # in_proj, conv1d, out_proj as MHA names them
        elif i in cfg.attn_layer_indices:
            a = src + "self_attn."
            out[dst + "mixer.in_proj.weight"] = torch.cat([sd[a + f"{p}_proj.weight"] for p in "qkv"])
            out[dst + "mixer.out_proj.weight"] = sd[a + "o_proj.weight"]
            if variant["qkv_bias"]:
                out[dst + "mixer.in_proj.bias"] = torch.cat([sd[a + f"{p}_proj.bias"] for p in "qkv"])
            if variant["out_bias"]:
                out[dst + "mixer.out_proj.bias"] = sd[a + "o_proj.bias"]
        else:
            m = src + "mamba."
            out.update({dst + "mixer." + k[len(m):]: v for k, v in sd.items() if k.startswith(m)})
        if variant["mlp"]:
            f = src + "feed_forward."
            out[dst + "norm2.weight"] = sd[src + "pre_ff_layernorm.weight"]
            out[dst + "mlp.fc1.weight"] = torch.cat([sd[f + "up_proj.weight"], sd[f + "gate_proj.weight"]])  # [y; gate]
            out[dst + "mlp.fc2.weight"] = sd[f + "down_proj.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def mamba_ssm_config(model, variant: dict) -> dict:
    cfg = model.config
    return dict(d_model=cfg.hidden_size, d_intermediate=cfg.intermediate_size if variant["mlp"] else 0,
                n_layer=cfg.num_hidden_layers, vocab_size=variant["vocab"], ssm_cfg=SSM_CFG,
                attn_layer_idx=list(cfg.attn_layer_indices), attn_cfg=variant["attn_cfg"], rms_norm=True,
                residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
                tie_embeddings=cfg.tie_word_embeddings, norm_epsilon=cfg.rms_norm_eps)


def save_mamba_ssm(model, variant: dict, folder) -> None:
    """config.json and the weights as mamba_ssm's ``save_pretrained`` lays them out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(mamba_ssm_config(model, variant)))
    tensors = mamba_ssm_state_dict(model, variant)
    if variant["file"].endswith(".bin"):
        torch.save(tensors, folder / variant["file"])
    else:
        safetensors_torch.save_file(tensors, folder / variant["file"])


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, tmp_path_factory):
    """A saved mamba_ssm hybrid with Bamba's outputs: full logits, a row alone, greedy tokens
    (never a padding row of the vocabulary: transformers' ``suppress_tokens``)."""
    variant = VARIANTS[request.param]
    model = _bamba(variant).eval()
    folder = tmp_path_factory.mktemp(request.param)
    save_mamba_ssm(model, variant, folder)
    ids = torch.randint(1, variant["vocab"], (2, PROMPT), generator=torch.Generator().manual_seed(1))
    padding = list(range(variant["vocab"], model.config.vocab_size)) or None
    with torch.no_grad():
        full = model(ids).logits.numpy()
        alone = model(ids[1:, PROMPT - SHORT:]).logits.numpy()[0]
        uncached = dict(use_cache=False) if variant.get("conv") else {}  # ConvMHA keeps no cache
        tokens = [model.generate(ids[i:i + 1, start:], max_new_tokens=NEW, do_sample=False,
                                 suppress_tokens=padding, **uncached)[0, PROMPT - start:].numpy()
                  for i, start in ((0, 0), (1, PROMPT - SHORT))]
    return dict(name=request.param, folder=str(folder), ids=ids.numpy(), full=full, alone=alone, tokens=tokens,
                model=model, variant=variant)


def test_a_state_spaces_hybrid_loads_as_the_mamba_ssm_family(case):
    lm = portable_ssm.load_pretrained(case["folder"])
    variant = case["variant"]
    assert isinstance(lm, HybridLM) and lm.config.family == "mamba_ssm"
    attn = set(case["model"].config.attn_layer_indices)
    ffn = "mlp" if variant["mlp"] else None
    assert lm.config.layers == tuple(("attention" if i in attn else "mamba", ffn) for i in range(3))
    assert lm.config.attention.bias is variant["qkv_bias"] and lm.config.attention.out_bias is variant["out_bias"]
    assert lm.vocab_size == variant["vocab"] and lm.config.vocab_size == 64  # the head's rows, padded to 8


def test_torch_autograd_gradients_match_bamba_for_an_attention_and_an_mlp_weight(tmp_path):
    variant = VARIANTS["qkv_bias_only"]
    model = _bamba(variant).train()
    save_mamba_ssm(model, variant, tmp_path)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    loss = torch.nn.functional.cross_entropy
    loss(model(ids).logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    lm = portable_ssm.load_pretrained(tmp_path, backend="torch")
    for p in lm.params.values():
        p.requires_grad_(True)
    loss(lm.logits(ids)[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    hf = dict(model.named_parameters())
    for core, name in (("layers.2.mixer.k_proj.weight", "model.layers.2.self_attn.k_proj.weight"),
                       ("layers.0.mixer.q_proj.bias", "model.layers.0.self_attn.q_proj.bias"),
                       ("layers.1.ffn.down.weight", "model.layers.1.feed_forward.down_proj.weight")):
        assert _rel(lm.params[core].grad.numpy(), hf[name].grad.numpy()) < 1e-4, core


def test_an_out_proj_bias_without_qkv_biases_is_bambas_model(tmp_path):
    """qkv_proj_bias false, out_proj_bias left at MHA's default (true): Bamba with attention_bias
    and its q/k/v biases zeroed."""
    variant = dict(VARIANTS["qkv_bias_only"], qkv_bias=False, out_bias=True,
                   attn_cfg=dict(num_heads=4, num_heads_kv=2, rotary_emb_dim=HD // 2, causal=True, qkv_proj_bias=False))
    model = _bamba(variant).eval()
    save_mamba_ssm(model, variant, tmp_path)
    ids = torch.randint(1, 64, (2, PROMPT), generator=torch.Generator().manual_seed(4))
    lm = portable_ssm.load_pretrained(tmp_path)
    assert lm.config.attention.bias is False and lm.config.attention.out_bias is True
    with torch.no_grad():
        assert _rel(lm.logits(ids.numpy()), model(ids).logits.numpy()) < 1e-4


def _copy(case, folder, **changes):
    """The case's folder with config.json edited (``attn_cfg``/``ssm_cfg`` dicts merged)."""
    shutil.copytree(case["folder"], folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        raw[key] = dict(raw[key], **value) if isinstance(value, dict) else value
    for sub in ("attn_cfg", "ssm_cfg"):
        if isinstance(raw.get(sub), dict):
            raw[sub] = {k: v for k, v in raw[sub].items() if v is not _DROP}
    raw = {k: v for k, v in raw.items() if v is not _DROP}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


_DROP = object()


def _saved(tmp_path_factory, name: str, vocab: int) -> dict:
    """The variant ``name`` saved once, with the reference's logits: all rows, and row 1's last
    SHORT tokens alone."""
    variant = VARIANTS[name]
    model = _bamba(variant).eval()
    folder = tmp_path_factory.mktemp(name)
    save_mamba_ssm(model, variant, folder)
    ids = torch.randint(1, vocab, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits.numpy()
        alone = model(ids[1:, PROMPT - SHORT:]).logits.numpy()[0]
    return dict(folder=str(folder), ids=ids.numpy(), full=full, alone=alone)


@pytest.fixture(scope="module")
def mlp_case(tmp_path_factory):
    """The tied, padded-vocabulary variant (ids below its 60 real tokens)."""
    return _saved(tmp_path_factory, "mlp_tied_padded", 60)


def test_generation_never_picks_a_padding_row_of_the_vocabulary(mlp_case):
    """vocab_size 60 padded to 64 rows: the logits keep every row (as mamba_ssm's), generation
    chooses among the real 60 only, even where a padding row's logit is the largest."""
    lm = portable_ssm.load_pretrained(mlp_case["folder"])
    table = lm.params["embedding.weight"].copy()
    table[60], table[61] = 100.0 * table[60], -100.0 * table[60]  # the tied head: one of them wins everywhere
    lm.params["embedding.weight"] = table
    logits = lm.logits(mlp_case["ids"])
    assert logits.shape[-1] == 64 and (logits.argmax(-1) >= 60).all()
    assert lm.generate(mlp_case["ids"], max_new_tokens=NEW).max() < 60


def test_d_intermediate_is_rounded_up_to_a_multiple_of_128_as_gated_mlp_does(mlp_case, tmp_path):
    """d_intermediate 100 means fc1 [2·128, d] (GatedMLP's multiple_of=128): that checkpoint loads
    and is Bamba's model; fc1 and fc2 of the unrounded size 100 are refused naming fc1."""
    rounded = _copy(mlp_case, tmp_path / "rounded", d_intermediate=100)
    lm = portable_ssm.load_pretrained(rounded)
    assert lm.config.d_ff == 128
    assert _rel(lm.logits(mlp_case["ids"]), mlp_case["full"]) < 1e-4
    unrounded = _copy(mlp_case, tmp_path / "unrounded", d_intermediate=100)
    weights = safetensors_torch.load_file(unrounded / "model.safetensors")
    for i in range(3):
        mlp = f"backbone.layers.{i}.mlp."
        fc1 = weights[mlp + "fc1.weight"]
        weights[mlp + "fc1.weight"] = torch.cat([fc1[:100], fc1[128:228]]).contiguous()
        weights[mlp + "fc2.weight"] = weights[mlp + "fc2.weight"][:, :100].contiguous()
    safetensors_torch.save_file(weights, unrounded / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'backbone.layers.0.mlp.fc1.weight' has shape \(200, 32\).*multiple "
                                              r"of 128"):
        portable_ssm.load_pretrained(unrounded)


#: config.json edits, each refused with a CheckpointError naming the field.
REFUSALS = [
    ("ssm_cfg.layer", dict(ssm_cfg=dict(layer="Mamba1"))),
    ("ssm_cfg.layer", dict(ssm_cfg=dict(layer=_DROP))),  # mamba_ssm's default is Mamba1
    ("ssm_cfg.d_ssm", dict(ssm_cfg=dict(d_ssm=32))),
    ("ssm_cfg.d_state", dict(ssm_cfg=dict(d_state="8"))),
    ("attn_cfg.d_conv", dict(attn_cfg=dict(d_conv=1))),  # MHA's own forward returns nothing for 1
    ("attn_cfg.d_conv", dict(attn_cfg=dict(d_conv=-1))),
    ("attn_cfg.d_conv", dict(attn_cfg=dict(d_conv="4"))),
    ("attn_cfg.mlp_dim", dict(attn_cfg=dict(mlp_dim=-64))),
    ("attn_cfg.mlp_dim", dict(attn_cfg=dict(mlp_dim=64.0))),
    ("attn_cfg.rotary_emb_interleaved", dict(attn_cfg=dict(rotary_emb_interleaved=True))),
    ("attn_cfg.causal", dict(attn_cfg=dict(causal=False))),
    ("attn_cfg.causal", dict(attn_cfg=dict(causal=_DROP))),  # MHA's default is causal=False
    ("attn_cfg.window_size", dict(attn_cfg=dict(window_size=[4, 0]))),
    ("attn_cfg.num_heads_kv", dict(attn_cfg=dict(num_heads_kv=3))),
    ("attn_cfg.num_heads", dict(attn_cfg=dict(num_heads=_DROP))),
    ("attn_cfg.num_heads", dict(attn_cfg=dict(num_heads=-4))),
    ("attn_cfg.num_heads", dict(attn_cfg=dict(num_heads=3, head_dim=_DROP))),
    ("attn_cfg.rotary_emb_dim", dict(attn_cfg=dict(rotary_emb_dim=3))),
    ("attn_cfg.softmax_scale", dict(attn_cfg=dict(softmax_scale=-1.0))),
    ("attn_cfg.qkv_proj_bias", dict(attn_cfg=dict(qkv_proj_bias=1))),
    ("rms_norm", dict(rms_norm=False)),
    ("bidirectional", dict(bidirectional=True)),
    ("d_intermediate", dict(d_intermediate=-1)),
    ("d_intermediate", dict(d_intermediate="128")),
    ("attn_layer_idx", dict(attn_layer_idx=[7])),
    ("attn_layer_idx", dict(attn_layer_idx=[True])),
    ("attn_layer_idx", dict(attn_layer_idx="1")),
]


@pytest.mark.parametrize("field,changes", REFUSALS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSALS)])
def test_unsupported_mamba_ssm_options_are_refused_naming_the_field(mlp_case, tmp_path, field, changes):
    folder = _copy(mlp_case, tmp_path / "edited", **changes)
    with pytest.raises(CheckpointError, match=field.replace(".", r"\.")) as err:
        portable_ssm.load_pretrained(folder)
    assert "config.json" in str(err.value)


def test_unexpected_and_missing_tensors_are_refused_naming_them(mlp_case, tmp_path):
    extra = _copy(mlp_case, tmp_path / "extra")
    weights = safetensors_torch.load_file(extra / "model.safetensors")
    safetensors_torch.save_file(dict(weights, **{"backbone.layers.0.mlp.fc1.bias": torch.zeros(256)}),
                                extra / "model.safetensors")
    with pytest.raises(CheckpointError, match="backbone.layers.0.mlp.fc1.bias"):
        portable_ssm.load_pretrained(extra)
    missing = _copy(mlp_case, tmp_path / "missing")
    del weights["backbone.layers.1.mixer.in_proj.weight"]
    safetensors_torch.save_file(weights, missing / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.mixer.q_proj.weight"):
        portable_ssm.load_pretrained(missing)


def test_a_config_larger_than_its_weight_files_is_refused_before_reading(mlp_case, tmp_path):
    folder = _copy(mlp_case, tmp_path / "big", d_intermediate=2**24)
    with pytest.raises(CheckpointError, match="needs at least"):
        portable_ssm.load_pretrained(folder)


def _pure(mlp_case, folder, **changes):
    """A pure Mamba-2 state-spaces folder (no attention, no MLP) of the case's Mamba layers 0 and 2."""
    folder = _copy(mlp_case, folder, n_layer=2, attn_cfg=_DROP, **changes)
    weights = safetensors_torch.load_file(folder / "model.safetensors")
    pure = {k: v for k, v in weights.items() if not k.startswith("backbone.layers.")}
    for new, old in ((0, 0), (1, 2)):
        pure.update({k.replace(f"layers.{old}.", f"layers.{new}."): v for k, v in weights.items()
                     if k.startswith(f"backbone.layers.{old}.") and ".mlp." not in k and ".norm2." not in k})
    safetensors_torch.save_file(pure, folder / "model.safetensors")
    return folder, pure


def test_a_pure_state_spaces_config_still_loads_as_mamba2(mlp_case, tmp_path):
    """No attention layer and no MLP (the keys absent or empty): the pure Mamba-2 model with its
    whole-model decode kernel, not the hybrid stack."""
    for n, empty in enumerate((dict(attn_layer_idx=_DROP, d_intermediate=_DROP), dict(attn_layer_idx=[],
                                                                                        d_intermediate=0))):
        lm = portable_ssm.load_pretrained(_pure(mlp_case, tmp_path / str(n), **empty)[0])
        assert isinstance(lm, portable_ssm.Mamba2LM) and lm.config.n_layer == 2
        assert np.isfinite(lm.logits(mlp_case["ids"])).all()


@pytest.mark.parametrize("ssm,note", [(dict(norm_before_gate=True), "rmsnorm(y) * silu(z)"),
                                      (dict(rmsnorm=False), "no norm"), (dict(D_has_hdim=True), "rmsnorm(y * silu(z))"),
                                      (dict(dt_limit=[0.01, 0.5], ngroups=4), "rmsnorm(y * silu(z))")])
def test_ssm_cfg_variants_are_read_as_the_pure_loader_reads_them(mlp_case, tmp_path, ssm, note):
    """The Mamba-2 fields of ssm_cfg (checked against mamba_ssm's math in test_variants) mean the
    same in a hybrid: the pure model, and it with an MLP whose fc2 is zero (d_intermediate 128),
    give the same logits."""
    pure_dir, weights = _pure(mlp_case, tmp_path / "pure", attn_layer_idx=_DROP, d_intermediate=_DROP, ssm_cfg=ssm)
    gen = torch.Generator().manual_seed(5)
    for i in range(2):
        mixer = f"backbone.layers.{i}.mixer."
        if ssm.get("rmsnorm") is False:
            del weights[mixer + "norm.weight"]
        if ssm.get("D_has_hdim"):
            weights[mixer + "D"] = torch.randn(64, generator=gen)  # [h·p], stored flat as mamba_ssm does
        if "ngroups" in ssm:  # B and C of 4 groups: in_proj and conv1d grow by 2·2·d_state rows
            z_x, rest = 128, weights[mixer + "in_proj.weight"].shape[0] - 128
            grow = torch.randn(2 * 2 * 8, 32, generator=gen) * 0.1
            in_proj = weights[mixer + "in_proj.weight"]
            weights[mixer + "in_proj.weight"] = torch.cat([in_proj[:z_x + rest - 4], grow, in_proj[-4:]])
            weights[mixer + "conv1d.weight"] = torch.cat([weights[mixer + "conv1d.weight"],
                                                          torch.randn(32, 1, 4, generator=gen) * 0.1])
            weights[mixer + "conv1d.bias"] = torch.cat([weights[mixer + "conv1d.bias"], torch.zeros(32)])
    safetensors_torch.save_file(weights, pure_dir / "model.safetensors")
    hybrid_dir = _copy(mlp_case, tmp_path / "hybrid", n_layer=2, attn_layer_idx=[], attn_cfg=_DROP, d_intermediate=128,
                       ssm_cfg=ssm)
    mlp = {}
    for i in range(2):
        mlp.update({f"backbone.layers.{i}.norm2.weight": torch.ones(32),
                    f"backbone.layers.{i}.mlp.fc1.weight": torch.randn(256, 32, generator=gen),
                    f"backbone.layers.{i}.mlp.fc2.weight": torch.zeros(32, 128)})
    safetensors_torch.save_file(dict(weights, **mlp), hybrid_dir / "model.safetensors")
    pure, hybrid = portable_ssm.load_pretrained(pure_dir), portable_ssm.load_pretrained(hybrid_dir)
    assert isinstance(pure, portable_ssm.Mamba2LM) and isinstance(hybrid, HybridLM)
    assert any(note in n for n in hybrid.notes)
    assert _rel(hybrid.logits(mlp_case["ids"]), pure.logits(mlp_case["ids"])) < 1e-5


def test_cli_info_names_the_mamba_ssm_family(mlp_case, capsys):
    from portable_ssm.cli import main

    assert main(["info", mlp_case["folder"]]) == 0
    shown = capsys.readouterr().out
    assert "mamba_ssm" in shown and "60 (rows 64)" in shown and "eps 1e-5" in shown


@pytest.fixture(scope="module")
def conv_case(tmp_path_factory):
    """The attention_conv variant (mamba2attn-2.7b's attn_cfg keys)."""
    return _saved(tmp_path_factory, "attention_conv", 64)


def test_left_padding_never_enters_a_rows_attention_conv_window(conv_case):
    """Padding slots holding real token ids (not id 0, whose zero embedding would hide a leak):
    the padded row's logits and its next step's are what the row gives alone, so neither the
    prompt's conv nor the state it leaves read a padding input."""
    lm = portable_ssm.load_pretrained(conv_case["folder"])
    ids = conv_case["ids"]
    mask = np.ones_like(ids)
    mask[1, :PROMPT - SHORT] = 0
    logits, state = lm.prefill(ids[:, :-1], attention_mask=mask[:, :-1], max_len=PROMPT)
    assert _rel(logits[1, PROMPT - SHORT:], conv_case["alone"][:-1]) < 1e-4
    step, _ = lm.step(ids[:, -1], state)
    assert _rel(step[1], conv_case["alone"][-1]) < 1e-4 and _rel(step[0], conv_case["full"][0, -1]) < 1e-4


def test_attention_d_conv_loads_and_says_it_follows_mhas_forward(conv_case, capsys):
    """attn_cfg.d_conv 4 is AttentionSpec.conv 4 with MHA's conv1d weight and bias, and the
    loader's note (shown by info) says whose semantics it applies."""
    from portable_ssm.cli import main

    lm = portable_ssm.load_pretrained(conv_case["folder"])
    assert lm.config.attention.conv == 4 and lm.config.attention.n_kv_heads == 4
    assert tuple(lm.params["layers.1.mixer.conv1d.weight"].shape) == (96, 1, 4)
    assert tuple(lm.params["layers.1.mixer.conv1d.bias"].shape) == (96,)
    assert main(["info", conv_case["folder"]]) == 0
    shown = capsys.readouterr().out
    assert "conv 4" in shown and "as MHA's forward" in shown and "mamba_ssm's own cached decoding" in shown


def test_pool_steps_carry_each_slots_attention_conv_state(conv_case):
    """Rows prefilled apart and put in pool slots 2 and 0 step through gather/scatter to the
    whole sequence's logits: the pool moves the attention conv state with its slot."""
    lm = portable_ssm.load_pretrained(conv_case["folder"])
    ids = conv_case["ids"]
    pool, slots = lm.empty_state(3, PROMPT), np.array([2, 0])
    for row in range(2):
        _, rows = lm.prefill(ids[row:row + 1, :6], max_len=PROMPT)
        pool = lm.pool_put(pool, slots[row:row + 1], rows)
    for t in range(6, PROMPT):
        logits, pool = lm.step(ids[:, t], pool, state_batch_indices=slots)
        assert _rel(logits, conv_case["full"][:, t]) < 1e-4, t
    assert not pool.kv[0].conv[1].any()  # the slot no row used keeps its zero state


def test_a_state_without_the_attention_conv_state_is_refused(conv_case):
    lm = portable_ssm.load_pretrained(conv_case["folder"])
    state = lm.empty_state(2, PROMPT)
    bare = state._replace(kv=(KVCache(state.kv[0].k, state.kv[0].v),))
    with pytest.raises(ValueError, match=r"state\.kv\[0\]\.conv: expected a conv state of shape \(2, 96, 4\)"):
        lm.step(conv_case["ids"][:, 0], bare)
    with pytest.raises(ValueError, match=r"state\.kv\[0\]\.conv"):
        lm.prefill(conv_case["ids"], state=bare)
    with pytest.raises(ValueError, match=r"rows\.kv\[0\]\.conv"):
        lm.pool_put(state, np.array([0, 1]), bare)


@pytest.mark.parametrize("conv", [-1, True, 2.0])
def test_attention_spec_refuses_a_conv_that_is_not_an_int_at_least_0(conv):
    with pytest.raises(ValueError, match="AttentionSpec.conv"):
        AttentionSpec(4, 4, 8, 1.0, conv=conv)


def test_an_in_proj_of_the_unrounded_mlp_dim_is_refused_naming_the_rounding(tmp_path):
    """mlp_dim 200 means 256 rows of [up; gate] in in_proj (MHA rounds it up to 256): a checkpoint
    with 200 rows is refused naming in_proj and the rounding, not read misaligned."""
    variant = VARIANTS["attention_conv_mlp"]
    save_mamba_ssm(_bamba(variant).eval(), variant, tmp_path)
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    mixer = "backbone.layers.1.mixer."
    for leaf in ("weight", "bias"):
        weights[mixer + f"in_proj.{leaf}"] = weights[mixer + f"in_proj.{leaf}"][:64 + 200].contiguous()
    weights[mixer + "out_proj.weight"] = weights[mixer + "out_proj.weight"][:, :32 + 100].contiguous()
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"in_proj.weight' has shape \(264, 32\).*mlp 256: mlp_dim rounded up "
                                              r"to a multiple of 256"):
        portable_ssm.load_pretrained(tmp_path)
