"""Bad input is refused at the door with errors that name the argument, the expected and the actual value.

Each of the Rust/Candle bugs in shared/seeds (shape errors found deep in the scan, F32/F64 mixing,
Δ broadcast to the wrong shape) is a case here.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import portable_ssm as ps

rng = np.random.default_rng(0)
b, l, h, p, g, n = 2, 6, 4, 3, 2, 5


def good() -> dict:
    return dict(x=rng.standard_normal((b, l, h, p)), dt=rng.standard_normal((b, l, h)), A=-np.ones(h),
                B=rng.standard_normal((b, l, g, n)), C=rng.standard_normal((b, l, g, n)))


def raises(exc, *patterns):
    """pytest.raises that also requires every pattern in the message."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(pat)})" for pat in patterns))


@pytest.mark.parametrize("scan", [ps.ssd_scan, ps.selective_scan])
class TestScanArguments:
    def test_wrong_rank_names_argument_and_legend(self, scan):
        args = good() | {"x": rng.standard_normal((b, l, h * p))}
        with raises(ValueError, "x", "[b, l, h, p]", f"{(b, l, h * p)}"):
            scan(**args)

    def test_mismatched_length_names_both_arguments(self, scan):
        args = good() | {"B": rng.standard_normal((b, l + 1, g, n))}
        with raises(ValueError, "B", "[b, l, g, n]", f"l={l} from x", f"{(b, l + 1, g, n)}"):
            scan(**args)

    def test_dt_averaged_to_one_value_per_head_is_refused(self, scan):
        args = good() | {"dt": rng.standard_normal((b, h))}  # the seed bug: Δ not per time step
        with raises(ValueError, "dt", "[b, l, h]"):
            scan(**args)

    def test_heads_not_a_multiple_of_groups(self, scan):
        args = good() | {"B": rng.standard_normal((b, l, 3, n)), "C": rng.standard_normal((b, l, 3, n))}
        with raises(ValueError, "h=4", "g=3"):
            scan(**args)

    def test_C_state_size_must_equal_B(self, scan):
        args = good() | {"C": rng.standard_normal((b, l, g, n + 1))}
        with raises(ValueError, "C", f"n={n} from B"):
            scan(**args)

    def test_A_as_a_dense_state_matrix_is_refused(self, scan):
        args = good() | {"A": -np.eye(n)}  # the seed bug: A treated as [n, n]
        with raises(ValueError, "A", "[h]"):
            scan(**args)

    @pytest.mark.parametrize("name,shape", [("D", (h + 1,)), ("D", (h, p + 1)), ("z", (b, l, h, p + 1)),
                                            ("dt_bias", (h, 1)), ("initial_states", (b, h, n, p))])
    def test_optional_arguments_are_shape_checked(self, scan, name, shape):
        with raises(ValueError, name):
            scan(**good(), **{name: rng.standard_normal(shape)})

    def test_integer_inputs_are_refused(self, scan):
        args = good() | {"x": np.ones((b, l, h, p), dtype=np.int64)}
        with raises(TypeError, "x", "floating", "int64"):
            scan(**args)

    def test_float32_and_float64_storage_do_not_mix(self, scan):
        args = good() | {"x": good()["x"].astype(np.float32)}
        with raises(TypeError, "B is float64", "x is float32"):
            scan(**args)

    def test_initial_states_must_be_in_the_compute_dtype(self, scan):
        args = {k: v.astype(np.float32) for k, v in good().items()}
        with raises(TypeError, "initial_states", "float32", "float64"):
            scan(**args, initial_states=np.zeros((b, h, p, n)))

    def test_arrays_from_two_backends_name_both(self, scan):
        torch = pytest.importorskip("torch")
        args = good() | {"C": torch.zeros((b, l, g, n), dtype=torch.float64)}
        with raises(TypeError, "C is a torch array", "x is a numpy array"):
            scan(**args)

    def test_non_arrays_are_refused(self, scan):
        args = good() | {"A": [-1.0] * h}
        with raises(TypeError, "A", "list"):
            scan(**args)

    @pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True])
    def test_chunk_size_must_be_a_positive_int(self, scan, chunk_size):
        with raises(ValueError, "chunk_size"):
            scan(**good(), chunk_size=chunk_size)

    @pytest.mark.parametrize("limit", [(1.0, 0.5), (-1.0, 1.0), (0.1,), "x"])
    def test_dt_limit_must_be_an_increasing_nonnegative_pair(self, scan, limit):
        with raises(ValueError, "dt_limit"):
            scan(**good(), dt_limit=limit)


