"""The benchmark runner (portable_ssm.bench): a quick run writes its table and plot; transformers is
given the same weights; the parts select their shapes; results go to ./bench-out unless --out says
otherwise, and a --quick run never replaces a full run's results; llama.cpp rows run where
llama-cpp-python and llama.cpp's converter are there and are skipped with a note otherwise; the
hybrid part times HybridLM's decode and prefill at each precision beside them.
Timings are never asserted."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

import portable_ssm as ps
from portable_ssm.bench import hybrid, hybrid_models, llama
from portable_ssm.bench import runner as bench
from portable_ssm.bench.quality import NEW_TOKENS, QualityRow, compare
from portable_ssm.bench.report import Case, HybridRow, Row, float32_ceiling, write_results

#: llama.cpp's convert_hf_to_gguf.py, for the test that runs real llama.cpp rows (read before the
#: fixture below hides it from the other tests).
LLAMA_CONVERT = os.environ.get(llama.CONVERT_ENV)


@pytest.fixture(autouse=True)
def no_llama_converter_from_the_environment(monkeypatch):
    """Runs get llama.cpp rows only where a test gives the converter."""
    monkeypatch.delenv(llama.CONVERT_ENV, raising=False)


def test_quick_numpy_run_writes_a_markdown_table_and_a_png(tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    assert bench.main(["--quick", "--backends", "numpy", "--repeats", "2", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| shape | b | l | backend | median ms |" in text
    for row in ("| seed | 2 | 24 | numpy |", "| 130m-layer | 1 | 64 | numpy |",
                "| 130m-layer | 1 | 256 | numpy |", "| tiny-lm | 1 | 64 | numpy |", "| tiny-lm | 1 | numpy |",
                "| tiny-lm | 8 | numpy |"):
        assert row in text, row
    assert "sgemm over the groups (numpy float32 matmul, timed beside each):" in text and "FLOP count" in text
    png = (tmp_path / "scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_append_adds_a_run_as_a_section_below_the_first(tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    quick = ["--quick", "--only", "forward", "--max-len", "64", "--repeats", "2", "--out", str(tmp_path)]
    with pytest.raises(FileNotFoundError, match="run once without --append"):
        bench.main([*quick, "--backends", "numpy", "--append"])
    assert bench.main([*quick, "--backends", "numpy"]) == 0
    first = (tmp_path / "RESULTS.md").read_text()
    png = (tmp_path / "scaling.png").read_bytes()
    assert bench.main([*quick, "--backends", "numpy,numpy-ref", "--append"]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith(first.rstrip("\n")) and (tmp_path / "scaling.png").read_bytes() == png
    appended = text[len(first.rstrip("\n")):]
    assert "\n## Appended run (" in appended and "\n### Forward (inference)" in appended
    assert "command: portable-ssm bench --quick" in appended and "--append" in appended
    assert "| 130m-layer | 1 | 64 | numpy-ref |" in appended and "numpy-ref" not in first
    assert "scaling.png" not in appended


def test_backends_are_timed_side_by_side_in_rounds_each_sample_after_a_settle(monkeypatch):
    calls = []
    monkeypatch.setattr(bench.time, "sleep", lambda s: calls.append(("idle", s)))
    fns = {name: (lambda name=name: calls.append(name) or name) for name in ("numpy", "torch", "sgemm")}
    measured = bench.measure(fns, repeats=3, sample_s=0)
    settle = ("idle", bench.SETTLE_S)
    rounds = [settle, "numpy", settle, "torch", settle, "sgemm"] * 3
    assert calls == ["numpy"] * 2 + ["torch"] * 2 + ["sgemm"] * 2 + rounds
    assert {name: (runs, out) for name, (_, runs, _, _, out) in measured.items()} == {
        name: (3, name) for name in fns}


def test_decode_rows_take_their_steps_side_by_side_in_rounds(monkeypatch):
    """Every row's prompt pass first, then rounds of ROUND_STEPS steps of each row in turn and one
    streaming read, each turn after a settle, until each has DECODE_STEPS steps; each step is timed
    on its own."""
    from portable_ssm.bench.calls import DECODE_STEPS, DecodeRun

    calls = []
    monkeypatch.setattr(bench.time, "sleep", lambda s: calls.append("idle") if s == bench.SETTLE_S else None)

    def run(name):
        def tokens():
            for i in range(DECODE_STEPS + 1):
                calls.append(name)
                yield i
        return DecodeRun(tokens(), __import__("contextlib").nullcontext, None)

    runs = {"a": run("a"), "b": run("b")}
    steps, reads = bench.interleaved_decode(runs, lambda: calls.append("read"), clock=lambda: len(calls),
                                            round_steps=4)
    rounds = DECODE_STEPS // 4
    assert calls == ["a", "b", "read"] + (["idle"] + ["a"] * 4 + ["idle"] + ["b"] * 4 + ["idle", "read"]) * rounds
    assert steps["a"] == ([1] * DECODE_STEPS, list(range(DECODE_STEPS + 1))) and len(reads) == rounds
    assert reads == [1] * rounds


def test_decode_rounds_stop_at_the_steps_asked_for(monkeypatch):
    from portable_ssm.bench.calls import DecodeRun

    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    runs = {"a": DecodeRun(iter(range(100)), __import__("contextlib").nullcontext, None)}
    steps, reads = bench.interleaved_decode(runs, lambda: None, clock=lambda: 0.0, round_steps=4, steps=6)
    assert steps["a"] == ([0.0] * 6, list(range(7))) and len(reads) == 2  # rounds of 4 and 2 steps


def test_a_sample_of_quick_calls_averages_back_to_back_calls():
    done = []  # a clock that advances 10 ms per call made
    measured = bench.measure({"fast": lambda: done.append(1)}, repeats=2, clock=lambda: 0.01 * len(done),
                             sample_s=0.05, settle_s=0)
    median, runs, *_ = measured["fast"]
    assert runs == 2 and median == pytest.approx(0.01)
    assert len(done) == 2 + 2 * 5  # warm-up and calibration, then two samples of five calls


def test_lengths_of_one_shape_are_measured_as_one_group():
    shapes = bench.cases(("forward", "train", "prefill", "decode"), quick=False, max_len=None)
    assert [[(c.part, c.name, c.length) for c in g] for g in bench.groups(shapes)] == [
        [("forward", "seed", 60)], [("forward", "130m-layer", n) for n in bench.LENGTHS],
        [("train", "seed", 60)], [("train", "130m-layer", n) for n in bench.LENGTHS if n <= bench.TRAIN_MAX_LEN],
        [("prefill", "130m-lm", 2048)], [("decode", "130m-lm", bench.PROMPT)], [("decode", "130m-lm", bench.PROMPT)]]


def test_parts_and_max_len_choose_the_shapes():
    shapes = bench.cases(("scaling",), quick=False, max_len=8192)
    assert [(c.name, c.length) for c in shapes] == [("130m-layer", n) for n in (512, 2048, 8192)]
    train = bench.cases(("train",), quick=False, max_len=None)
    assert max(c.length for c in train) == bench.TRAIN_MAX_LEN
    decode = bench.cases(("decode",), quick=False, max_len=None)
    assert [(c.batch, c.config.n_layer, c.config.vocab_size, c.config.d_model) for c in decode] == [
        (1, 24, 50288, 768), (8, 24, 50288, 768)]  # 50288: a multiple of 16, as llama.cpp needs
    prefill = bench.cases(("prefill",), quick=False, max_len=None)
    assert [(c.batch, c.length, c.config) for c in prefill] == [(1, 2048, bench.LM_130M)]
    assert bench.cases(("prefill",), quick=True, max_len=None)[0].length == bench.QUICK_PREFILL
    assert bench.cases(("prefill",), quick=False, max_len=1024) == []


@pytest.fixture
def one_torch_thread():
    """One torch thread while the test runs: on a busy small machine, two spinning OpenMP threads
    make tiny torch calls 10-100x slower (speed is not what these tests check)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_transformers_runs_the_same_weights_and_sets_the_ratios(one_torch_thread):
    pytest.importorskip("transformers")
    seed, _, lm = bench.QUICK
    rows = bench.run_group([bench.Case("forward", "seed", seed, 2, 24)], ["numpy", "transformers"], repeats=2,
                           sgemm_n=64, sample_s=0.01, settle_s=0)
    numpy_row = next(r for r in rows if r.backend == "numpy")
    assert all(r.sgemm is not None and r.sgemm > 0 for r in rows)  # timed in the same rounds
    assert float(numpy_row.check) < 1e-5  # portable_ssm's output vs transformers' on the same weights
    assert numpy_row.ratio is not None and numpy_row.ratio > 0
    rows = bench.run_group([bench.Case("decode", "tiny-lm", lm, 2, bench.PROMPT)], ["numpy", "transformers"], 2,
                           sample_s=0.01, bandwidth_gib=1 / 64, settle_s=0)
    tokens = 2 * (bench.DECODE_STEPS + 1)
    assert [r.check for r in rows] == [f"{tokens}/{tokens}"] * 2  # greedy tokens agree step by step


