"""save_arrays, load_arrays, save_params, load_params and load_pretrained on hostile arguments.

A path that is no str or os.PathLike is a TypeError naming ``path``, an empty one a ValueError; the
dict of arrays and the metadata must have str keys (an int key would be written as its decimal
string and come back as one); nothing but TypeError, ValueError, CheckpointError or OSError naming
the path comes out, whatever the arguments.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_ssm as ps
from portable_ssm.io import CheckpointError

CONFIG = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, vocab_size=20)


@pytest.mark.parametrize("call", [
    lambda tmp: ps.load_params(None), lambda tmp: ps.load_arrays(5), lambda tmp: ps.load_pretrained(b"/tmp"),
    lambda tmp: ps.save_params(None, ps.init_params(CONFIG), CONFIG),
    lambda tmp: ps.save_arrays(3.5, {"a": np.zeros(2)}),
], ids=["load_params-None", "load_arrays-int", "load_pretrained-bytes", "save_params-None", "save_arrays-float"])
def test_a_path_that_is_no_str_is_a_type_error_naming_path(tmp_path, call):
    with pytest.raises(TypeError, match="^path: expected a str or os.PathLike path, got "):
        call(tmp_path)


@pytest.mark.parametrize("fn", [ps.load_params, ps.load_arrays, ps.load_pretrained])
def test_an_empty_path_is_a_value_error_naming_path(fn):
    with pytest.raises(ValueError, match="^path: expected a non-empty path"):
        fn("")


@pytest.mark.parametrize("arrays,metadata,message", [
    ([np.zeros(2)], None, "arrays: expected a dict with str keys, got list"),
    ({1: np.zeros(2)}, None, "arrays: expected str keys, got int 1"),
    ({"a": np.zeros(2)}, {1: "x"}, "metadata: expected str keys, got int 1"),
    ({"a": np.zeros(2)}, [("k", "v")], "metadata: expected a dict with str keys, got list"),
], ids=["arrays-list", "arrays-int-key", "metadata-int-key", "metadata-list"])
def test_save_arrays_refuses_keys_it_would_coerce(tmp_path, arrays, metadata, message):
    with pytest.raises(TypeError, match=f"^{message}$"):
        ps.save_arrays(tmp_path / "a.safetensors", arrays, metadata=metadata)
    assert list(tmp_path.iterdir()) == []


ANYTHING = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=8),
                     st.lists(st.integers(), max_size=2), st.dictionaries(st.integers(), st.integers(), max_size=2),
                     st.builds(pathlib.Path, st.text(max_size=8)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=ANYTHING, arrays=ANYTHING, backend=ANYTHING, dtype=ANYTHING)
def test_random_arguments_only_give_documented_errors(tmp_path, monkeypatch, path, arrays, backend, dtype):
    monkeypatch.chdir(tmp_path)  # a random relative path lands here, never elsewhere
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for call in (lambda: ps.load_arrays(path, backend=backend, dtype=dtype),
                 lambda: ps.load_params(path, backend=backend, dtype=dtype),
                 lambda: ps.save_arrays(path, arrays),
                 lambda: ps.load_pretrained(path, backend=backend, dtype=dtype, local_files_only=True)):
        try:
            call()
        except (TypeError, ValueError, CheckpointError, OSError):
            pass