def test_step_needs_a_state_and_one_token_shapes():
    args = {k: v[:, 0] if k != "A" else v for k, v in good().items()}
    with raises(TypeError, "state"):
        ps.ssd_step(None, **args)
    with raises(ValueError, "x", "[b, h, p]"):
        ps.ssd_step(np.zeros((b, h, p, n)), **(args | {"x": good()["x"]}))
    with raises(ValueError, "state", "[b, h, p, n]"):
        ps.ssd_step(np.zeros((b, h, n, p)), **args)


def test_discretize_checks_dt_and_A():
    with raises(ValueError, "A", "[h]", "h=4 from dt"):
        ps.discretize(np.zeros((2, 4)), np.zeros(5))
    with raises(ValueError, "dt", "rank"):
        ps.discretize(np.zeros(()), np.zeros(1))


CFG = ps.Mamba2Config(d_model=8, n_layer=2, d_state=4, headdim=4)


class TestModelArguments:
    params = ps.init_params(CFG)
    x = np.zeros((1, 3, 8), dtype=np.float32)

    def test_missing_parameter_is_named(self):
        params = {k: v for k, v in self.params.items() if k != "layers.1.mixer.A_log"}
        with raises(ValueError, "missing", "layers.1.mixer.A_log"):
            ps.forward(self.x, params, config=CFG)

    def test_misshapen_parameter_is_named_with_both_shapes(self):
        params = self.params | {"layers.0.mixer.conv1d.weight": np.zeros((24, 4), np.float32)}
        with raises(ValueError, "layers.0.mixer.conv1d.weight", "[24, 1, 4]", "(24, 4)"):
            ps.forward(self.x, params, config=CFG)

    def test_unexpected_parameter_is_named(self):
        with raises(ValueError, "unexpected", "lm_head.weight"):
            ps.forward(self.x, self.params | {"lm_head.weight": np.zeros((3, 8), np.float32)}, config=CFG)

    def test_params_of_another_dtype_than_x_are_refused(self):
        with raises(TypeError, "float32", "float64", "cast_params"):
            ps.forward(self.x.astype(np.float64), self.params, config=CFG)

    def test_params_of_mixed_dtypes_are_refused(self):
        params = self.params | {"norm_f.weight": np.ones(8)}
        with raises(TypeError, "norm_f.weight", "float64", "float32"):
            ps.forward(self.x, params, config=CFG)

    def test_params_from_another_backend_are_refused(self):
        torch = pytest.importorskip("torch")
        params = self.params | {"norm_f.weight": torch.ones(8)}
        with raises(TypeError, "torch", "numpy", "norm_f.weight"):
            ps.forward(self.x, params, config=CFG)

    def test_x_of_the_wrong_width_names_d_model(self):
        with raises(ValueError, "x", "[b, l, d_model]", "d_model=8 from config"):
            ps.forward(np.zeros((1, 3, 9), np.float32), self.params, config=CFG)

    def test_params_without_config_are_refused(self):
        with raises(TypeError, "config", "Mamba2Config"):
            ps.forward(self.x, self.params)

    def test_config_mismatch_names_the_parameter(self):
        other = ps.Mamba2Config(d_model=8, n_layer=2, d_state=8, headdim=4)
        with raises(ValueError, "layers.0.mixer.in_proj.weight"):
            ps.forward(self.x, self.params, config=other)

    def test_initial_state_is_checked(self):
        _, state = ps.forward(self.x, self.params, config=CFG, return_state=True)
        with raises(TypeError, "initial_state", "Mamba2State"):
            ps.forward(self.x, self.params, config=CFG, initial_state=(state.conv, state.ssm))
        short = ps.Mamba2State(conv=state.conv[:1], ssm=state.ssm[:1])
        with raises(ValueError, "initial_state.conv", "2 layers"):
            ps.forward(self.x, self.params, config=CFG, initial_state=short)
        wrong_batch = ps.Mamba2State(conv=state.conv, ssm=tuple(np.concatenate([s, s]) for s in state.ssm))
        with raises(ValueError, "initial_state.ssm[0]", "b=1"):
            ps.forward(self.x, self.params, config=CFG, initial_state=wrong_batch)

    def test_step_takes_one_token(self):
        with raises(ValueError, "x", "[b, d_model]"):
            ps.step(self.x, None, self.params, config=CFG)

    def test_unknown_backend_is_named(self):
        with raises(ValueError, "backend", "tensorflow"):
            ps.forward(self.x, backend="tensorflow")


