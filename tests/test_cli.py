"""The portable-ssm command line: generate (numpy-only, streamed, with or without tokenizer.json),
info, convert, bench forwarding, --help everywhere, clean errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from test_pretrained import write_transformers_checkpoint

from portable_ssm.cli import main
from portable_ssm.io import load_pretrained


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-model")
    write_transformers_checkpoint(folder)  # tied, vocab 50, model.safetensors
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
def test_bad_input_exits_1_with_a_one_line_message(model_dir, tmp_path, capsys, argv, message):
    argv = [str(model_dir) if a == "MODEL" else str(tmp_path / "o.safetensors") if a == "OUT" else a
            for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"portable-ssm {argv[0]}: error: ") and message in err and "Traceback" not in err
