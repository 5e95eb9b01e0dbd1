"""Checkpoints round-trip bit-exactly on every backend, name the tensor that is cut, missing or
mismatched, and never unpickle anything."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

import portable_ssm as ps
from portable_ssm.io import CheckpointError, load_arrays, load_params, save_arrays, save_params

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
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "a temporary file was left behind"
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


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_saving_quantized_params_names_the_weight_and_writes_nothing(kind, tmp_path):
    params = ps.quantize(ps.init_params(CONFIG), kind)
    with pytest.raises(TypeError, match=rf"params\['embedding.weight'\]: a QuantizedWeight \({kind}, .* "
                                        r"save the float params and quantize after loading"):
        save_params(tmp_path / "m.safetensors", params, CONFIG)
    with pytest.raises(TypeError, match=r"arrays\['w'\]: a QuantizedWeight"):
        save_arrays(tmp_path / "a.safetensors", {"w": params["layers.0.mixer.in_proj.weight"]})
    with pytest.raises(TypeError, match=r"arrays\['w'\]: expected an array, got list"):
        save_arrays(tmp_path / "a.safetensors", {"w": [1.0, 2.0]})
    assert not list(tmp_path.iterdir())


# --- The NumPy safetensors reader/writer (portable_ssm.io.safetensors) ---

NUMERIC = ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint64", "uint32", "uint16"]


def _every_dtype() -> dict[str, np.ndarray]:
    """One array per numpy dtype safetensors holds (random bits, NaN patterns included), plus edge shapes."""
    rng = np.random.default_rng(5)
    arrays = {f"t.{name}": np.frombuffer(rng.bytes(15 * np.dtype(name).itemsize), name).reshape(3, 5)
              for name in NUMERIC}
    arrays["t.bool"] = rng.integers(0, 2, (2, 3)).astype(bool)
    arrays["scalar"] = np.array(-2.5, np.float32)
    arrays["empty"] = np.zeros((0, 4), np.int32)
    return arrays


def _raw_file(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file built by hand from ``name -> (dtype, shape, raw bytes)``: an oracle independent
    of any writer."""
    header, data = {}, b""
    for name, (kind, shape, raw) in tensors.items():
        header[name] = {"dtype": kind, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_integer_and_bool_arrays_round_trip_bit_exact(backend, tmp_path):
    pytest.importorskip(backend)
    host = {"ids": np.array([0, -1, 2**62, -(2**63)], np.int64), "i32": np.array([[7, -(2**31)]], np.int32),
            "i16": np.array([-32768, 5], np.int16), "i8": np.array([-128, 127], np.int8),
            "u8": np.arange(256, dtype=np.uint8), "mask": np.array([[True, False], [False, True]]),
            "step": np.array(9, np.int64)}
    arrays = {k: ps.to_backend(v, backend) for k, v in host.items()}
    save_arrays(tmp_path / "ints.safetensors", arrays, metadata={"note": "ints"})
    loaded, meta = load_arrays(tmp_path / "ints.safetensors", backend=backend, dtype="float32")
    assert meta == {"note": "ints"}
    to_numpy = ps.backends.load(backend).to_numpy
    for key, value in host.items():
        assert type(loaded[key]) is type(arrays[key]), key
        assert _same_bits(to_numpy(loaded[key]), value), key


def test_bf16_is_widened_exactly_and_f16_is_kept(tmp_path):
    from portable_ssm.io.safetensors import read_safetensors

    rng = np.random.default_rng(2)
    bf16_bits = rng.integers(0, 2**16, (4, 3), dtype=np.uint16)
    f16 = rng.standard_normal(5).astype(np.float16)
    _raw_file(tmp_path / "half.safetensors", {"b": ("BF16", [4, 3], bf16_bits.astype("<u2").tobytes()),
                                              "h": ("F16", [5], f16.astype("<f2").tobytes())})
    arrays, dtypes, meta = read_safetensors(tmp_path / "half.safetensors")
    assert dtypes == {"b": "bfloat16", "h": "float16"} and meta == {}
    widened = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    assert _same_bits(arrays["b"], widened) and _same_bits(arrays["h"], f16)
    assert all(a.flags.writeable and a.flags.aligned for a in arrays.values())


def test_files_of_the_safetensors_package_read_bit_exact_for_every_dtype(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from portable_ssm.io.safetensors import read_safetensors

    arrays = _every_dtype()
    safetensors_numpy.save_file(arrays, str(tmp_path / "pkg.safetensors"), metadata={"k": "v"})
    got, dtypes, meta = read_safetensors(tmp_path / "pkg.safetensors")
    assert meta == {"k": "v"} and sorted(got) == sorted(arrays)
    for key, value in arrays.items():
        assert _same_bits(got[key], value), key
        assert dtypes[key] == value.dtype.name and got[key].flags.writeable, key


def test_the_safetensors_package_reads_bf16_files_the_same(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from portable_ssm.io.safetensors import read_safetensors

    tensors = {"w": torch.randn(3, 4).bfloat16(), "h": torch.randn(2).half()}
    safetensors_torch.save_file(tensors, str(tmp_path / "bf.safetensors"))
    got, dtypes, _ = read_safetensors(tmp_path / "bf.safetensors")
    assert dtypes == {"w": "bfloat16", "h": "float16"}
    assert torch.equal(torch.from_numpy(got["w"]), tensors["w"].float())
    assert torch.equal(torch.from_numpy(got["h"]), tensors["h"])


def test_save_arrays_writes_the_bytes_of_the_safetensors_package(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    arrays = _every_dtype()
    save_arrays(tmp_path / "ours.safetensors", arrays, metadata={"k": "v"})
    safetensors_numpy.save_file(arrays, str(tmp_path / "pkg.safetensors"), metadata={"k": "v"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "pkg.safetensors").read_bytes()
    back = safetensors_numpy.load_file(str(tmp_path / "ours.safetensors"))
    for key, value in arrays.items():
        assert _same_bits(back[key], value), key


def test_save_arrays_names_what_safetensors_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match="z: safetensors holds no complex128 arrays"):
        save_arrays(tmp_path / "c.safetensors", {"w": np.ones(2), "z": np.ones(2, complex)})
    with pytest.raises(TypeError, match="values must be strings, got int for 'step'"):
        save_arrays(tmp_path / "m.safetensors", {"w": np.ones(2)}, metadata={"step": 3})
    assert not list(tmp_path.iterdir())


def test_loading_never_imports_the_safetensors_package(tmp_path):
    path = tmp_path / "m.safetensors"
    save_params(path, ps.init_params(CONFIG, seed=0), CONFIG)
    save_arrays(tmp_path / "a.safetensors", {"ids": np.arange(3)})
    code = ("import sys, portable_ssm; "
            f"portable_ssm.load_params({str(path)!r}); "
            f"ids = portable_ssm.load_arrays({str(tmp_path / 'a.safetensors')!r})[0]['ids']; "
            f"portable_ssm.save_arrays({str(tmp_path / 'b.safetensors')!r}, {{'ids': ids}}); "
            "assert 'safetensors' not in sys.modules, 'safetensors was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