def test_decode_rows_report_the_weights_a_step_reads_against_the_bandwidth(one_torch_thread):
    _, _, lm = bench.QUICK
    case = bench.Case("decode", "tiny-lm", lm, 1, bench.PROMPT)
    rows = {r.backend: r for r in bench.run_group([case], ["numpy", "numpy-int8", "torch-bf16"], 2, sample_s=0.01,
                                                  bandwidth_gib=1 / 64, settle_s=0)}
    params = ps.init_params(lm, seed=0)
    assert rows["numpy"].weight_bytes == sum(v.nbytes for v in params.values())  # tied head: embedding once
    matrices = sum(v.size for k, v in params.items() if k.endswith(("in_proj.weight", "out_proj.weight",
                                                                   "embedding.weight")))
    assert rows["numpy-int8"].weight_bytes == rows["numpy"].weight_bytes - 3 * matrices + 4 * sum(
        v.shape[0] for k, v in params.items() if k.endswith(("in_proj.weight", "out_proj.weight", "embedding.weight")))
    assert rows["torch-bf16"].weight_bytes == rows["numpy"].weight_bytes - 2 * matrices
    assert all(r.bandwidth is not None and r.bandwidth > 0 for r in rows.values())
    tokens = bench.DECODE_STEPS + 1
    assert rows["numpy-int8"].check.endswith(f"/{tokens}") and rows["numpy"].check == f"{tokens}/{tokens}"
    text = "\n".join(bench.write_results.__globals__["_tables"](list(rows.values())))
    assert "Memory bandwidth (streaming read):" in text and "| tiny-lm | 1 | numpy-int8 |" in text


