"""The training examples: --help, the JSON last line, checkpoints and plots, exact --resume,
the LTI baseline's frozen rows, reading users' files, and the time series beating its baseline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_selective_copy  # noqa: E402
import train_timeseries  # noqa: E402

from portable_ssm.io import CheckpointError, load_arrays, load_params, save_arrays  # noqa: E402

TINY = ["--d-model", "16", "--n-layer", "1", "--d-state", "8", "--headdim", "8", "--batch-size", "4",
        "--eval-every", "2", "--ckpt-every", "2"]
TINY_SERIES = [*TINY, "--features", "12", "--seq-len", "10"]


def run(script, argv, monkeypatch, capsys) -> dict:
    """Runs an example's main() in this process; returns the JSON object of its last stdout line."""
    monkeypatch.setattr(sys, "argv", [script.__name__, *argv])
    script.main()
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


def files_of(out: Path) -> dict[str, np.ndarray]:
    params, _ = load_params(out / "model.safetensors")
    arrays, meta = load_arrays(out / "trainer.safetensors")
    return {**params, **arrays, "history": np.array(meta["history"])}


@pytest.mark.parametrize("script", [train_timeseries, train_selective_copy])
def test_help_describes_the_flags_and_their_quick_values(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script.__name__, "--help"])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--quick", "--resume", "--out", "--steps", "--amp", "--checkpoint-blocks"):
        assert flag in text
    assert "--quick" in text.split("--steps STEPS")[-1].split("--batch-size")[0]


def test_timeseries_run_ends_with_json_and_leaves_checkpoints_and_a_plot(tmp_path, monkeypatch, capsys):
    argv = [*TINY_SERIES, "--steps", "2", "--out", str(tmp_path)]
    result = run(train_timeseries, argv, monkeypatch, capsys)
    assert isinstance(result["beats_baseline"], bool) and result["steps"] == 2 and result["processes"] == 1
    for name in ("model.safetensors", "trainer.safetensors", "curves.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, config = load_params(tmp_path / "model.safetensors")
    assert config.d_model == 16


def test_resume_continues_exactly_where_an_interrupted_run_stopped(tmp_path, monkeypatch, capsys):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(train_timeseries, [*TINY_SERIES, "--steps", "4", "--out", str(whole)], monkeypatch, capsys)
    run(train_timeseries, [*TINY_SERIES, "--steps", "4", "--stop-at", "2", "--out", str(split)], monkeypatch,
        capsys)
    halfway = files_of(split)
    run(train_timeseries, [*TINY_SERIES, "--steps", "4", "--resume", "--out", str(split)], monkeypatch,
        capsys)
    want, got = files_of(whole), files_of(split)
    assert set(got) == set(want) and any(k.startswith("optim/") for k in got)
    for key, value in want.items():
        assert np.array_equal(got[key], value), key
    assert not np.array_equal(halfway["layers.0.mixer.in_proj.weight"], got["layers.0.mixer.in_proj.weight"])


class _Crash(BaseException):
    """The process dying at one instant (not an Exception: nothing may catch it)."""


def test_a_crash_at_any_file_replacement_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, capsys):
    """Steps 4 with checkpoints at 2 and 4 publish four files: trainer@2, model@2, trainer@4, model@4.
    Dying instead of publishing any one of them, then resuming, ends in the files of a run that never
    crashed (or, before the first, finds no checkpoint); no temporary file is left behind."""
    argv = [*TINY_SERIES, "--steps", "4"]
    run(train_timeseries, [*argv, "--out", str(tmp_path / "whole")], monkeypatch, capsys)
    want = files_of(tmp_path / "whole")
    replace = os.replace
    for crash_at in (1, 2, 3, 4):
        out, calls = tmp_path / f"crash{crash_at}", []

        def dying_replace(src, dst, crash_at=crash_at, calls=calls):
            calls.append(dst)
            if len(calls) == crash_at:
                raise _Crash
            replace(src, dst)

        monkeypatch.setattr(os, "replace", dying_replace)
        with pytest.raises(_Crash):
            run(train_timeseries, [*argv, "--out", str(out)], monkeypatch, capsys)
        monkeypatch.setattr(os, "replace", replace)
        assert [Path(p).name for p in calls][-1] == ["trainer", "model"][(crash_at - 1) % 2] + ".safetensors"
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
        if crash_at == 1:
            with pytest.raises(SystemExit, match="no checkpoint"):
                run(train_timeseries, [*argv, "--resume", "--out", str(out)], monkeypatch, capsys)
            continue
        run(train_timeseries, [*argv, "--resume", "--out", str(out)], monkeypatch, capsys)
        got = files_of(out)
        assert set(got) == set(want), crash_at
        for key, value in want.items():
            assert np.array_equal(got[key], value), (crash_at, key)


