"""Checkpoints round-trip bit-exactly on every backend, name the tensor that is cut, missing or
mismatched, and never unpickle anything."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import portable_ssm as ps
from portable_ssm.checkpoint import CheckpointError, load_arrays, load_params, save_arrays, save_params

CONFIG = ps.Mamba2Config(d_model=8, n_layer=2, d_state=4, headdim=4, vocab_size=10)


def _perturbed(xp, dtype):
    """Parameters whose every bit matters: init plus noise, on xp's backend in ``dtype``."""
    host = ps.init_params(CONFIG, seed=3, dtype="float64")
    rng = np.random.default_rng(0)
    return {k: xp.asarray_from(v + rng.standard_normal(v.shape), dtype) for k, v in host.items()}


def _bits(xp, array):
    out = xp.numpy(array)
    return out.view(np.uint8), out.dtype


def _header(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), 8 + length, raw


def test_params_round_trip_is_bit_exact_on_every_backend(xp, dtype, tmp_path):
    params = _perturbed(xp, dtype)
    save_params(tmp_path / "m.safetensors", params, CONFIG, metadata={"step": "7"})
    loaded, config, meta = load_params(tmp_path / "m.safetensors", backend=xp.name, device=xp.device,
                                       return_metadata=True)
    assert config == CONFIG and meta == {"step": "7"}
    assert list(loaded) == list(ps.param_shapes(CONFIG))
    for key, value in params.items():
        got, want = _bits(xp, loaded[key]), _bits(xp, value)
        assert got[1] == want[1] and np.array_equal(got[0], want[0]), key
        assert type(loaded[key]) is type(value), key


@pytest.mark.parametrize("backend,dtype", [("torch", "bfloat16"), ("torch", "float16"), ("jax", "bfloat16")])
def test_half_precision_params_come_back_in_their_dtype_bit_exact(backend, dtype, tmp_path):
    pytest.importorskip(backend)
    params = ps.cast_params(ps.init_params(CONFIG, seed=1, dtype="float64"), dtype, backend=backend)
    save_params(tmp_path / "h.safetensors", params, CONFIG)
    loaded, _ = load_params(tmp_path / "h.safetensors", backend=backend)
    to_numpy = ps.backends.load(backend).to_numpy
    for key, value in params.items():
        assert str(loaded[key].dtype).endswith(dtype), key
        assert np.array_equal(to_numpy(loaded[key]), to_numpy(value)), key


def test_a_file_written_from_torch_loads_on_numpy_with_the_same_values(tmp_path):
    torch = pytest.importorskip("torch")
    params = ps.init_params(CONFIG, seed=2, backend="torch")
    save_params(tmp_path / "t.safetensors", params, CONFIG)
    loaded, _ = load_params(tmp_path / "t.safetensors")
    for key, value in params.items():
        assert isinstance(loaded[key], np.ndarray)
        assert np.array_equal(loaded[key], value.numpy()), key
    assert not list(tmp_path.glob("*.tmp")), "the temporary file was left behind"
    assert torch.equal(params["norm_f.weight"], torch.ones(8))


@pytest.mark.parametrize("fraction", [0.999, 0.75, 0.5, 0.2, 0.0])
def test_truncated_file_error_names_the_first_cut_tensor(tmp_path, fraction):
    path = tmp_path / "cut.safetensors"
    save_params(path, ps.init_params(CONFIG, seed=0), CONFIG)
    header, data_start, raw = _header(path)
    data_size = int(fraction * (len(raw) - data_start))
    path.write_bytes(raw[:data_start + data_size])
    tensors = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    cut = next(name for (start, end), name in tensors if end > data_size)
    for load in (load_params, load_arrays):
        with pytest.raises(CheckpointError, match=rf"truncated: tensor '{cut}'") as err:
            load(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize("keep", [0, 5, 8, 40])
def test_file_cut_inside_its_header_says_so(tmp_path, keep):
    path = tmp_path / "short.safetensors"
    save_params(path, ps.init_params(CONFIG, seed=0), CONFIG)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match="truncated"):
        load_params(path)


def test_corrupt_header_entry_names_the_tensor(tmp_path):
    path = tmp_path / "bad.safetensors"
    save_params(path, ps.init_params(CONFIG, seed=0), CONFIG)
    header, data_start, raw = _header(path)
    header["layers.1.mixer.D"]["shape"] = [CONFIG.nheads + 1]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[data_start:])
    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.mixer.D' is corrupt"):
        load_params(path)


def test_tensor_that_does_not_fit_the_config_is_named(tmp_path):
    params = ps.init_params(CONFIG, seed=0)
    meta = {"config": json.dumps(CONFIG.to_dict())}
    wrong = {**params, "layers.0.mixer.A_log": np.zeros(CONFIG.nheads + 2)}
    save_arrays(tmp_path / "shape.safetensors", wrong, metadata=meta)
    mismatch = r"tensor 'layers.0.mixer.A_log' has shape \(6,\), expected \[4\]"
    with pytest.raises(CheckpointError, match=mismatch):
        load_params(tmp_path / "shape.safetensors")
    missing = {k: v for k, v in params.items() if k != "norm_f.weight"}
    save_arrays(tmp_path / "missing.safetensors", missing, metadata=meta)
    with pytest.raises(CheckpointError, match=r"tensor 'norm_f.weight' is missing"):
        load_params(tmp_path / "missing.safetensors")
    save_arrays(tmp_path / "extra.safetensors", {**params, "head.weight": np.zeros(3)}, metadata=meta)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'head.weight'"):
        load_params(tmp_path / "extra.safetensors")


def test_file_without_a_config_is_refused_with_the_reason(tmp_path):
    save_arrays(tmp_path / "plain.safetensors", {"w": np.ones(3)})
    with pytest.raises(CheckpointError, match="no portable_ssm config"):
        load_params(tmp_path / "plain.safetensors")


class _Payload:
    """Unpickling this would create ``target``: the proof that something was unpickled."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def test_pickle_files_are_refused_and_never_unpickled(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "was_unpickled"
    path = tmp_path / "evil.pt"
    torch.save({"layers.0.mixer.A_log": _Payload(marker)}, path)
    for load in (load_params, load_arrays):
        with pytest.raises(CheckpointError, match="not a safetensors file"):
            load(path)
    assert not marker.exists()


def test_save_arrays_keeps_every_dtype_and_the_metadata(tmp_path):
    torch = pytest.importorskip("torch")
    arrays = {"ids": torch.arange(5), "step": torch.tensor(3.0), "w": torch.randn(2, 3, dtype=torch.bfloat16),
              "h": torch.randn(4, dtype=torch.float16), "x": torch.randn(3, dtype=torch.float64)}
    save_arrays(tmp_path / "a.safetensors", arrays, metadata={"note": "hi"})
    loaded, meta = load_arrays(tmp_path / "a.safetensors", backend="torch")
    assert meta == {"note": "hi"}
    for key, value in arrays.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    as32, _ = load_arrays(tmp_path / "a.safetensors", backend="torch", dtype="float32")
    assert as32["w"].dtype == torch.float32 and as32["ids"].dtype == torch.int64


def test_save_params_refuses_metadata_that_would_shadow_the_format(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        save_params(tmp_path / "m.safetensors", ps.init_params(CONFIG), CONFIG, metadata={"config": "{}"})
