"""A damaged kernel cache never kills the process: NumPy's compiled-kernel library is loaded only
where it and its record (size, sha256) are whole, this user's and agree; a truncated library, one
with flipped bytes, a missing or lying record, a FIFO or folder in their place is built again with
exactly one RuntimeWarning naming the file, and a cache folder that cannot be written leaves the
ufunc paths with one warning. Every load runs in a child process, so a SIGBUS (what ``dlopen`` of a
truncated library ends in at the first call) shows as a failed test, not a dead pytest. The builds
run a stand-in compiler that copies one library built for real at the start (a compile takes
seconds); it logs each run, so a test sees whether the library was built again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from portable_ssm.backends import kernel_cache
from portable_ssm.backends.numpy import kernels

# The child: loads the library (as the first NumPy forward does), calls it once, reports.
CHILD = r"""
import json, warnings
import numpy as np
from portable_ssm.backends.numpy import kernels
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lib = kernels.library()
product = None
if lib is not None:
    product = kernels.row_product(np.ones((1, 40), np.float32), np.full((3, 40), 2, np.int8), None).tolist()
print(json.dumps({"loaded": lib is not None, "product": product,
                  "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}))
"""
WANT_PRODUCT = [[80.0, 80.0, 80.0]]


@pytest.fixture(scope="module")
def real_library(tmp_path_factory) -> Path:
    """A library built once for real by the C++ compiler (the same command as the cache's)."""
    cxx = kernels.compiler()
    if not kernels.enabled() or cxx is None:
        pytest.skip("NumPy's CPU kernels: not usable here (an x86-64 CPU with AVX2 and FMA and a C++ compiler)")
    folder = tmp_path_factory.mktemp("real")
    target = folder / "numpy_kernels.so"
    kernels._build(cxx, target)
    return target


class Cache:
    """A cache folder, a stand-in compiler that copies the real library (logging each run) and the
    child process that loads from them."""

    def __init__(self, root: Path, real: Path) -> None:
        self.folder = root / "cache"
        self.log = root / "compiles.log"
        self.cxx = root / "bin" / "fake-c++"
        self.cxx.parent.mkdir()
        self.cxx.write_text(f'#!/bin/sh\necho run >> "{self.log}"\nwhile [ $# -gt 0 ]; do\n'
                            f'  if [ "$1" = "-o" ]; then cp "{real}" "$2"; exit 0; fi\n  shift\ndone\nexit 1\n')
        self.cxx.chmod(0o755)
        self.env = {**os.environ, kernel_cache.CACHE_ENV: str(self.folder), "CXX": str(self.cxx)}
        self.env.pop(kernels.ENV, None)
        self.library = self.folder / kernels.library_path(str(self.cxx)).name
        self.record = kernel_cache.record_path(self.library)

    def compiles(self) -> int:
        return len(self.log.read_text().split()) if self.log.exists() else 0

    def load(self) -> dict:
        """One child's load: exit status 0 (no signal), its report, and the builds it ran."""
        before = self.compiles()
        done = subprocess.run([sys.executable, "-c", CHILD], env=self.env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
        report = json.loads(done.stdout.strip().splitlines()[-1])
        report["built"] = self.compiles() - before
        building = f"portable_ssm: building NumPy's CPU kernels (once, a few seconds) into {self.library}"
        assert done.stderr.count(building) == report["built"], done.stderr[-2000:]  # one line a build, saying where
        return report


@pytest.fixture
def cache(tmp_path, real_library) -> Cache:
    """A cache holding a whole library, built (by the stand-in) and loaded once."""
    c = Cache(tmp_path, real_library)
    first = c.load()
    assert first == {"loaded": True, "product": WANT_PRODUCT, "warnings": [], "built": 1}
    assert c.library.is_file() and c.record.is_file()
    c.whole = (c.library.read_bytes(), c.record.read_text())  # what each example of a property test starts from
    return c


def assert_rebuilt_with_one_warning(cache: Cache) -> None:
    report = cache.load()
    assert report["loaded"] and report["product"] == WANT_PRODUCT and report["built"] == 1
    assert len(report["warnings"]) == 1 and str(cache.library) in report["warnings"][0]
    assert "damaged" in report["warnings"][0]
    again = cache.load()  # and whole from then on: no warning, no build
    assert again == {"loaded": True, "product": WANT_PRODUCT, "warnings": [], "built": 0}


def truncate(c: Cache) -> None:
    data = c.library.read_bytes()
    c.library.write_bytes(data[:len(data) // 2])


def flip_bytes(c: Cache) -> None:
    data = bytearray(c.library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[len(data) // 3] ^= 0x01
    c.library.write_bytes(bytes(data))


def record_lies(c: Cache) -> None:
    size, _ = c.record.read_text().split()
    c.record.write_text(f"{size} {'0' * 64}\n")


def record_wrong_size(c: Cache) -> None:
    _, digest = c.record.read_text().split()
    c.record.write_text(f"{c.library.stat().st_size + 7} {digest}\n")


def record_garbage(c: Cache) -> None:
    c.record.write_bytes(os.urandom(300))


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replace_with_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def truncated_with_a_matching_record(c: Cache) -> None:
    truncate(c)
    data = c.library.read_bytes()
    kernel_cache._write_durably(c.record, f"{len(data)} {kernel_cache.hashlib.sha256(data).hexdigest()}\n".encode(),
                                0o644)


DAMAGE = {
    "a truncated library": truncate,
    "a library with flipped bytes": flip_bytes,
    "a missing record": lambda c: c.record.unlink(),
    "a record whose sha256 lies": record_lies,
    "a record whose size lies": record_wrong_size,
    "a record of random bytes": record_garbage,
    "a truncated library with a record written for it": truncated_with_a_matching_record,
    "a FIFO in place of the library": lambda c: replace_with_fifo(c.library),
    "a FIFO in place of the record": lambda c: replace_with_fifo(c.record),
    "an empty folder in place of the library": lambda c: replace_with_folder(c.library),
    "an empty folder in place of the record": lambda c: replace_with_folder(c.record),
}


@pytest.mark.parametrize("damaged", list(DAMAGE))
def test_a_damaged_cached_library_is_built_again_with_one_warning_never_loaded(cache, damaged):
    DAMAGE[damaged](cache)
    assert_rebuilt_with_one_warning(cache)


def test_a_folder_with_files_in_place_of_the_library_leaves_the_ufunc_paths_with_one_warning(cache):
    cache.library.unlink()
    cache.library.mkdir()
    (cache.library / "something").write_text("not ours to remove")
    report = cache.load()
    assert report["loaded"] is False and report["product"] is None
    assert len(report["warnings"]) == 1 and str(cache.library) in report["warnings"][0]
    assert (cache.library / "something").read_text() == "not ours to remove"


def test_a_cache_folder_that_cannot_be_written_leaves_the_ufunc_paths_with_one_warning(tmp_path, real_library):
    c = Cache(tmp_path, real_library)
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the cache's parent folder should be")
    c.env[kernel_cache.CACHE_ENV] = str(blocker / "cache")  # no folder can be made under a file (even as root)
    report = c.load()
    assert report["loaded"] is False and report["built"] == 0
    assert len(report["warnings"]) == 1 and "could not be built" in report["warnings"][0]
    assert str(blocker) in report["warnings"][0]


def test_a_whole_cached_library_is_loaded_without_a_build_or_a_warning(cache):
    assert cache.load() == {"loaded": True, "product": WANT_PRODUCT, "warnings": [], "built": 0}
    assert not list(cache.folder.glob("*.partial"))
    assert cache.record.read_text().split() == [str(cache.library.stat().st_size),
                                                kernel_cache.hashlib.sha256(cache.library.read_bytes()).hexdigest()]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_bytes_as_the_cached_library_are_rebuilt_with_one_warning_or_work(cache, data):
    whole, whole_record = cache.whole  # an example that loads as it is leaves its bytes: start each from the whole
    cache.library.write_bytes(whole)
    cache.record.write_text(whole_record)
    kind = data.draw(st.sampled_from(["prefix", "random", "prefix and random tail"]))
    cut = data.draw(st.integers(0, len(whole)))
    tail = data.draw(st.binary(max_size=4096))
    content = {"prefix": whole[:cut], "random": tail, "prefix and random tail": whole[:cut] + tail}[kind]
    record = data.draw(st.sampled_from(["kept", "written for the bytes", "missing"]))
    cache.library.write_bytes(content)
    if record == "written for the bytes":
        digest = kernel_cache.hashlib.sha256(content).hexdigest()
        cache.record.write_text(f"{len(content)} {digest}\n")
    elif record == "missing":
        cache.record.unlink()
    report = cache.load()
    assert report["loaded"] and report["product"] == WANT_PRODUCT
    if report["built"] == 0:  # it works as it is: only whole bytes, or bytes a record was written for
        assert report["warnings"] == [] and (content == whole or record == "written for the bytes")
        assert content == whole or record != "kept"
    else:
        assert report["built"] == 1 and len(report["warnings"]) == 1
        assert str(cache.library) in report["warnings"][0]


# torch's ops, built by cpp_extension into its extensions folder: the child builds (or finds) them
# and runs one.
TORCH_CHILD = r"""
import json, warnings
import torch
from portable_ssm.backends import torch_kernels
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ready = torch_kernels.ensure()
product = None
if ready:
    product = torch.ops.portable_ssm_cpu.row_gemv(torch.ones(1, 40), torch.full((3, 40), 2.0), None).tolist()
print(json.dumps({"loaded": ready, "product": product,
                  "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}))
"""


@pytest.fixture
def torch_build(tmp_path) -> tuple[dict, Path]:
    """A copy of torch's build of the ops in a folder of its own (``TORCH_EXTENSIONS_DIR``), built
    here first where it was not yet (about a minute, once), and the child's environment."""
    torch_kernels = pytest.importorskip("portable_ssm.backends.torch_kernels")
    import shutil

    from torch.utils import cpp_extension

    if not torch_kernels.enabled() or not cpp_extension.is_ninja_available() or shutil.which("c++") is None:
        pytest.skip("torch's CPU kernels: not usable here (AVX2, ninja and a C++ compiler)")
    assert torch_kernels.ensure()
    name = "portable_ssm_cpu_" + torch_kernels.source_key(*torch_kernels.CFLAGS)
    built = torch_kernels.build_folder(name)
    shutil.copytree(built, tmp_path / name, ignore=shutil.ignore_patterns("lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop(kernels.ENV, None)
    return env, tmp_path / name / f"{name}.so"


def torch_load(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", TORCH_CHILD], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["truncated", "flipped bytes", "no record"])
def test_a_damaged_torch_build_is_linked_again_with_one_warning_never_loaded(torch_build, damaged):
    env, library = torch_build
    whole = {"loaded": True, "product": WANT_PRODUCT, "warnings": []}
    assert torch_load(env) == whole
    data = library.read_bytes()
    if damaged == "truncated":
        library.write_bytes(data[:len(data) // 2])
    elif damaged == "flipped bytes":
        library.write_bytes(data[:1000] + bytes([data[1000] ^ 0xFF]) + data[1001:])
    else:
        kernel_cache.record_path(library).unlink()
    report = torch_load(env)
    assert report["loaded"] and report["product"] == WANT_PRODUCT
    assert len(report["warnings"]) == 1 and str(library) in report["warnings"][0]
    assert torch_load(env) == whole
