"""The portable-ssm command line: generate (numpy-only, streamed, with or without tokenizer.json),
info, convert, bench forwarding, --help everywhere, clean errors."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from test_pretrained import write_transformers_checkpoint

import portable_ssm
from portable_ssm.cli import main
from portable_ssm.io import load_pretrained


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-model")
    write_transformers_checkpoint(folder)  # tied, vocab 50, model.safetensors
    return folder


def assert_one_error_line(err: str, command: str, *messages: str) -> None:
    """stderr is exactly one ``portable-ssm COMMAND: error: ...`` line holding every message."""
    assert err.count("\n") == 1 and err.startswith(f"portable-ssm {command}: error: "), err
    assert all(m in err for m in messages) and "Traceback" not in err, err


def copy_model(model_dir, folder):
    """A copy of the checkpoint in ``folder`` (to add tokenizer files beside it)."""
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    return folder


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_generate_on_numpy_imports_neither_torch_nor_transformers(model_dir):
    done = run_python(f"""
        import sys
        from portable_ssm.cli import main
        status = main(["generate", "--model", {str(model_dir)!r}, "--prompt", "3 1 4 1 5",
                       "--max-new-tokens", "6"])
        loaded = [m for m in ("torch", "transformers", "jax") if m in sys.modules]
        assert not loaded, f"the generate path imported {{loaded}}"
        sys.exit(status)
    """)
    assert done.returncode == 0, done.stderr
    want = load_pretrained(model_dir).generate([[3, 1, 4, 1, 5]], 6)[0]
    assert done.stdout == " ".join(str(i) for i in want) + "\n"
    assert "6 tokens in" in done.stderr


class Recorder:
    """A stdout that keeps every write, to see tokens arrive one by one."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_generate_streams_each_token_as_it_comes(model_dir, monkeypatch):
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--model", str(model_dir), "--prompt", "7 8", "--max-new-tokens", "5",
                 "--temperature", "0.7", "--top-k", "10", "--top-p", "0.9", "--seed", "3"]) == 0
    want = load_pretrained(model_dir).generate([[7, 8]], 5, temperature=0.7, top_k=10, top_p=0.9, seed=3)[0]
    assert out.writes[0] == "7 8" and len(out.writes) == 1 + 5 + 1
    assert "".join(out.writes) == " ".join(str(i) for i in want) + "\n"


def test_generate_encodes_and_decodes_with_tokenizer_json(model_dir, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    words = {f"w{i}": i for i in range(50)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--prompt", "w3 w1 w4", "--max-new-tokens", "4"]) == 0
    want = load_pretrained(folder).generate([[3, 1, 4]], 4)[0]
    assert capsys.readouterr().out == tok.decode(want.tolist()) + "\n"


@pytest.mark.parametrize("backend, weights, compile", [("numpy", "int8", False), ("numpy", "bfloat16", False),
                                                      ("torch", "int8", True)])
def test_generate_weights_and_compile_options_give_the_quantized_models_tokens(model_dir, capsys, backend,
                                                                               weights, compile):
    if backend == "torch":
        pytest.importorskip("torch")
    argv = ["generate", "--model", str(model_dir), "--prompt", "3 1 4", "--ids", "--max-new-tokens", "4",
            "--backend", backend, "--weights", weights] + (["--compile"] if compile else [])
    assert main(argv) == 0
    lm = load_pretrained(model_dir, backend=backend, weights=weights)
    want = np.asarray(lm.generate([[3, 1, 4]], 4))[0]
    out = capsys.readouterr()
    assert out.out == " ".join(str(i) for i in want) + "\n" and f"{weights} weights]" in out.err


def test_info_prints_layout_parameter_count_and_dtype(model_dir, capsys):
    assert main(["info", str(model_dir)]) == 0
    table = {line[:32].strip(): line[33:] for line in capsys.readouterr().out.splitlines()}
    count = load_pretrained(model_dir).num_parameters
    assert table["layout"] == "transformers" and table["parameters"] == f"{count:,}"
    assert (table["stored dtype"], table["config.ngroups"], table["vocab"]) == ("float32", "2",
                                                                                "50 (logits rows 50)")


def test_convert_writes_a_file_that_loads_back_in_the_asked_dtype(model_dir, tmp_path, capsys):
    dst = tmp_path / "tiny.safetensors"
    assert main(["convert", str(model_dir), str(dst), "--dtype", "float64"]) == 0
    assert f"wrote {dst}" in capsys.readouterr().out
    converted, original = load_pretrained(dst), load_pretrained(model_dir)
    assert (converted.dtype, converted.config) == ("float64", original.config)
    ids = np.arange(10).reshape(2, 5)
    np.testing.assert_allclose(converted.logits(ids), original.logits(ids), rtol=1e-5, atol=1e-6)


def test_bench_forwards_its_arguments_untouched(monkeypatch):
    seen = []
    fake = types.ModuleType("portable_ssm.bench")
    fake.main = lambda argv=None: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "portable_ssm.bench", fake)
    assert main(["bench", "--help", "--lengths", "128", "256"]) == 7
    assert seen == [["--help", "--lengths", "128", "256"]]


@pytest.mark.parametrize("command,option", [("generate", "--max-new-tokens"), ("info", "path"),
                                            ("convert", "--dtype")])
def test_every_subcommand_has_help(command, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: portable-ssm {command}") and option in out


def test_python_dash_m_portable_ssm_is_the_cli():
    done = subprocess.run([sys.executable, "-m", "portable_ssm", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and all(c in done.stdout for c in ("generate", "info", "convert", "bench"))


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "1"], "expected a checkpoint directory"),
    (["generate", "--model", "MODEL", "--prompt", "hello there"], "the prompt must be integer ids"),
    (["generate", "--model", "MODEL", "--prompt", "1 99"], r"expected token ids in [0, 50)"),
    (["convert", "MODEL", "OUT", "--dtype", "bfloat16"], "numpy has no bfloat16"),
])
def test_bad_input_exits_2_with_a_one_line_message(model_dir, tmp_path, capsys, argv, message):
    argv = [str(model_dir) if a == "MODEL" else str(tmp_path / "o.safetensors") if a == "OUT" else a
            for a in argv]
    assert main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, argv[0], message)


