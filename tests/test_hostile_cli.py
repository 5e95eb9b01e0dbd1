"""portable-ssm on hostile flags and files: one error line naming the flag or file, never a traceback.

Option values are refused before anything is loaded or printed (negative counts, a non-finite or
negative temperature, top-p outside (0, 1], sampling options with greedy decoding, ids outside the
vocabulary). ``convert`` and ``generate`` read tokenizer files only when they are regular files
inside the checkpoint's directory: a symlink to a file elsewhere or a FIFO is an error naming it,
its bytes never copied or quoted, and nothing is written then; a symlink already at a copy's target
is replaced, not written through. Any other exception is still one line, with status 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import assert_one_error_line, copy_model
from test_pretrained import write_transformers_checkpoint

import portable_ssm.cli as cli
from portable_ssm.cli import main

pytest.importorskip("transformers")

SECRET = "hunter2-not-for-your-eyes"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-cli-model")
    write_transformers_checkpoint(folder)  # vocab 50, model.safetensors
    return folder


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "private" / "id_rsa"
    path.parent.mkdir()
    path.write_text(f'{{"version": "{SECRET}"}}')
    return path


def status_of(argv) -> int:
    """``main(argv)``'s exit status, whether returned or raised by the argument parser."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def refused(argv, capsys, *messages) -> str:
    """Runs ``argv``; asserts status 2, nothing on stdout and one error line holding ``messages``."""
    assert status_of(argv) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert_one_error_line(err, argv[0], *map(str, messages))
    assert SECRET not in err
    return err