def test_resume_refuses_a_trainer_file_without_the_model_with_a_clear_error(tmp_path, monkeypatch, capsys):
    run(train_timeseries, [*TINY_SERIES, "--steps", "2", "--out", str(tmp_path)], monkeypatch, capsys)
    arrays, meta = load_arrays(tmp_path / "trainer.safetensors")
    old = {k: v for k, v in arrays.items() if not k.startswith("model/")}  # the layout of older versions
    save_arrays(tmp_path / "trainer.safetensors", old, metadata={k: v for k, v in meta.items() if k != "config"})
    with pytest.raises(CheckpointError, match=r"trainer.safetensors: no 'config' metadata"):
        run(train_timeseries, [*TINY_SERIES, "--steps", "4", "--resume", "--out", str(tmp_path)], monkeypatch,
            capsys)
    save_arrays(tmp_path / "trainer.safetensors", old, metadata=meta)
    with pytest.raises(CheckpointError, match=r"trainer.safetensors: tensor 'model/.*' is missing"):
        run(train_timeseries, [*TINY_SERIES, "--steps", "4", "--resume", "--out", str(tmp_path)], monkeypatch,
            capsys)


def test_resume_refuses_a_missing_or_different_checkpoint(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="no checkpoint"):
        run(train_timeseries, [*TINY_SERIES, "--steps", "2", "--resume", "--out", str(tmp_path)], monkeypatch,
            capsys)
    run(train_timeseries, [*TINY_SERIES, "--steps", "2", "--out", str(tmp_path)], monkeypatch, capsys)
    with pytest.raises(SystemExit, match="differs from these flags in d_state"):
        run(train_timeseries, [*TINY_SERIES, "--d-state", "4", "--steps", "4", "--resume", "--out",
                               str(tmp_path)], monkeypatch, capsys)
    with pytest.raises(SystemExit, match=r"tensor 'param/head.bias' \(12,\) of .* does not fit"):
        run(train_timeseries, [*TINY_SERIES, "--features", "7", "--steps", "4", "--resume", "--out",
                               str(tmp_path)], monkeypatch, capsys)


def test_selective_copy_trains_both_models_and_the_lti_rows_stay_zero(tmp_path, monkeypatch, capsys):
    argv = [*TINY, "--steps", "2", "--tokens", "2", "--length", "6", "--out", str(tmp_path)]
    result = run(train_selective_copy, argv, monkeypatch, capsys)
    assert {"accuracy", "lti_accuracy", "beats_baseline"} <= set(result)
    assert (tmp_path / "accuracy.png").exists()
    selective, lti = files_of(tmp_path / "selective"), files_of(tmp_path / "lti")
    d_inner = 32  # expand 2 x d_model 16
    for files, frozen in ((selective, False), (lti, True)):
        w = files["layers.0.mixer.in_proj.weight"]
        assert bool(np.all(w[2 * d_inner:] == 0)) is frozen
        assert np.any(w[:2 * d_inner] != 0)


def test_selective_copy_without_baseline_trains_the_selective_model_only(tmp_path, monkeypatch, capsys):
    argv = [*TINY, "--steps", "2", "--tokens", "2", "--length", "6", "--no-baseline", "--out", str(tmp_path)]
    result = run(train_selective_copy, argv, monkeypatch, capsys)
    assert result["lti_accuracy"] is None and result["beats_baseline"] is False
    assert 0.0 <= result["accuracy"] <= 1.0
    assert (tmp_path / "selective" / "model.safetensors").exists() and not (tmp_path / "lti").exists()