FULL_RUN = "# portable_ssm benchmarks\n\n- command: portable-ssm bench --threads 1 --out benchmarks\n"


def test_without_out_a_run_writes_to_bench_out_and_needs_neither_tqdm_nor_matplotlib(tmp_path, monkeypatch,
                                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # neither is installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.main(["--quick", "--only", "forward", "--max-len", "64", "--backends", "numpy", "--repeats", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"wrote {Path('bench-out') / 'RESULTS.md'}\n"
    assert "bench: group 1/2" in captured.err and "bench: group 2/2" in captured.err
    text = (tmp_path / "bench-out" / "RESULTS.md").read_text()
    assert "| 130m-layer | 1 | 64 | numpy |" in text
    assert "scaling.png not written: matplotlib is not installed (pip install matplotlib)" in text
    assert "![time vs length]" not in text and sorted(p.name for p in tmp_path.rglob("*")) == ["RESULTS.md",
                                                                                             "bench-out"]


def test_a_quick_run_refuses_to_replace_a_full_run_before_measuring(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text(FULL_RUN)
    measured = []
    monkeypatch.setattr(bench, "run_group", lambda *a, **k: measured.append(a) or [])
    for extra in ([], ["--append"]):
        with pytest.raises(FileExistsError, match="holds a full benchmark run.*--overwrite"):
            bench.main(["--quick", "--out", str(tmp_path), *extra])
    assert results.read_text() == FULL_RUN and measured == []


def test_output_dir_rule():
    committed = Path(bench.__file__).parents[2] / "benchmarks"
    with pytest.raises(FileExistsError, match="RESULTS.md holds a full benchmark run"):
        bench.output_dir(committed, quick=True, overwrite=False)
    assert bench.output_dir(committed, quick=True, overwrite=True) == committed
    assert bench.output_dir(committed, quick=False, overwrite=False) == committed  # a full run, asked for by --out
    assert bench.DEFAULT_OUT == Path("bench-out")


def test_a_quick_run_replaces_an_earlier_quick_run(tmp_path):
    (tmp_path / "RESULTS.md").write_text("# portable_ssm benchmarks\n\n- command: portable-ssm bench --quick\n")
    assert bench.output_dir(tmp_path, quick=True, overwrite=False) == tmp_path
    assert bench.output_dir(tmp_path / "new", quick=True, overwrite=False) == tmp_path / "new"


def test_quick_help_states_the_measured_time(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    help_text = "".join(capsys.readouterr().out.split())  # without argparse's line breaks
    assert f"({bench.QUICK_NOTE})".replace(" ", "") in help_text and "underaminute" not in help_text
    assert "(default./bench-out;" in help_text


def _cells(text: str, start: str) -> list[str]:
    """The cells of the markdown row that starts with ``start``."""
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [cell.strip() for cell in line.strip("|").split("|")]


def _installed(*names: str, request: pytest.FixtureRequest) -> list[str]:
    """Those of ``names`` that are installed (torch on one thread while the test runs, when it is)."""
    if importlib.util.find_spec("torch"):
        request.getfixturevalue("one_torch_thread")
    return [name for name in names if importlib.util.find_spec(name)]


def test_quick_prefill_part_writes_its_table_with_the_last_logits_error(tmp_path, request):
    installed = _installed("numpy", "transformers", request=request)
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "prefill", "--backends", ",".join(installed), "--repeats", "2",
                       "--out", str(out)]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "## Prefill (b=1: the prompt pass to the last position's logits" in text
    assert "## Decode" not in text and "## Forward" not in text
    numpy_row = _cells(text, f"| tiny-lm | 1 | {bench.QUICK_PREFILL} | numpy |")
    assert float(numpy_row[4]) > 0 and float(numpy_row[7]) > 0  # median ms, tokens/s
    if "transformers" in installed:
        assert numpy_row[8] != "-" and float(numpy_row[-1]) < 1e-5  # last logits vs transformers'
        assert _cells(text, f"| tiny-lm | 1 | {bench.QUICK_PREFILL} | transformers |")[-1] == "0.0e+00"
    assert "llama.cpp rows skipped: " in text and "llama.cpp-" not in text


def test_prefill_gives_the_last_logits_of_the_full_forward_on_each_backend(request):
    import numpy as np

    from portable_ssm.bench.calls import host, prefill_fn
    from portable_ssm.lm import logits
    from portable_ssm.params import init_params

    config = bench.QUICK[2]
    params, ids = init_params(config, seed=0), np.random.default_rng(1).integers(0, config.vocab_size, (1, 40))
    want = logits(ids, params, config=config)[:, -1, :]
    for backend in _installed("numpy", "torch", "jax", "transformers", request=request):
        got = host(prefill_fn(backend, config, params, ids)())
        assert got.shape == (1, config.padded_vocab_size) and got.dtype == np.float32, backend
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=backend)


def test_llama_convert_without_llama_cpp_gives_a_note_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # llama-cpp-python is not installed
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text("raise SystemExit('the converter must not run without llama_cpp')\n")
    for args in (["--llama-convert", str(converter)], []):
        out = tmp_path / f"out{len(args)}"
        assert bench.main(["--quick", "--only", "prefill,decode", "--backends", "numpy", "--repeats", "2",
                           "--out", str(out), *args]) == 0
        text = (out / "RESULTS.md").read_text()
        assert "- llama.cpp rows skipped: llama_cpp (llama-cpp-python) is not installed" in text, args
        assert "| llama.cpp-" not in text and "llama.cpp f32" not in text
        assert f"| tiny-lm | 1 | {bench.QUICK_PREFILL} | numpy |" in text and "| tiny-lm | 1 | numpy |" in text


def test_llama_rows_say_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # as if installed
    assert llama.unavailable(None) == ("llama.cpp rows skipped: no converter given (--llama-convert "
                                       "PATH/TO/convert_hf_to_gguf.py or PORTABLE_SSM_LLAMA_CONVERT)")
    assert llama.unavailable(str(tmp_path / "nowhere.py")).endswith("nowhere.py is not a file")
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text("")
    def importlib_with(*missing: str) -> types.SimpleNamespace:  # llama's view of what is installed
        return types.SimpleNamespace(util=types.SimpleNamespace(find_spec=lambda name: name not in missing or None))

    monkeypatch.setattr(llama, "importlib", importlib_with("gguf"))
    assert "the conversion needs gguf" in llama.unavailable(str(converter))
    monkeypatch.setattr(llama, "importlib", importlib_with())
    assert llama.unavailable(str(converter), bench.LM_130M) is None
    odd = dataclasses.replace(bench.LM_130M, vocab_size=50280, pad_vocab_size_multiple=8)
    assert "a multiple of 16 up to 50432, not 50280" in llama.unavailable(str(converter), odd)
    monkeypatch.setattr(llama, "importlib", importlib)
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "forward,prefill", "--max-len", "64", "--backends", "numpy",
                       "--repeats", "2", "--out", str(out)]) == 0
    assert "- llama.cpp rows skipped: no converter given" in (out / "RESULTS.md").read_text()
    assert bench._llama(argparse.Namespace(llama_convert=None, quick=True, threads=None), ("forward",),
                        notes := [], None) is None and notes == []  # no prefill or decode part: no note


