"""Parameters: checkpoint names and shapes, mamba_ssm's initialisation, identical on every backend."""

from __future__ import annotations

import math

import numpy as np
from conftest import assert_close

import portable_ssm as ps

CFG = ps.Mamba2Config(d_model=64, n_layer=3, d_state=16, headdim=16, ngroups=2, vocab_size=100)


def test_names_follow_the_state_spaces_checkpoints():
    names = list(ps.param_shapes(CFG))
    assert names[0] == "embedding.weight" and names[-1] == "norm_f.weight"
    assert "layers.2.mixer.in_proj.weight" in names and "lm_head.weight" not in names  # tied head
    shapes = ps.param_shapes(CFG)
    assert shapes["embedding.weight"] == (112, 64)  # vocab padded to a multiple of 16
    assert shapes["layers.0.mixer.in_proj.weight"] == (2 * 128 + 2 * 2 * 16 + 8, 64)
    assert shapes["layers.0.mixer.conv1d.weight"] == (128 + 64, 1, 4)
    untied = ps.Mamba2Config(d_model=64, headdim=16, vocab_size=100, tie_embeddings=False, D_has_hdim=True)
    assert ps.param_shapes(untied)["lm_head.weight"] == (112, 64)
    assert ps.param_shapes(untied)["layers.0.mixer.D"] == (8, 16)


def test_every_mixer_parameter_of_every_variant_is_found_by_its_layer():
    from portable_ssm.params import MIXER_LEAVES

    for config in (CFG, ps.Mamba2Config(d_model=64, headdim=16, bias=True, conv_bias=False, D_has_hdim=True),
                   ps.Mamba2Config(d_model=64, headdim=16, rmsnorm=False, d_ssm=64)):
        leaves = {k.split(".mixer.")[1] for k in ps.param_shapes(config) if ".mixer." in k}
        assert leaves <= set(MIXER_LEAVES), leaves - set(MIXER_LEAVES)


def test_initialisation_follows_mamba_ssm():
    params = ps.init_params(CFG, seed=0, dtype="float64")
    A = np.exp(params["layers.0.mixer.A_log"])
    assert ((A >= 1) & (A <= 16)).all()
    dt = np.log1p(np.exp(params["layers.1.mixer.dt_bias"]))  # softplus(dt_bias) is the initial Δ
    assert ((dt >= CFG.dt_min * 0.999) & (dt <= CFG.dt_max * 1.001)).all()
    np.testing.assert_array_equal(params["layers.0.mixer.D"], 1.0)
    np.testing.assert_array_equal(params["norm_f.weight"], 1.0)
    bound = 1 / math.sqrt(64) / math.sqrt(CFG.n_layer)
    w = params["layers.0.mixer.in_proj.weight"]
    assert np.abs(w).max() <= 1 / math.sqrt(64) and np.abs(params["layers.2.mixer.out_proj.weight"]).max() <= bound * 2
    assert abs(params["embedding.weight"].std() - 0.02) < 0.002


def test_same_seed_gives_the_same_model_on_every_backend(xp):
    host = ps.init_params(CFG, seed=7, dtype="float64")
    there = ps.init_params(CFG, seed=7, backend=xp.name, dtype="float64", device=xp.device)
    for k, v in host.items():
        assert_close(xp, there[k], v, rtol=0, dtype="float64", shape=v.shape)
    other = ps.init_params(CFG, seed=8, dtype="float64")
    assert not np.array_equal(other["layers.0.mixer.in_proj.weight"], host["layers.0.mixer.in_proj.weight"])


def test_config_round_trips_through_a_dict():
    cfg = ps.Mamba2Config(d_model=32, headdim=8, dt_limit=(0.0, math.inf), vocab_size=10)
    again = ps.Mamba2Config.from_dict(cfg.to_dict())
    assert again == cfg and math.isinf(again.dt_limit[1])