def test_make_lti_keeps_delta_b_and_c_input_independent_through_training():
    args = train_selective_copy.arguments(["--quick", "--d-model", "16"])
    model = train_selective_copy.build(args, torch.device("cpu"), lti=True)
    before = model.layers[0].mixer.in_proj.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    ids = torch.randint(0, args.vocab + 2, (2, 12))
    model(ids).logsumexp(-1).sum().backward()
    opt.step()
    after = model.layers[0].mixer.in_proj.weight.detach()
    rows = 2 * model.config.d_inner
    assert torch.all(after[rows:] == 0) and not torch.equal(after[:rows], before[:rows])


def test_user_sequences_are_read_from_npy_csv_and_parquet(tmp_path, monkeypatch, capsys):
    pd = pytest.importorskip("pandas")
    table = np.random.default_rng(0).standard_normal((45, 3)).astype(np.float32)
    np.save(tmp_path / "t.npy", table)
    frame = pd.DataFrame(table, columns=["a", "b", "c"]).assign(name="x")  # a text column is skipped
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / "t.parquet")
    for name in ("t.npy", "t.csv", "t.parquet"):
        got = train_timeseries.read_sequences(tmp_path / name, 10)
        assert got.shape == (4, 10, 3) and got.dtype == np.float32
        np.testing.assert_allclose(got[1], table[10:20], rtol=1e-6)
    with pytest.raises(SystemExit, match="at least 2 sequences"):
        train_timeseries.read_sequences(tmp_path / "t.npy", 30)
    argv = [*TINY, "--seq-len", "10", "--data", str(tmp_path / "t.csv"), "--steps", "2", "--out",
            str(tmp_path / "run")]
    result = run(train_timeseries, argv, monkeypatch, capsys)
    assert result["steps"] == 2


def test_timeseries_model_beats_the_last_value_baseline_clearly(tmp_path, monkeypatch, capsys):
    result = run(train_timeseries, ["--quick", "--steps", "100", "--out", str(tmp_path)], monkeypatch, capsys)
    assert result["beats_baseline"] is True
    assert result["val_mse"] < 0.5 * result["last_value_mse"] and result["val_mse"] < result["zero_mse"]


@pytest.fixture
def one_thread():
    """torch on one thread, as README's numbers were measured (OMP_NUM_THREADS=1): the reductions
    then round the same way on every machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_selective_copy_quick_reaches_the_readme_accuracy(tmp_path, monkeypatch, capsys, one_thread):
    result = run(train_selective_copy, ["--quick", "--out", str(tmp_path)], monkeypatch, capsys)
    assert result["beats_baseline"] is True
    assert result["accuracy"] >= 0.95
    assert result["steps"] == train_selective_copy.QUICK["steps"]


@pytest.mark.slow
def test_selective_copy_quick_learns_on_the_seed_with_the_least_margin(tmp_path, monkeypatch, capsys, one_thread):
    """README's seeds 0 to 3 all reach >= 0.95; seed 3 (0.9995 on the Intel VM, as seed 0) is the lowest there."""
    result = run(train_selective_copy, ["--quick", "--no-baseline", "--seed", "3", "--out", str(tmp_path)],
                 monkeypatch, capsys)
    assert result["accuracy"] >= 0.95


@pytest.mark.slow
def test_timeseries_quick_beats_both_baselines(tmp_path, monkeypatch, capsys, one_thread):
    result = run(train_timeseries, ["--quick", "--out", str(tmp_path)], monkeypatch, capsys)
    assert result["beats_baseline"] is True
    assert result["val_mse"] < 0.5 * result["last_value_mse"] and result["val_mse"] < 0.6 * result["zero_mse"]
    assert result["steps"] == train_timeseries.QUICK["steps"]