def _row(part: str, backend: str, seconds: float, batch: int = 1) -> Row:
    return Row(Case(part, "130m-lm", bench.LM_130M, batch, 2048 if part == "prefill" else bench.PROMPT),
               backend, seconds, 2, seconds, None)


def test_targets_compare_the_fastest_portable_row_with_llama_cpp_f32(tmp_path):
    rows = [_row("prefill", "numpy", 2.0), _row("prefill", "torch", 1.0), _row("prefill", "transformers", 4.0),
            _row("prefill", "llama.cpp-f32", 1.6), _row("prefill", "llama.cpp-q8_0", 0.5),
            _row("decode", "numpy", 0.010), _row("decode", "llama.cpp-f32", 0.012),
            _row("decode", "torch-int8", 0.008), _row("decode", "numpy-int8", 0.009),
            _row("decode", "llama.cpp-q8_0", 0.004), _row("decode", "torch-bf16", 0.006),
            _row("decode", "numpy", 0.02, batch=8)]
    text = write_results(rows, tmp_path, []).read_text()
    targets = text[text.index("## Targets"):text.index("## Prefill")]
    assert "- prefill 2048: best portable_ssm / llama.cpp f32 = 1.60x (torch; target >= 1.5)" in targets
    assert "- decode b=1: best portable_ssm float32 vs llama.cpp-f32 = 1.20x (numpy; target >= 1)" in targets
    assert "- decode b=1: best portable_ssm 8-bit vs llama.cpp-q8_0 = 0.50x (torch-int8; target >= 1)" in targets
    assert targets.count("llama.cpp") == 3  # no f16 row: no bfloat16 line
    assert "| 130m-lm | 1 | 2048 | llama.cpp-q8_0 | 500.0 | 2 | 500 | 4096 |" in text
    assert "| 130m-lm | 1 | llama.cpp-f32 | 12.00 | 83 |" in text
    without = write_results([r for r in rows if "llama" not in r.backend], tmp_path / "b", []).read_text()
    assert "llama.cpp f32" not in without
    graded = [QualityRow("numpy", "float32", 0.0, 64, 64, 64), QualityRow("llama.cpp-f32", "f32", 2e-7, 64, 64, 64),
              QualityRow("torch-int8", "int8", 4.7e-3, 61, 60, 64)]
    text = write_results(rows, tmp_path / "c", [], quality=graded).read_text()
    assert ("- decode b=1: best portable_ssm float32 vs llama.cpp-f32 = 1.20x (numpy; target >= 1); quality on the "
            "trained LM: numpy logits err 0.0e+00, 64/64 tokens equal; llama.cpp-f32 logits err 2.0e-07, 64/64 "
            "tokens equal") in text
    assert "(torch-int8; target >= 1); quality on the trained LM: torch-int8 logits err 4.7e-03, 61/64" in text
    assert "| torch-int8 | int8 | 4.7e-03 | 61/64 | 60/64 |" in text[text.index("## Quality of the weights"):]


