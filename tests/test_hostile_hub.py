"""load_pretrained on hostile model folders and Hugging Face cache layouts: files and links.

A model folder's JSON files (config.json, generation_config.json, shard indexes) are read only
when they are regular files inside the folder; in a Hub cache snapshot every file must resolve
into that snapshot or its repository's ``blobs/``. A ref that is a FIFO, a directory, too large,
not a 40-hex-digit hash or a symlink out of ``refs/`` is a CheckpointError naming the ref file,
and nothing ever waits on a FIFO. No error quotes the bytes of a file the loader refused to read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import string
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pretrained import write_transformers_checkpoint

from portable_ssm.io import CheckpointError, load_pretrained

pytest.importorskip("transformers")

SECRET = "hunter2-not-for-your-eyes"
COMMIT = hashlib.sha1(b"main").hexdigest()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny transformers checkpoint folder, written once."""
    folder = tmp_path_factory.mktemp("source")
    write_transformers_checkpoint(folder)
    return folder


@pytest.fixture
def model(source, tmp_path):
    """A fresh copy of :func:`source`: ``tmp_path / "model"``."""
    return shutil.copytree(source, tmp_path / "model")


@pytest.fixture
def secret(tmp_path):
    """A file outside every model folder and cache, holding JSON a loader would quote in an error."""
    path = tmp_path / "private" / "secret.json"
    path.parent.mkdir()
    path.write_text(f'{{"hidden_size": "{SECRET}", "weight_map": {{"{SECRET}": 1}}}}')
    return path


@pytest.fixture
def cache(source, tmp_path, monkeypatch):
    """A Hub cache holding ``org/tiny`` at ``main`` as huggingface_hub lays it out (every snapshot
    file a symlink to ``../../blobs/<sha256>``); returns the repository folder."""
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for file in source.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, repo / "blobs" / digest)
        (repo / "snapshots" / COMMIT / file.name).symlink_to(f"../../blobs/{digest}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # never the network
    return repo


def relink(link, target) -> None:
    link.unlink()
    link.symlink_to(target)


def refused(call, *fragments) -> CheckpointError:
    """The CheckpointError ``call()`` raises; it names every fragment and quotes no secret."""
    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert all(str(f) in message for f in fragments), message
    assert SECRET not in message, message
    return info.value


def test_the_cache_layout_loads_as_huggingface_hub_writes_it(cache):
    assert load_pretrained("org/tiny").num_parameters > 0


# --- symlinks out of a cache snapshot or a model folder -----------------------------------------

def test_a_cache_config_linked_outside_the_cache_is_refused_without_quoting_it(cache, secret):
    config = cache / "snapshots" / COMMIT / "config.json"
    relink(config, secret)
    refused(lambda: load_pretrained("org/tiny"), config, "resolves outside")


def test_a_cache_weight_file_linked_outside_the_cache_is_refused(cache, tmp_path):
    weights = cache / "snapshots" / COMMIT / "model.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(weights, elsewhere)  # a valid file: only where it lies is wrong
    relink(weights, elsewhere)
    refused(lambda: load_pretrained("org/tiny"), weights, "resolves outside", "blobs/")


def test_a_cache_file_linked_into_another_repositorys_blobs_is_refused(cache):
    other = cache.parent / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    weights = cache / "snapshots" / COMMIT / "model.safetensors"
    shutil.copy(weights, other / "abc")
    relink(weights, other / "abc")
    refused(lambda: load_pretrained("org/tiny"), weights, "resolves outside")


def test_a_snapshot_folder_linked_outside_the_cache_is_refused(cache, model):
    snapshot = cache / "snapshots" / COMMIT
    shutil.rmtree(snapshot)
    snapshot.symlink_to(model, target_is_directory=True)
    refused(lambda: load_pretrained("org/tiny"), snapshot, "snapshot must be a directory of that cache")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_local_json_file_linked_outside_the_folder_is_refused_without_quoting_it(model, secret, name):
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(secret)
    refused(lambda: load_pretrained(model), model / name, "resolves outside the model directory")


def test_a_local_index_linked_outside_the_folder_is_refused_without_quoting_it(model, secret):
    (model / "model.safetensors.index.json").symlink_to(secret)
    refused(lambda: load_pretrained(model), model / "model.safetensors.index.json", "resolves outside")


def test_a_local_json_file_linked_inside_the_folder_loads(model):
    (model / "configs").mkdir()
    shutil.move(model / "config.json", model / "configs" / "real.json")
    (model / "config.json").symlink_to(model / "configs" / "real.json")
    assert load_pretrained(model).num_parameters > 0


# --- refs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [f"{SECRET}\n", "0" * 39, "G" * 40, "\xff\xfe", COMMIT + "\n" + COMMIT],
                         ids=["text", "short", "not-hex", "binary", "two-hashes"])
