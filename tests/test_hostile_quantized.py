"""quantize, QuantizedWeight, params_nbytes and load_pretrained(weights=) on hostile input.

Only TypeError or ValueError naming the argument (``kind``, ``weights``, ``params[key]``) come
out: a kind that is no str, a key that is no str, a value that is no array, an already quantized
weight, a non-finite weight (ValueError naming the key and row: its NaN or infinite int8 scale would
poison the row) and, for bfloat16, a magnitude that rounds to infinity. A row of subnormals gets a
non-zero scale (its int8 storage never comes from a NaN), and whatever is stored dequantizes to
finite values within half a step of each row.
"""

from __future__ import annotations

import warnings

import array_api_compat.numpy as nxp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import portable_ssm as ps
from portable_ssm.io import load_pretrained
from portable_ssm.quantized import QuantizedWeight, dequantize

KEY = "layers.0.mixer.in_proj.weight"
#: The float32 from which bfloat16 rounding (nearest, ties to even) gives infinity: bits 0x7F7F8000.
BFLOAT16_OVERFLOW = float.fromhex("0x1.ff0000p+127")


def matrix(*rows) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("call,error,message", [
    (lambda: ps.quantize({KEY: matrix([1, 2])}, None), TypeError, "kind: expected one of"),
    (lambda: ps.quantize({KEY: matrix([1, 2])}, b"int8"), TypeError, "kind: expected one of"),
    (lambda: ps.quantize({KEY: matrix([1, 2])}, "int4"), ValueError, "kind: expected one of"),
    (lambda: ps.quantize({1: matrix([1, 2])}, "int8"), TypeError, "params: expected str keys, got int 1"),
    (lambda: ps.quantize({KEY: matrix([1, 2]), "norm.weight": None}, "int8"), TypeError, "params['norm.weight']"),
    (lambda: ps.quantize({KEY: [[1.0, 2.0]]}, "int8"), TypeError, f"params[{KEY!r}]"),
    (lambda: ps.quantize([matrix([1, 2])], "int8"), TypeError, "params: expected a dict"),
    (lambda: ps.quantize(ps.quantize({KEY: matrix([1, 2])}, "int8"), "bfloat16"), TypeError, "already quantized"),
    (lambda: ps.quantize({KEY: matrix([1, 2]).astype(np.float64)}, "int8"), TypeError, "expected a float32"),
    (lambda: ps.quantize({KEY: matrix([1, 2], [0, np.nan])}, "int8"), ValueError,
     f"params[{KEY!r}]: expected finite values, got inf or nan in row 1"),
    (lambda: ps.quantize({KEY: matrix([np.inf, 2])}, "bfloat16"), ValueError, "got inf or nan in row 0"),
    (lambda: ps.quantize({KEY: matrix([1, 2], [3.4e38, 0])}, "bfloat16"), ValueError,
     f"params[{KEY!r}]: row 1 holds a magnitude of at least 3.396178e+38, which bfloat16 rounds to infinity"),
    (lambda: ps.params_nbytes({"a": None}), TypeError, "params['a']"),
    (lambda: ps.params_nbytes([1]), TypeError, "params: expected a dict"),
    (lambda: QuantizedWeight(np.zeros((1, 1), np.int8), None, "int4", np.float32), ValueError,
     "kind: expected 'int8' or 'bfloat16', got 'int4'"),
], ids=["kind-none", "kind-bytes", "kind-int4", "key-int", "value-none", "value-list", "params-list",
        "already-quantized", "float64", "nan", "inf", "bf16-overflow", "nbytes-none", "nbytes-list",
        "weight-kind"])
def test_hostile_quantize_input_is_a_type_or_value_error_naming_the_argument(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error and message in str(info.value), info.value


def test_a_row_of_subnormals_gets_a_nonzero_scale_and_no_nan_is_ever_cast():
    w = matrix([1e-44, -1e-45, 0], [0, 0, 0], [1, -0.5, 0.25])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a division by a zero scale warns before its NaN is cast to int8
        q = ps.quantize({KEY: w}, "int8")[KEY]
    assert np.all(q.scale > 0)
    assert np.array_equal(q.data[:2], np.zeros((2, 3), np.int8))
    assert np.abs(dequantize(q, xp=nxp) - w).max() <= 0.5 / 127 + 1e-7


def test_a_row_at_the_float32_maximum_dequantizes_to_finite_values():
    big = np.finfo(np.float32).max
    q = ps.quantize({KEY: matrix([big, -big, 1])}, "int8")[KEY]
    back = dequantize(q, xp=nxp)
    assert np.all(np.isfinite(back)) and np.abs(back - matrix([big, -big, 1])).max() <= 0.5 * q.scale[0] * 1.01


def test_bfloat16_keeps_the_largest_magnitude_below_its_overflow():
    below = np.nextafter(np.float32(BFLOAT16_OVERFLOW), np.float32(0))
    q = ps.quantize({KEY: matrix([below, -below])}, "bfloat16")[KEY]
    assert np.all(np.isfinite(dequantize(q, xp=nxp)))


def test_params_nbytes_counts_integer_and_bool_arrays():
    assert ps.params_nbytes({"a": np.zeros(3, np.int64), "b": np.zeros(2, bool), "c": np.zeros(4, np.float16)}) == 34


def test_load_pretrained_weights_is_checked_at_the_door(tmp_path):
    config = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, vocab_size=20)
    path = tmp_path / "m.safetensors"
    ps.Mamba2LM(ps.init_params(config), config).save(path)
    with pytest.raises(TypeError, match="weights: expected one of .* as a str, got int"):
        load_pretrained(path, weights=8)
    with pytest.raises(ValueError, match="weights: 'int8' stores float32 params in low precision; got "
                                         "dtype='float64'"):
        load_pretrained(path, weights="int8", dtype="float64")
    with pytest.raises(TypeError, match="local_files_only: expected True or False, got str"):
        load_pretrained(path, local_files_only="no")
    with pytest.raises(TypeError, match="path: expected a str or os.PathLike path"):
        load_pretrained(3)
    for folder in (path, tmp_path):  # a save_params file and a folder (no config.json: refused first)
        with pytest.raises(ValueError, match="dtype: expected None or one of float64, float32, float16, bfloat16, "
                                             "got 'int8'"):
            load_pretrained(folder, dtype="int8")
        with pytest.raises(ValueError, match="backend: expected one of numpy, .*, got None"):
            load_pretrained(folder, backend=None)


# --- property: random matrices ---------------------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(w=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=6),
                    elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)),
       kind=st.sampled_from(["int8", "bfloat16"]))
def test_random_weights_quantize_to_finite_rows_within_half_a_step_or_a_value_error(w, kind):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q = ps.quantize({KEY: w}, kind)[KEY]
    except ValueError as err:
        assert f"params[{KEY!r}]" in str(err)
        assert not np.all(np.isfinite(w)) or np.abs(w).max() >= BFLOAT16_OVERFLOW
        return
    back = dequantize(q, xp=nxp)
    assert np.all(np.isfinite(back))
    step = q.scale[:, None] if kind == "int8" else np.abs(w) / 128  # bf16: 8 bits of significand
    assert np.all(np.abs(back - w) <= 0.5 * step * (1 + 1e-6) + 1e-38)