def test_training_targets_state_the_float32_ceiling_the_projections_set_at_the_measured_sgemm(tmp_path):
    case = Case("train", "130m-layer", bench.LAYER_130M, 1, 2048)
    # transformers takes 1.0 s; the projections of a 130m layer (d_model 768, in_proj 3352 wide,
    # out_proj 1536 wide) over 2048 tokens, 3 products each, take 3·2·768·(3352 + 1536)·2048 FLOP,
    # 0.4613 s at 100 GFLOP/s: no float32 step gains more than 1.0 / 0.4613 = 2.17x
    rows = [Row(case, "torch", 0.5, 3, 0.5, None, ratio=2.0, sgemm=100.0),
            Row(case, "torch-compile", 0.4, 2, 9.0, None, ratio=2.5, sgemm=200.0),
            Row(case, "transformers", 1.0, 3, 1.0, None, ratio=1.0, sgemm=100.0)]
    text = write_results(rows, tmp_path, []).read_text()
    targets = text[text.index("## Targets"):text.index("## Training step")]
    assert "- torch train 130m-layer l=2048: 2.00x transformers (target >= 3; float32 ceiling 2.17x)" in targets
    # the same case with the sgemm twice as fast: the projections take half the time
    assert "- torch-compile train 130m-layer l=2048: 2.50x transformers (target >= 3; float32 ceiling 4.34x)" in targets
    assert "float32 ceiling of a training row: transformers' median / the time the projections'" in targets
    assert float32_ceiling(dataclasses.replace(rows[0], sgemm=None)) is None
    forward = write_results([dataclasses.replace(r, case=dataclasses.replace(case, part="forward")) for r in rows],
                            tmp_path / "forward", []).read_text()
    assert "ceiling" not in forward  # the bound is stated for training rows only


