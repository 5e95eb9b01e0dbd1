"""Safetensors files as a hostile user writes them, and saves that crash, race or run out of disk:
every malformed file is a CheckpointError naming the file and the tensor or key (never another
exception, never a hang, never memory beyond the file), every save publishes a whole file or none,
and bf16/fp16 are stored as BF16/F16, bit-exact."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_ssm as ps
from portable_ssm.io import CheckpointError, load_arrays, load_params, save_arrays, save_params
from portable_ssm.io.safetensors import MAX_HEADER_BYTES, bfloat16_bits, read_header, read_safetensors

CONFIG = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4, vocab_size=10)
DATA = bytes(range(32))  # the data section of the files built below: 32 bytes


def _write(path, header, data: bytes = DATA, *, length: int | None = None) -> None:
    """A safetensors file from a header (a dict, dumped as JSON, or raw bytes) and a data section."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _good() -> dict:
    """A valid header for DATA: 'a' (F32 [4]) then 'b' (I64 [2])."""
    return {"__metadata__": {"k": "v"}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "I64", "shape": [2], "data_offsets": [16, 32]}}


def _with(tensor: str, field: str, value) -> dict:
    header = _good()
    header[tensor][field] = value
    return header


def _reference_rejects(path) -> bool:
    """Whether the ``safetensors`` package refuses the file."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    try:
        safetensors_numpy.load_file(str(path))
    except Exception:  # noqa: BLE001 (any refusal counts)
        return True
    return False


_B_AFTER_GAP = {**_good(), "b": {"dtype": "I64", "shape": [1], "data_offsets": [24, 32]}}
_B_OVER_A = {**_good(), "b": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}

# (case, header, data, the message it must give); the safetensors package refuses each of them too.
MALFORMED = [
    ("overlap", _B_OVER_A, DATA[:16], r"tensor '[ab]' is corrupt: its bytes 0..16 overlap those of '[ab]'"),
    ("gap", _B_AFTER_GAP, DATA, r"tensor 'b' is corrupt: it starts at byte 24 .* ends at 16"),
    ("trailing bytes", _good(), DATA + b"\0" * 8, r"corrupt: 8 bytes after the last tensor"),
    ("float shape", _with("a", "shape", [4.0]), DATA, r"tensor 'a': 'shape' must be a list of non-negative"),
    ("fractional shape", _with("a", "shape", [4.7]), DATA, r"tensor 'a': 'shape' must be .* got \[4\.7\]"),
    ("string shape", _with("a", "shape", ["4"]), DATA, r"tensor 'a': 'shape' must be .* got \['4'\]"),
    ("bool shape", _with("a", "shape", [True, 4]), DATA, r"tensor 'a': 'shape' must be"),
    ("negative shape", _with("a", "shape", [-4]), DATA, r"tensor 'a': 'shape' must be"),
    ("scalar shape", _with("a", "shape", 4), DATA, r"tensor 'a': 'shape' must be"),
    ("2**64 dimension", _with("a", "shape", [2**64, 0]), DATA, r"tensor 'a': 'shape' must be .* below 2\*\*64"),
    ("overflowing shape", _with("a", "shape", [2**32, 2**32, 0]), DATA, r"tensor 'a' is corrupt: .* 2\*\*64"),
    ("string offsets", _with("b", "data_offsets", [16, "32"]), DATA, r"tensor 'b': 'data_offsets' must be two"),
    ("one offset", _with("b", "data_offsets", [16]), DATA, r"tensor 'b': 'data_offsets' must be two"),
    ("three offsets", _with("b", "data_offsets", [16, 32, 48]), DATA, r"tensor 'b': 'data_offsets' must be two"),
    ("float offsets", _with("b", "data_offsets", [16, 32.0]), DATA, r"tensor 'b': 'data_offsets' must be two"),
    ("end before start", _with("b", "data_offsets", [32, 16]), DATA, r"tensor '[ab]' is corrupt"),
    ("size mismatch", _with("a", "shape", [5]), DATA, r"tensor 'a' is corrupt: data_offsets \[0, 16\] for shape"),
    ("past the end", _good(), DATA[:24], r"truncated: tensor 'b' needs bytes 16..32 .* holds only 24"),
    ("unknown dtype", _with("a", "dtype", "float8"), DATA, r"tensor 'a' has dtype 'float8'; this reader reads"),
    ("dtype not a string", _with("a", "dtype", 4), DATA, r"tensor 'a' has dtype 4"),
    ("no dtype", {**_good(), "a": {"shape": [4], "data_offsets": [0, 16]}}, DATA, r"tensor 'a': .* no 'dtype'"),
    ("entry not an object", {**_good(), "a": [0, 16]}, DATA, r"tensor 'a': the header entry is list"),
    ("metadata not a map", {**_good(), "__metadata__": ["k"]}, DATA, r"'__metadata__' is list"),
    ("metadata value not a string", {**_good(), "__metadata__": {"k": 1}}, DATA,
     r"'__metadata__' entry 'k' is int, expected a string"),
    ("header not an object", b"[1, 2, 3]", DATA, r"not a safetensors file: the header does not start with '\{'"),
    ("header not UTF-8", b'{"\xff": 1}', DATA, r"not a safetensors file: the header is not UTF-8"),
    ("header not JSON", b'{"a": ', DATA, r"the header is not valid JSON"),
    ("Infinity in offsets", b'{"a": {"dtype": "U8", "shape": [32], "data_offsets": [0, Infinity]}}', DATA,
     r"the header is not valid JSON \(Infinity is not a JSON number\)"),
    ("NaN in shape", b'{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 32]}}', DATA,
     r"the header is not valid JSON \(NaN is not a JSON number\)"),
    ("5000-digit offset", b'{"a": {"dtype": "U8", "shape": [32], "data_offsets": [0, 1' + b"0" * 5000 + b"]}}",
     DATA, r"the header is not valid JSON"),
    ("deep nesting", b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"",
     r"the header is not valid JSON \(nested too deeply\)"),
]

# Files the safetensors package reads but this reader refuses, by design.
STRICTER = [
    ("duplicate tensor", b'{"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}, '
                         b'"a": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]}}', DATA,
     r"the header is not valid JSON \(the key 'a' appears twice\)"),
    ("duplicate field", b'{"a": {"dtype": "U8", "shape": [16], "shape": [32], "data_offsets": [0, 32]}}', DATA,
     r"the key 'shape' appears twice"),
    ("8-bit float", {"a": {"dtype": "F8_E4M3", "shape": [32], "data_offsets": [0, 32]}}, DATA,
     r"tensor 'a' has dtype 'F8_E4M3'; this reader reads U64, I64, F64, .*, BOOL"),
]


def _every_reader(path):
    """Each public way into a safetensors file, all of which must refuse a malformed one."""
    return [lambda: read_header(path), lambda: read_safetensors(path), lambda: load_arrays(path),
            lambda: load_params(path), lambda: ps.load_pretrained(path)]


@pytest.mark.parametrize("case,header,data,message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_file_is_a_checkpoint_error_naming_the_file_and_the_tensor(tmp_path, case, header, data,
                                                                            message):
    path = tmp_path / "bad.safetensors"
    _write(path, header, data)
    for read in _every_reader(path):
        with pytest.raises(CheckpointError, match=message) as err:
            read()
        assert str(err.value).startswith(f"{path}: "), err.value
    assert _reference_rejects(path), "the safetensors package reads it: the case is not malformed"


@pytest.mark.parametrize("case,header,data,message", STRICTER, ids=[c[0] for c in STRICTER])
def test_duplicate_names_and_unreadable_dtypes_are_refused(tmp_path, case, header, data, message):
    path = tmp_path / "strict.safetensors"
    _write(path, header, data)
    with pytest.raises(CheckpointError, match=message):
        read_safetensors(path)


def test_header_length_past_the_limit_is_refused_before_anything_is_read(tmp_path):
    path = tmp_path / "huge.safetensors"
    _write(path, b"{}", b"", length=MAX_HEADER_BYTES + 1)
    with pytest.raises(CheckpointError, match=rf"{path}: not a safetensors file: the header length "
                                              rf"{MAX_HEADER_BYTES + 1} exceeds the {MAX_HEADER_BYTES}-byte limit"):
        read_safetensors(path)


def test_valid_edge_files_are_read(tmp_path):
    """Zero-size tensors at any position, a null metadata, trailing header spaces: all valid."""
    path = tmp_path / "edge.safetensors"
    header = {"__metadata__": None, "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [16, 16]},
              **{k: v for k, v in _good().items() if k != "__metadata__"}}
    _write(path, json.dumps(header).encode() + b"   ")
    arrays, dtypes, meta = read_safetensors(path)
    assert meta == {} and dtypes == {"a": "float32", "e": "float32", "b": "int64"}
    assert arrays["e"].shape == (0, 3) and arrays["a"].tobytes() == DATA[:16]
    assert np.array_equal(arrays["b"], np.frombuffer(DATA[16:], "<i8"))


# --- Random headers: only ever a CheckpointError, and never accepting what the package refuses ---

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() |
                           st.sampled_from(["F32", "I64", "U8", "BF16", "BOOL", "4", ""]),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=3),
                           max_leaves=12)
FIELD_VALUES = JSON_VALUES | st.lists(st.integers(0, 40), max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=FIELD_VALUES, shape=FIELD_VALUES, offsets=FIELD_VALUES, drop=st.sampled_from([None, "a", "b"]))
def test_random_json_in_dtype_shape_and_offsets_only_ever_gives_a_checkpoint_error(tmp_path, dtype, shape,
                                                                                   offsets, drop):
    header = {k: v for k, v in _good().items() if k != drop}
    header["x"] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    path = tmp_path / "random.safetensors"
    path.write_bytes(struct.pack("<Q", len(json.dumps(header))) + json.dumps(header).encode() + DATA)
    try:
        arrays, _, _ = read_safetensors(path)
    except CheckpointError as err:
        assert str(err).startswith(f"{path}: ")
        return
    assert not _reference_rejects(path), f"read a file the safetensors package refuses: {header}"
    assert list(arrays["x"].shape) == shape


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=JSON_VALUES, length_delta=st.integers(-3, 3))
def test_random_headers_only_ever_give_a_checkpoint_error(tmp_path, header, length_delta):
    text = json.dumps(header).encode()
    path = tmp_path / "random.safetensors"
    path.write_bytes(struct.pack("<Q", max(0, len(text) + length_delta)) + text + DATA)
    try:
        read_safetensors(path)
    except CheckpointError:
        return
    assert not _reference_rejects(path)


# --- Memory, FIFOs, devices ---

def _peak_bytes(read) -> int:
    """Peak memory traced while ``read()`` runs (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        try:
            read()
        except CheckpointError:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_200_tensors_claiming_one_byte_range_are_refused_without_copying_it(tmp_path):
    path = tmp_path / "alias.safetensors"
    mib = 1 << 20
    header = {f"t{i}": {"dtype": "U8", "shape": [mib], "data_offsets": [0, mib]} for i in range(200)}
    _write(path, header, b"\0" * mib)
    with pytest.raises(CheckpointError, match=r"tensor 't\d+' is corrupt: its bytes 0..1048576 overlap"):
        read_safetensors(path)
    assert _peak_bytes(lambda: read_safetensors(path)) < 256 * 1024  # the header only, not one tensor


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reading_takes_the_arrays_returned_plus_at_most_one_tensor(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    path = tmp_path / "many.safetensors"
    tensors = {f"t{i:03d}": torch.full((10_000,), float(i), dtype=getattr(torch, dtype)) for i in range(200)}
    save_arrays(path, tensors)
    widened = sum(4 * t.numel() for t in tensors.values())  # BF16 comes back as float32 on the host
    biggest = max(t.numel() * t.element_size() for t in tensors.values())
    peak = _peak_bytes(lambda: read_safetensors(path))
    assert widened <= peak <= widened + biggest + 512 * 1024  # the constant: the parsed header


def test_a_fifo_or_device_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from portable_ssm.io import CheckpointError, load_arrays
        for path in ({str(fifo)!r}, "/dev/zero", {str(tmp_path)!r}):
            try:
                load_arrays(path)
            except CheckpointError as err:
                print(err)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines == [f"{fifo}: not a safetensors file: it is a FIFO, not a regular file",
                     "/dev/zero: not a safetensors file: it is a device or other special file, not a regular file",
                     f"{tmp_path}: not a safetensors file: it is a directory, not a regular file"]


# --- Saving: atomic, durable, concurrent, disk full, no permission ---

def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


def test_save_that_fails_before_the_rename_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    save_arrays(path, {"w": np.ones(3)}, metadata={"v": "old"})

    def crash(src, dst):
        raise KeyboardInterrupt  # a crash between writing the temporary file and publishing it

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_arrays(path, {"w": np.zeros(3)}, metadata={"v": "new"})
    monkeypatch.undo()
    arrays, meta = load_arrays(path)
    assert meta == {"v": "old"} and np.array_equal(arrays["w"], np.ones(3))
    assert _leftovers(tmp_path) == []


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from portable_ssm.io import save_arrays
    path, me, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for i in range(times):
        save_arrays(path, {"w": np.full(200_000, me, np.int32), "i": np.array(i)}, metadata={"writer": str(me)})
""")


def test_two_processes_saving_one_path_never_publish_a_torn_file(tmp_path):
    path = tmp_path / "shared.safetensors"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(me), "40"]) for me in (1, 2)]
    reads = 0
    while any(w.poll() is None for w in writers) or reads == 0:
        try:
            arrays, meta = load_arrays(path)
        except FileNotFoundError:
            continue
        me = int(meta["writer"])
        assert me in (1, 2) and np.array_equal(arrays["w"], np.full(200_000, me, np.int32))
        reads += 1
    assert [w.wait() for w in writers] == [0, 0]
    arrays, meta = load_arrays(path)
    assert np.array_equal(arrays["w"], np.full(200_000, int(meta["writer"]), np.int32))
    assert int(arrays["i"]) == 39 and _leftovers(tmp_path) == []


def test_disk_full_is_an_os_error_naming_the_target_and_leaves_the_old_file(tmp_path):
    path = tmp_path / "big.safetensors"
    save_arrays(path, {"w": np.ones(10)})
    code = textwrap.dedent(f"""
        import resource, signal
        import numpy as np
        from portable_ssm.io import save_arrays
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            save_arrays({str(path)!r}, {{"w": np.zeros(1 << 20)}})
        except OSError as err:
            print(type(err).__name__, err.errno, err)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"OSError {errno.EFBIG} [Errno {errno.EFBIG}] cannot write {path}: File too large"
    assert np.array_equal(load_arrays(path)[0]["w"], np.ones(10)) and _leftovers(tmp_path) == []


def test_no_permission_is_an_os_error_naming_the_target(tmp_path):
    folder = tempfile.mkdtemp()  # under /tmp, which any user may traverse
    try:
        os.chmod(folder, 0o555)
        path = os.path.join(folder, "m.safetensors")
        drop = "os.setgid(65534); os.setuid(65534)" if os.geteuid() == 0 else "pass"
        warm_up = f"save_arrays({str(tmp_path / 'w.safetensors')!r}, {{'w': np.ones(2)}})"  # imports it all
        code = (f"import os; import numpy as np; from portable_ssm.io import save_arrays; {warm_up}; {drop}\n"
                f"try:\n    save_arrays({path!r}, {{'w': np.ones(2)}})\n"
                f"except PermissionError as err:\n    print(err)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"[Errno 13] cannot write {path}: Permission denied"
        assert os.listdir(folder) == []
    finally:
        os.chmod(folder, 0o755)
        os.rmdir(folder)


def test_saved_files_get_the_mode_open_would_give(tmp_path):
    umask = os.umask(0o022)
    try:
        save_arrays(tmp_path / "m.safetensors", {"w": np.ones(2)})
    finally:
        os.umask(umask)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644


# --- bf16 and fp16 stored as BF16 and F16 ---

def _all_bits(torch, dtype):
    """Every 16-bit pattern as a tensor of ``dtype``, NaNs left out, and the NaNs alone."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    return values[~values.isnan()], values[values.isnan()]


@pytest.mark.parametrize("dtype,kind", [("bfloat16", "BF16"), ("float16", "F16")])
def test_half_precision_is_stored_in_its_own_dtype_and_reads_back_bit_exact_everywhere(tmp_path, dtype, kind):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    numbers, nans = _all_bits(torch, getattr(torch, dtype))
    tensors = {"numbers": numbers[::2], "nans": nans}  # a non-contiguous view too
    save_arrays(tmp_path / "ours.safetensors", {"numbers": tensors["numbers"]}, metadata={"k": "v"})
    header = read_header(tmp_path / "ours.safetensors")[0]
    assert header["numbers"]["dtype"] == kind and header["__metadata__"] == {"k": "v"}
    safetensors_torch.save_file({"numbers": tensors["numbers"].contiguous()}, str(tmp_path / "pkg.safetensors"),
                                metadata={"k": "v"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "pkg.safetensors").read_bytes()
    by_package = safetensors_torch.load_file(str(tmp_path / "ours.safetensors"))["numbers"]
    by_us = load_arrays(tmp_path / "ours.safetensors", backend="torch")[0]["numbers"]
    for got in (by_package, by_us):
        assert got.dtype == getattr(torch, dtype)
        assert torch.equal(got.view(torch.int16), tensors["numbers"].contiguous().view(torch.int16))
    save_arrays(tmp_path / "nans.safetensors", {"nans": nans})
    assert load_arrays(tmp_path / "nans.safetensors", backend="torch")[0]["nans"].isnan().all()
    if dtype == "bfloat16":  # widening bf16 is exact for NaNs too, so the file keeps every payload
        stored = safetensors_torch.load_file(str(tmp_path / "nans.safetensors"))["nans"]
        assert torch.equal(stored.view(torch.int16), nans.view(torch.int16))


def test_bfloat16_bits_round_to_nearest_even_exactly_as_torch_does():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    values = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([values[~np.isnan(values)], np.float32([3.0e38, -3.4e38, np.inf, -np.inf, 0.0])])
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bfloat16_bits(values), want)
    assert np.isnan((bfloat16_bits(np.float32([np.nan])).astype(np.uint32) << 16).view(np.float32)).all()


def test_bf16_params_files_are_half_the_size_and_old_f32_files_still_load_as_bf16(tmp_path):
    torch = pytest.importorskip("torch")
    params = ps.init_params(CONFIG, seed=1, backend="torch")
    save_params(tmp_path / "f32.safetensors", params, CONFIG)
    save_params(tmp_path / "bf16.safetensors", ps.cast_params(params, "bfloat16"), CONFIG)
    for name, width in (("f32", 4), ("bf16", 2)):
        header, data_start = read_header(tmp_path / f"{name}.safetensors")
        assert os.path.getsize(tmp_path / f"{name}.safetensors") - data_start == width * sum(p.numel() for p in
                                                                                               params.values())
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {name.upper()}
    loaded, _ = load_params(tmp_path / "bf16.safetensors", backend="torch")
    on_numpy, _ = load_params(tmp_path / "bf16.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in loaded.values())
    assert all(v.dtype == np.float32 for v in on_numpy.values())
    old = {k: v.float() for k, v in ps.cast_params(params, "bfloat16").items()}  # what older versions wrote
    save_arrays(tmp_path / "old.safetensors", old, metadata={"config": json.dumps(CONFIG.to_dict()),
                                                             "dtypes": json.dumps(dict.fromkeys(old, "bfloat16"))})
    legacy, _ = load_params(tmp_path / "old.safetensors", backend="torch")
    for key, value in loaded.items():
        assert legacy[key].dtype == torch.bfloat16 and torch.equal(legacy[key], value), key


# --- What load_params adds: floating params, type-checked config and dtypes metadata ---

def _params_file(path, metadata: dict[str, str], params=None) -> None:
    """``params`` (init by default) saved with ``metadata`` as the whole metadata (no format check)."""
    save_arrays(path, params if params is not None else ps.init_params(CONFIG, seed=0), metadata=metadata)


GOOD_CONFIG = json.dumps(CONFIG.to_dict())
BAD_METADATA = [
    ({"config": "[1, 2]"}, r"the config in the metadata is list, expected an object"),
    ({"config": GOOD_CONFIG[:-1] + ', "d_model": 8}'}, r"the config in the metadata is not valid JSON "
                                                      r"\(the key 'd_model' appears twice\)"),
    ({"config": GOOD_CONFIG.replace('"norm_eps": 1e-05', '"norm_eps": NaN')}, r"NaN is not a JSON number"),
    ({"config": "[" * 50_000 + "]" * 50_000}, r"the config in the metadata is not valid JSON \(nested too deeply\)"),
    ({"config": GOOD_CONFIG.replace('"d_model": 8', '"d_model": "8"')}, r"config in the metadata is corrupt "
                                                                        r"\(Mamba2Config.d_model: expected a positive"),
    ({"config": GOOD_CONFIG.replace('"d_model": 8', '"d_model": 8000000000000')},
     r"config in the metadata is corrupt \(Mamba2Config.d_model: expected a positive int, got 8000000000000 "
     r"\(at most"),
    ({"config": json.dumps({"d_model": 8, "evil": 1})}, r"corrupt \(Mamba2Config: unknown fields \['evil'\]\)"),
    ({"config": GOOD_CONFIG, "dtypes": "[]"}, r"the 'dtypes' metadata is list, expected a map"),
    ({"config": GOOD_CONFIG, "dtypes": '{"norm_f.weight": "float8"}'},
     r"'dtypes' metadata gives tensor 'norm_f.weight' the dtype 'float8', expected one of bfloat16, float16"),
    ({"config": GOOD_CONFIG, "dtypes": '{"nope": "bfloat16"}'}, r"'dtypes' metadata names 'nope', which is no"),
    ({"config": GOOD_CONFIG, "dtypes": '{"a": '}, r"the 'dtypes' metadata is not valid JSON"),
]


@pytest.mark.parametrize("metadata,message", BAD_METADATA, ids=range(len(BAD_METADATA)))
def test_corrupt_metadata_is_a_checkpoint_error_naming_the_file_and_key(tmp_path, metadata, message):
    path = tmp_path / "meta.safetensors"
    _params_file(path, metadata)
    with pytest.raises(CheckpointError, match=message) as err:
        load_params(path)
    assert str(err.value).startswith(f"{path}: ")


def test_integer_weights_are_refused_by_load_params(tmp_path):
    params = {**ps.init_params(CONFIG, seed=0), "norm_f.weight": np.ones(8, np.int8)}
    _params_file(tmp_path / "ints.safetensors", {"config": GOOD_CONFIG}, params)
    with pytest.raises(CheckpointError, match=r"tensor 'norm_f.weight' has dtype int8; parameters are floating"):
        load_params(tmp_path / "ints.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'norm_f.weight' has dtype I8, expected a float"):
        ps.load_pretrained(tmp_path / "ints.safetensors")


def test_a_dtype_argument_that_is_no_float_is_a_value_error(tmp_path):
    save_params(tmp_path / "m.safetensors", ps.init_params(CONFIG, seed=0), CONFIG)
    for load in (load_params, load_arrays):
        with pytest.raises(ValueError, match=r"dtype: expected None or one of float64, .*, got 'float8'"):
            load(tmp_path / "m.safetensors", dtype="float8")