@pytest.mark.parametrize("kw,field", [
    (dict(d_model=10, headdim=8), "headdim"),
    (dict(d_model=16, headdim=8, ngroups=3), "ngroups"),
    (dict(d_model=0), "d_model"),
    (dict(d_model=8, headdim=4, dt_min=0.1, dt_max=0.01), "dt_min"),
    (dict(d_model=8, headdim=4, A_init_range=(0.0, 16.0)), "A_init_range"),
    (dict(d_model=8, headdim=4, dt_limit=(0.5, 0.1)), "dt_limit"),
    (dict(d_model=8, headdim=4, vocab_size=-1), "vocab_size"),
])
def test_config_names_the_wrong_field(kw, field):
    with raises(ValueError, f"Mamba2Config.{field}"):
        ps.Mamba2Config(**kw)


class TestMixedBackends:
    """x (or token ids), params and state from two libraries: one TypeError naming both libraries and
    the argument, raised before any array is touched (not an AttributeError from array_api_compat)."""

    config = ps.Mamba2Config(d_model=8, n_layer=2, d_state=8, headdim=4, vocab_size=16)

    @pytest.fixture
    def pair(self):
        torch = pytest.importorskip("torch")
        return torch, ps.init_params(self.config), ps.init_params(self.config, backend="torch")

    @pytest.mark.parametrize("x_lib", ["numpy", "torch"])
    def test_forward_and_step_with_x_and_params_from_two_libraries(self, pair, x_lib):
        torch, numpy_params, torch_params = pair
        x = np.zeros((1, 3, 8), np.float32)
        x, params, other = (x, torch_params, "torch") if x_lib == "numpy" else (torch.zeros(1, 3, 8),
                                                                                 numpy_params, "numpy")
        with raises(TypeError, "params['", f"a {other} array", f"x is a {x_lib} array", "to_backend"):
            ps.forward(x, params, config=self.config)
        with raises(TypeError, "params['", f"a {other} array", f"x_t is a {x_lib} array"):
            ps.step(x[:, 0], None, params, config=self.config)

    def test_a_state_from_another_library_is_named(self, pair):
        torch, numpy_params, _ = pair
        torch_state = ps.empty_state(self.config, 1, torch.zeros(1, 8))
        x = np.zeros((1, 3, 8), np.float32)
        with raises(TypeError, "state.conv[0] is a torch array", "x_t is a numpy array"):
            ps.step(x[:, 0], torch_state, numpy_params, config=self.config)
        with raises(TypeError, "initial_state.conv[0] is a torch array", "x is a numpy array"):
            ps.forward(x, numpy_params, config=self.config, initial_state=torch_state)

    def test_logits_and_logits_step_with_ids_params_or_state_from_two_libraries(self, pair):
        from portable_ssm import lm

        torch, numpy_params, torch_params = pair
        ids = np.zeros((1, 3), np.int64)
        with raises(TypeError, "params['", "a torch array", "input_ids is a numpy array"):
            lm.logits(ids, torch_params, config=self.config)
        with raises(TypeError, "params['", "a numpy array", "input_ids is a torch array"):
            lm.logits(torch.zeros(1, 3, dtype=torch.int64), numpy_params, config=self.config)
        numpy_state = ps.empty_state(self.config, 1, np.zeros((1, 8), np.float32))
        with raises(TypeError, "params['", "a torch array", "token is a numpy array"):
            lm.logits_step(ids[:, 0], numpy_state, torch_params, config=self.config)
        torch_state = ps.empty_state(self.config, 1, torch.zeros(1, 8))
        with raises(TypeError, "state.conv[0] is a torch array", "token is a numpy array"):
            lm.logits_step(ids[:, 0], torch_state, numpy_params, config=self.config)
        with raises(TypeError, "params", "a torch array", "input_ids is a numpy array"):
            ps.Mamba2LM(torch_params, self.config).logits(ids)

    def test_empty_state_checks_its_arguments(self):
        like = np.zeros((1, 8), np.float32)
        with raises(TypeError, "config", "Mamba2Config", "dict"):
            ps.empty_state({}, 1, like)
        with raises(ValueError, "batch", "int >= 1", "0"):
            ps.empty_state(self.config, 0, like)
        with raises(TypeError, "like", "expected an array", "list"):
            ps.empty_state(self.config, 1, [0.0] * 8)
        with raises(TypeError, "like", "real floating", "int64"):
            ps.empty_state(self.config, 1, np.zeros((1, 8), np.int64))