def test_quality_counts_the_logits_error_up_to_the_first_differing_token():
    np = pytest.importorskip("numpy")
    ref_scores = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    scores = np.array([[1.0, 0.0], [0.0, 3.0], [9.0, 9.0], [9.0, 9.0]])  # differs from step 1 on
    row = compare("x", "int8", np.array([0, 0, 0, 1]), scores, np.array([0, 1, 0, 0]), ref_scores,
                  np.array([0, 1, 0, 1]))
    assert row.logits_err == pytest.approx(2 / np.sqrt(2))  # steps 0 and 1 only: ‖(0, 2)‖ / ‖(1, 1)‖
    assert (row.equal, row.on_pattern, row.total) == (2, 3, 4)


def test_quick_quality_part_grades_each_decode_row_on_the_trained_lm(tmp_path, request):
    installed = _installed("numpy", "torch", "transformers", request=request)
    if "torch" not in installed:
        pytest.skip("the quality part trains its LM on torch")
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "quality", "--out", str(out), "--backends",
                       ",".join([*installed, "numpy-ref", "numpy-int8", "torch-bf16"])]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "## Quality of the weights (a trained 2-layer d_model 32 LM, greedy decode)" in text
    assert f"trained {bench.QUICK_TRAIN_STEPS} AdamW steps on torch" in text and "## Decode" not in text
    table = text[text.index("## Quality of the weights"):]
    assert _cells(table, "| numpy | float32 |")[2:4] == ["0.0e+00", f"{NEW_TOKENS}/{NEW_TOKENS}"]
    assert float(_cells(table, "| torch | float32 |")[2]) < 1e-5
    for name, kind in (("numpy-int8", "int8"), ("torch-bf16", "bfloat16")):
        assert 0 < float(_cells(table, f"| {name} | {kind} |")[2]) < 3e-2
    assert "| numpy-ref |" not in table and "| transformers |" not in table  # no decode rows of their own


def test_llama_cpp_rows_run_the_same_weights_on_the_tiny_lm(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    if not LLAMA_CONVERT:
        pytest.skip(f"set {llama.CONVERT_ENV} to llama.cpp's convert_hf_to_gguf.py to run the llama.cpp rows")
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "prefill,decode,quality", "--backends", "numpy,transformers",
                       "--threads", "1", "--repeats", "2", "--out", str(out), "--llama-convert", LLAMA_CONVERT]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "- llama.cpp rows: llama-cpp-python " in text and "skipped" not in text
    tokens = f"{bench.DECODE_STEPS + 1}/{bench.DECODE_STEPS + 1}"
    for name in llama.ROWS:
        prefill = _cells(text, f"| tiny-lm | 1 | {bench.QUICK_PREFILL} | {name} |")
        assert float(prefill[-1]) < (1e-4 if name == "llama.cpp-f32" else 0.5), prefill  # vs transformers
        decode = _cells(text, f"| tiny-lm | 1 | {name} |")
        assert name != "llama.cpp-f32" or decode[-1] == tokens, decode  # greedy tokens equal transformers'
    assert "| tiny-lm | 8 | llama.cpp-" not in text  # llama.cpp rows decode one sequence
    # the weights a step reads: the same float32 matrices as portable_ssm's (the head apart, one
    # embedding row not counted), within the converter's few norm/bias layout differences
    ours, theirs = (float(_cells(text, f"| tiny-lm | 1 | {name} |")[6]) for name in ("numpy", "llama.cpp-f32"))
    assert abs(theirs - ours) / ours < 0.05, (ours, theirs)
    assert f"- prefill {bench.QUICK_PREFILL}: best portable_ssm / llama.cpp f32 = " in text
    assert "- decode b=1: best portable_ssm float32 vs llama.cpp-f32 = " in text
    quality = text[text.index("## Quality of the weights"):]  # the trained LM's conversions, graded
    for name, kind, bound in (("llama.cpp-f32", "f32", 1e-5), ("llama.cpp-f16", "f16", 1e-2),
                              ("llama.cpp-q8_0", "q8_0", 5e-2)):
        assert float(_cells(quality, f"| {name} | {kind} |")[2]) < bound, name