# --- option values, refused before running -------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: expected an integer >= 0, got -3"),
    (["--max-new-tokens", "2.5"], "argument --max-new-tokens: expected an integer >= 0"),
    (["--temperature", "-0.5"], "argument --temperature: expected a number in [0, inf), got -0.5"),
    (["--temperature", "nan"], "argument --temperature"),
    (["--temperature", "inf"], "argument --temperature"),
    (["--temperature", "1", "--top-p", "0"], "argument --top-p: expected a number in (0, 1], got 0"),
    (["--temperature", "1", "--top-p", "1.5"], "argument --top-p"),
    (["--temperature", "1", "--top-k", "0"], "argument --top-k: expected an integer >= 1, got 0"),
    (["--top-p", "0.9"], "--top-p: only with sampling (--temperature > 0)"),
    (["--top-k", "5"], "--top-k: only with sampling (--temperature > 0)"),
    (["--temperature", "1", "--seed", "-4"], "argument --seed: expected an integer >= 0, got -4"),
    (["--eos-token-id", "-2"], "argument --eos-token-id: expected an integer >= -1, got -2"),
    (["--eos-token-id", "50"], "--eos-token-id: expected an id in [0, 50) or -1"),
    (["--prompt", "1 -2"], "--prompt: expected token ids in [0, 50) for this model, got -2"),
    (["--model", ""], "argument --model: expected a path"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_impossible_option_value_is_one_line_naming_the_flag_before_anything_runs(model_dir, capsys, extra,
                                                                                     message):
    refused(["generate", "--model", str(model_dir), "--ids", "--prompt", "1 2", *extra], capsys, message)


def test_an_unexpected_exception_is_still_one_line_with_status_1(model_dir, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the backend broke\nin two lines")

    monkeypatch.setattr(cli, "load_pretrained", broken)
    assert main(["info", str(model_dir)]) == 1
    assert_one_error_line(capsys.readouterr().err, "info", "unexpected RuntimeError: the backend broke in two lines")


def test_a_fifo_named_as_the_checkpoint_is_one_line_naming_it(tmp_path, capsys):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    refused(["info", str(fifo)], capsys, f"{fifo}: a FIFO, not a regular file")


# --- tokenizer files: only regular files inside the checkpoint's directory -----------------------

@pytest.mark.parametrize("name", cli.TOKENIZER_FILES)
def test_convert_never_copies_a_tokenizer_file_linked_outside_the_source(model_dir, tmp_path, secret, capsys, name):
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / name).symlink_to(secret)
    (tmp_path / "out").mkdir()
    refused(["convert", str(folder), str(tmp_path / "out" / "m.safetensors")], capsys, folder / name,
            "resolves outside the checkpoint directory")
    assert list((tmp_path / "out").iterdir()) == []


def test_convert_refuses_a_fifo_tokenizer_file_at_once(model_dir, tmp_path):
    folder = copy_model(model_dir, tmp_path / "m")
    os.mkfifo(folder / "tokenizer_config.json")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from portable_ssm.cli import main
        sys.exit(main(["convert", {str(folder)!r}, {str(tmp_path / 'o.safetensors')!r}]))
    """)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert_one_error_line(done.stderr, "convert", f"{folder / 'tokenizer_config.json'}: a FIFO, not a regular file")
    assert not (tmp_path / "o.safetensors").exists()


def test_convert_replaces_a_symlink_at_the_target_instead_of_writing_through_it(model_dir, tmp_path, capsys):
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / "tokenizer.json").write_text('{"model": "new"}')
    (tmp_path / "out").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "out" / "tokenizer.json").symlink_to(victim)
    assert main(["convert", str(folder), str(tmp_path / "out" / "m.safetensors")]) == 0
    assert "copied tokenizer.json" in capsys.readouterr().out
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "new"}'


def test_convert_copies_a_tokenizer_file_linked_inside_the_source(model_dir, tmp_path, capsys):
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / "tok").mkdir()
    (folder / "tok" / "real.json").write_text('{"a": 1}')
    (folder / "tokenizer_config.json").symlink_to(folder / "tok" / "real.json")
    (tmp_path / "out").mkdir()
    assert main(["convert", str(folder), str(tmp_path / "out" / "m.safetensors")]) == 0
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"a": 1}'


def test_generate_never_reads_a_tokenizer_linked_outside_the_model(model_dir, tmp_path, secret, capsys):
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / "tokenizer.json").symlink_to(secret)
    refused(["generate", "--model", str(folder), "--prompt", "hello"], capsys, folder / "tokenizer.json",
            "resolves outside the checkpoint directory")


def test_a_garbage_tokenizer_error_quotes_none_of_the_file(model_dir, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / "tokenizer.json").write_text(f'{{"{SECRET}": [1, 2, 3]}}')
    refused(["generate", "--model", str(folder), "--prompt", "hello"], capsys, "not a readable tokenizer.json")


# --- property: random option values --------------------------------------------------------------

VALUES = ["-1", "0", "1", "3", "0.5", "1.5", "nan", "inf", "-inf", "", "x", "1e3", "-0", " 2", "99", "49", "50"]
FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--eos-token-id", "--weights",
         "--dtype", "--backend", "--prompt"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.lists(st.tuples(st.sampled_from(FLAGS), st.sampled_from(VALUES + ["int8", "float64"])),
                        max_size=4))
def test_random_option_values_exit_0_or_one_error_line_with_status_2(model_dir, capsys, options):
    capsys.readouterr()
    argv = ["generate", "--model", str(model_dir), "--ids", "--prompt", "1 2"]
    for flag, value in options:
        argv += [flag, value]
    status = status_of(argv)
    out, err = capsys.readouterr()
    assert status in (0, 2), (status, err)
    if status == 2:
        assert_one_error_line(err, "generate")
    else:
        assert err.count("\n") == 1 and "tokens in" in err, err


@pytest.mark.parametrize("argv,flag", [
    (["--repeats", "0"], "--repeats"), (["--threads", "-2"], "--threads"), (["--max-len", "x"], "--max-len"),
    (["--out", ""], "--out"), (["--no-such-flag"], "--no-such-flag"), (["--clock", "sundial"], "--clock"),
])
def test_a_bad_bench_flag_is_one_line_naming_it_before_anything_runs(tmp_path, monkeypatch, capsys, argv, flag):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written