def test_a_ref_that_holds_no_commit_hash_is_refused_naming_it_without_quoting_it(cache, content):
    (cache / "refs" / "main").write_bytes(content.encode("utf-8", "surrogateescape"))
    refused(lambda: load_pretrained("org/tiny"), cache / "refs" / "main", "40-hex-digit commit hash")


def test_a_huge_ref_is_refused_without_reading_it(cache):
    (cache / "refs" / "main").write_bytes(COMMIT.encode() + b" " * (1 << 20))
    refused(lambda: load_pretrained("org/tiny"), cache / "refs" / "main", "bytes, more than the 1024")


def test_a_ref_that_is_a_directory_is_refused_naming_it(cache):
    (cache / "refs" / "pr" / "1").mkdir(parents=True)
    refused(lambda: load_pretrained("org/tiny", revision="pr"), cache / "refs" / "pr", "a directory")


def test_a_ref_linked_outside_refs_is_refused(cache, tmp_path):
    (tmp_path / "planted").write_text(COMMIT)
    relink(cache / "refs" / "main", tmp_path / "planted")
    refused(lambda: load_pretrained("org/tiny"), cache / "refs" / "main", "resolves outside the cache's refs/")


def _in_a_subprocess(code: str) -> list[str]:
    """The lines a child Python prints running ``code`` (killed after a generous timeout: a hang fails)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("where", ["ref", "config", "weights", "generation-config", "shard"])
def test_a_fifo_in_place_of_a_ref_or_a_data_file_is_refused_at_once(cache, model, where):
    fifo = {"ref": cache / "refs" / "main", "config": cache / "snapshots" / COMMIT / "config.json",
            "weights": model / "model.safetensors", "generation-config": model / "generation_config.json",
            "shard": model / "model-2.safetensors"}[where]
    fifo.unlink(missing_ok=True)
    if where == "shard":
        (model / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-2.safetensors"}}')
    os.mkfifo(fifo)
    target = "org/tiny" if where in ("ref", "config") else str(model)
    lines = _in_a_subprocess(f"""
        from portable_ssm.io import CheckpointError, load_pretrained
        try:
            load_pretrained({target!r})
        except CheckpointError as err:
            print(err)
    """)
    assert lines == [f"{fifo}: a FIFO, not a regular file"]


# --- property: random refs and revisions ---------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ref=st.binary(max_size=200), revision=st.one_of(st.none(), st.text(string.printable, max_size=12),
                                                       st.text(max_size=6)))
def test_random_refs_and_revisions_only_give_documented_errors(cache, ref, revision):
    (cache / "refs" / "main").write_bytes(ref)
    try:
        load_pretrained("org/tiny", revision=revision)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        quoted = str(err).replace(str(cache.parent), "")
        text = ref.strip().decode("utf-8", "replace")
        assert len(text) < 6 or text not in quoted, quoted


# --- property: random bytes in the JSON files of a folder ---------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["config.json", "generation_config.json", "model.safetensors.index.json"]),
       data=st.one_of(st.binary(max_size=64), st.builds(str.encode, st.text(max_size=64)),
                      st.sampled_from([b"{}", b"[]", b"null", b'{"weight_map": {}}', b"\xef\xbb\xbf{}",
                                       b'{"a": 1, "a": 2}', b"[" * 5000, b"NaN"])))
def test_random_bytes_in_a_json_file_only_give_a_checkpoint_error_naming_it(model, name, data):
    (model / name).write_bytes(data)
    try:
        load_pretrained(model)
    except CheckpointError as err:
        assert str(err).startswith(str(model)), err