def test_fresh_peak_measures_a_row_in_new_processes_with_and_without_its_call():
    pytest.importorskip("torch")
    from portable_ssm.bench.peak import fresh_peak_mib

    case = bench.Case("train", "130m-layer", bench.LAYER_130M, 1, 2048)
    with_call, without = fresh_peak_mib(case, "torch")
    # the fresh process holds the interpreter, torch and the weights; one training step at l=2048
    # needs its activations on top (tens of MiB at least: in_proj's output alone is 26 MB)
    assert without > 50 and with_call - without > 20


def test_a_run_with_fresh_peak_reports_each_rows_process_memory(tmp_path):
    assert bench.main(["--quick", "--only", "forward", "--max-len", "64", "--backends", "numpy", "--repeats", "2",
                       "--fresh-peak", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 130m-layer | 1 | 64 | numpy |"))
    *_, call, process, err = (cell.strip() for cell in row.strip("|").split("|"))
    assert float(process) > 20 and float(call) >= 0 and float(err) < 1e-5
    assert "peak MiB from fresh processes" in text


def test_quick_hybrid_part_times_every_precision_and_says_why_llama_cpp_rows_are_missing(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # as if installed: the reason
    monkeypatch.delenv(llama.CONVERT_ENV, raising=False)  # is the missing converter wherever the test runs
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "hybrid", "--backends", "numpy", "--repeats", "2", "--hybrid-steps", "2",
                       "--out", str(out)]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "## Hybrid models (b=1" in text and "## Decode" not in text and "## Prefill" not in text
    reason = "llama.cpp rows skipped: no converter given"
    for shape in hybrid_models.QUICK_SHAPES:
        for context in hybrid.QUICK_CONTEXTS:
            for precision, llama_row in hybrid.PRECISIONS:
                cells = _cells(text, f"| {shape.name} | decode | {context} | {precision} |")
                assert float(cells[4]) > 0 and cells[5:8] == [llama_row, "-", "-"], cells
                assert cells[8].startswith(reason), cells
        cells = _cells(text, f"| {shape.name} | prefill | {hybrid.QUICK_PREFILL} | float32 |")
        assert float(cells[4]) > 0 and cells[6] == "-" and cells[8].startswith(reason), cells
    assert "- hybrid: tiny-granite-h, tiny-falcon-h1 built by transformers" in text


def test_hybrid_shapes_and_max_len_choose_the_rows(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "hybrid", "--hybrid-shapes", "falcon", "--max-len", "16",
                       "--backends", "numpy", "--repeats", "2", "--hybrid-steps", "2", "--out", str(out)]) == 0
    rows = [line for line in (out / "RESULTS.md").read_text().splitlines() if line.startswith("| tiny-")]
    assert [_cells(line, "|")[:4] for line in rows] == [["tiny-falcon-h1", "decode", "16", p]
                                                        for p, _ in hybrid.PRECISIONS]
    with pytest.raises(SystemExit):
        bench.main(["--only", "hybrid", "--hybrid-shapes", "mamba"])


def test_the_granite_moe_shape_runs_only_when_asked_for():
    """The MoE slice is the hybrid part's third shape, left out of a run's default two."""
    assert hybrid.DEFAULT_SHAPES == ("granite", "falcon")
    moe, quick = hybrid.SHAPE_KEYS["granite-moe"]
    assert moe is hybrid_models.GRANITE_MOE and quick is hybrid_models.QUICK_GRANITE_MOE
    for shape in (moe, quick):
        assert shape.family == "granitemoehybrid" and shape.config["num_local_experts"] > shape.config[
            "num_experts_per_tok"] > 0
    assert llama.hybrid_unavailable(None, moe) == llama.unavailable(None)  # the granite rules, no other


def test_hybrid_part_needs_numpy_among_the_backends():
    notes = []
    assert hybrid.part(["granite"], None, None, ["torch"], quick=True, max_len=None, steps=2, repeats=2,
                       clock=lambda: 0.0, sample_s=0.0, settle_s=0.0, notes=notes) == []
    assert notes == ["hybrid part skipped: it runs portable_ssm on numpy, which is not among the run's backends"]


def test_hybrid_checkpoints_spell_layer_types_as_the_hub_does(tmp_path):
    """llama.cpp's converter counts only layers named "attention" (transformers 5 saves
    "full_attention"); portable_ssm reads the Hub's names into the same stack."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    shape = hybrid_models.QUICK_SHAPES[0]
    hybrid_models.write_folder(shape, tmp_path / "granite")
    kinds = json.loads((tmp_path / "granite" / "config.json").read_text())["layer_types"]
    assert kinds == ["mamba", "attention", "mamba", "attention"]
    model = ps.load_pretrained(tmp_path / "granite", backend="numpy")
    assert model.config.indices("attention") == (1, 3) and model.vocab_size == shape.vocab_size


def test_hybrid_llama_rows_say_which_rule_a_shape_breaks(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # as if installed
    monkeypatch.setattr(llama, "importlib", types.SimpleNamespace(  # and gguf, transformers, torch, tokenizers
        util=types.SimpleNamespace(find_spec=lambda name: True)))
    granite, falcon = hybrid_models.GRANITE_350M, hybrid_models.FALCON_H1_05B
    assert llama.hybrid_unavailable(None, granite) == llama.unavailable(None)
    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text("")
    vocab = tmp_path.resolve() / "models" / hybrid_models.VOCAB_FILE
    assert llama.hybrid_unavailable(str(converter), falcon) == (
        f"llama.cpp rows of falcon-h1-0.5b skipped: {vocab} (the vocabulary its tokenizer is rebuilt from) is not "
        "a file")
    vocab.parent.mkdir()
    vocab.write_bytes(b"")
    assert llama.hybrid_unavailable(str(converter), granite) is None
    assert llama.hybrid_unavailable(str(converter), falcon) is None  # 32784: the real vocabulary fits
    def with_vocab(shape, rows):
        return dataclasses.replace(shape, config={**shape.config, "vocab_size": rows})

    assert llama.hybrid_unavailable(str(converter), with_vocab(falcon, 32785)) is None  # no multiple-of-16 rule
    assert llama.hybrid_unavailable(str(converter), with_vocab(falcon, 32014)) == (
        "llama.cpp rows of falcon-h1-0.5b skipped: a vocabulary of 32014 rows is below the 32015 its tokenizer fills")
    assert llama.hybrid_unavailable(str(converter), with_vocab(granite, 100350)) == (
        "llama.cpp rows of granite-4.0-h-350m skipped: llama.cpp's granite conversion needs a vocabulary that is a "
        "multiple of 16, not 100350")
    monkeypatch.setattr(llama, "importlib", types.SimpleNamespace(
        util=types.SimpleNamespace(find_spec=lambda name: name != "tokenizers" or None)))
    assert "built with the tokenizers package, which is not installed" in llama.hybrid_unavailable(str(converter),
                                                                                                  granite)


def test_hybrid_table_holds_llama_cpp_time_over_portable_ssm(tmp_path):
    rows = [HybridRow("g", "decode", 64, "float32", 0.010, 32, "llama.cpp-f32", 0.025, "33/33 tokens equal"),
            HybridRow("g", "prefill", 2048, "float32", 2.0, 2, "llama.cpp-f32", note="llama.cpp rows skipped: why")]
    text = write_results([], tmp_path, [], hybrid=rows).read_text()
    assert _cells(text, "| g | decode |") == ["g", "decode", "64", "float32", "10.00", "llama.cpp-f32", "25.00",
                                               "2.50", "33/33 tokens equal"]
    assert _cells(text, "| g | prefill |")[4:] == ["2000.00", "llama.cpp-f32", "-", "-", "llama.cpp rows skipped: why"]


def test_hybrid_llama_cpp_rows_run_the_same_weights(tmp_path):
    for module in ("llama_cpp", "transformers", "gguf", "tokenizers"):
        pytest.importorskip(module)
    if not LLAMA_CONVERT:
        pytest.skip(f"set {llama.CONVERT_ENV} to llama.cpp's convert_hf_to_gguf.py to run the llama.cpp rows")
    out = tmp_path / "out"
    assert bench.main(["--quick", "--only", "hybrid", "--backends", "numpy", "--threads", "1", "--repeats", "2",
                       "--hybrid-steps", "4", "--out", str(out), "--llama-convert", LLAMA_CONVERT]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "skipped" not in text
    for shape in hybrid_models.QUICK_SHAPES:
        for context in hybrid.QUICK_CONTEXTS:
            for precision, row in hybrid.PRECISIONS:
                cells = _cells(text, f"| {shape.name} | decode | {context} | {precision} |")
                assert cells[5] == row and float(cells[6]) > 0 and float(cells[7]) > 0, cells
                assert precision != "float32" or cells[8] == "5/5 tokens equal", cells  # the same weights
        cells = _cells(text, f"| {shape.name} | prefill | {hybrid.QUICK_PREFILL} | float32 |")
        assert float(cells[6]) > 0 and float(cells[8].removeprefix("last logits rel err ")) < 1e-4, cells