def test_version_prints_the_single_sourced_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"portable-ssm {portable_ssm.__version__}\n"
    assert importlib.metadata.version("portable-ssm") == portable_ssm.__version__
    pyproject = (pathlib.Path(portable_ssm.__file__).parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "portable_ssm.__version__" }' in pyproject


@pytest.mark.parametrize("option,value", [("--dtype", "float8"), ("--dtype", "float128"), ("--backend", "tf")])
def test_a_bad_choice_is_one_error_line_with_status_2(model_dir, capsys, option, value):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(model_dir), "--prompt", "1", option, value])
    assert exit_.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "generate", f"argument {option}: invalid choice: {value!r}")


def test_integer_ids_need_no_tokenizers_package(model_dir, tmp_path, monkeypatch, capsys):
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # not installed
    assert main(["generate", "--model", str(folder), "--ids", "--prompt", "3 1 4", "--max-new-tokens", "3"]) == 0
    want = load_pretrained(folder).generate([[3, 1, 4]], 3)[0]
    assert capsys.readouterr().out == " ".join(str(i) for i in want) + "\n"
    assert main(["generate", "--model", str(folder), "--prompt", "3 1 4"]) == 2
    assert_one_error_line(capsys.readouterr().err, "generate", "tokenizer.json needs the tokenizers package",
                          "pip install 'portable-ssm[cli]'", "--ids")


def test_a_garbage_tokenizer_json_is_one_error_line(model_dir, tmp_path, capsys):
    pytest.importorskip("tokenizers")
    folder = copy_model(model_dir, tmp_path / "m")
    (folder / "tokenizer.json").write_text("not json {")
    assert main(["generate", "--model", str(folder), "--prompt", "hello"]) == 2
    assert_one_error_line(capsys.readouterr().err, "generate", f"{folder / 'tokenizer.json'}: not a readable "
                          "tokenizer.json")


def test_a_device_the_backend_lacks_is_one_error_line(model_dir, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device")
    assert main(["generate", "--model", str(model_dir), "--prompt", "1", "--backend", "torch",
                 "--device", "cuda"]) == 2
    assert_one_error_line(capsys.readouterr().err, "generate", "--device cuda", "no CUDA device")
    assert main(["generate", "--model", str(model_dir), "--prompt", "1", "--backend", "torch",
                 "--device", "gpu7"]) == 2
    assert_one_error_line(capsys.readouterr().err, "generate", "--device 'gpu7': not a torch device")


def test_a_missing_backend_package_names_what_to_install(model_dir):
    done = run_python(f"""
        import sys
        sys.modules["torch"] = None  # torch not installed
        from portable_ssm.cli import main
        sys.exit(main(["info", {str(model_dir)!r}]) + 10 * main(["convert", {str(model_dir)!r}, "/tmp/x.safetensors",
                                                                 "--backend", "torch"]))
    """)
    assert done.returncode == 20, done.stderr
    assert_one_error_line(done.stderr, "convert", "torch", "pip install 'portable-ssm[torch]'")


def test_convert_refuses_a_file_name_other_than_safetensors(model_dir, tmp_path, capsys):
    assert main(["convert", str(model_dir), str(tmp_path / "out.bin")]) == 2
    assert_one_error_line(capsys.readouterr().err, "convert", "expected a .safetensors file name", "out.bin")
    assert list(tmp_path.iterdir()) == []


def test_convert_copies_the_tokenizer_files_next_to_the_output(model_dir, tmp_path, capsys):
    folder = copy_model(model_dir, tmp_path / "m")
    files = {"tokenizer.json": "{}", "tokenizer_config.json": '{"a": 1}', "special_tokens_map.json": '{"b": 2}'}
    for name, text in files.items():
        (folder / name).write_text(text)
    (tmp_path / "out").mkdir()
    dst = tmp_path / "out" / "m.safetensors"
    assert main(["convert", str(folder), str(dst)]) == 0
    assert "copied tokenizer.json, tokenizer_config.json, special_tokens_map.json" in capsys.readouterr().out
    assert {name: (tmp_path / "out" / name).read_text() for name in files} == files
    assert load_pretrained(dst).num_parameters == load_pretrained(folder).num_parameters


def test_a_convert_write_error_names_the_users_path_not_a_temporary_file(model_dir, tmp_path, capsys):
    dst = tmp_path / "missing-folder" / "m.safetensors"
    assert main(["convert", str(model_dir), str(dst)]) == 2
    err = capsys.readouterr().err
    assert_one_error_line(err, "convert", f"{dst}: No such file or directory")
    assert ".tmp" not in err


def test_bench_errors_take_the_same_one_line_path(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# portable_ssm benchmarks\n\n- command: portable-ssm bench --out benchmarks\n")
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 2
    assert_one_error_line(capsys.readouterr().err, "bench", f"{results} holds a full benchmark run", "--overwrite")
    assert results.read_text().endswith("--out benchmarks\n")
