"""The market examples: a csv with a date and a volume column trains end to end, the planted component
is found and beats every baseline, a random walk is reported as not beaten, and streaming replays
the run's DBN file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("databento_dbn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
pd = pytest.importorskip("pandas")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import stream_market  # noqa: E402
import train_market  # noqa: E402
from portable_ssm.market import synthetic_bars  # noqa: E402

TINY = ["--d-model", "16", "--n-layer", "1", "--d-state", "8", "--headdim", "8", "--batch-size", "4",
        "--eval-every", "2", "--ckpt-every", "2", "--seq-len", "10", "--steps", "2"]


def run(script, argv, monkeypatch, capsys) -> tuple[dict, str]:
    """Runs an example's main() in this process; returns its last stdout line as JSON, and stderr."""
    monkeypatch.setattr(sys, "argv", [script.__name__, *argv])
    script.main()
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_a_price_table_with_date_and_volume_columns_trains_on_the_named_columns(tmp_path, monkeypatch, capsys):
    bars = synthetic_bars("random-walk", 400, seed=0)
    dates = pd.date_range("2020-01-01", periods=len(bars), freq="D")
    pd.DataFrame({"date": dates.strftime("%Y-%m-%d"), "close": bars.close, "volume": bars.volume.astype(int)}
                 ).to_csv(tmp_path / "prices.csv", index=False)
    argv = [*TINY, "--data", str(tmp_path / "prices.csv"), "--time-col", "date", "--close-col", "close",
            "--volume-col", "volume", "--target", "direction", "--horizon", "3", "--out", str(tmp_path / "run")]
    result, _ = run(train_market, argv, monkeypatch, capsys)
    assert result["bars"] == 400 and result["metric"] == "error_rate" and isinstance(result["beats_baseline"], bool)
    assert set(result["baselines"]) == {"majority", "last_sign", "ar5_sign"}
    assert result["train_windows"] > 300  # overlapping windows (stride 1), not 400 // 10
    for name in ("model.safetensors", "trainer.safetensors", "head.safetensors", "curves.png", "validation.png",
                 "market.json"):
        assert (tmp_path / "run" / name).stat().st_size > 0, name


def test_a_table_without_named_columns_is_refused(tmp_path, monkeypatch):
    (tmp_path / "p.csv").write_text("date,close\n2020-01-01,1\n")
    monkeypatch.setattr(sys, "argv", ["train_market", "--data", str(tmp_path / "p.csv"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--time-col and --close-col"):
        train_market.main()


@pytest.mark.slow
def test_quick_run_beats_every_baseline_on_the_planted_volume_regime(tmp_path, monkeypatch, capsys):
    result, err = run(train_market, ["--quick", "--seed", "0", "--out", str(tmp_path)], monkeypatch, capsys)
    assert result["beats_baseline"] is True, result
    assert min(result["z_vs_baselines"].values()) > 2
    assert result["val_loss"] < min(result["baselines"].values())
    assert "beats every baseline" in err


@pytest.mark.slow
def test_quick_run_on_a_random_walk_says_it_does_not_beat_the_baselines(tmp_path, monkeypatch, capsys):
    argv = ["--quick", "--seed", "0", "--synthetic", "random-walk", "--out", str(tmp_path)]
    result, err = run(train_market, argv, monkeypatch, capsys)
    assert result["beats_baseline"] is False, result
    assert "does NOT beat the baselines" in err


def test_stream_replays_the_runs_dbn_file_bar_by_bar(tmp_path, monkeypatch, capsys):
    run(train_market, [*TINY, "--bars", "300", "--out", str(tmp_path)], monkeypatch, capsys)
    monkeypatch.setattr(sys, "argv", ["stream_market", "--run", str(tmp_path), "--limit", "2", "--backend", "torch"])
    stream_market.main()
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bars"] == 300 and result["p99_us"] >= result["median_us"] > 0
    assert len(lines) == 3 and all("next 1-bar return" in line and "µs" in line for line in lines[:2]), lines
    assert np.isfinite(float(lines[0].split("return ")[1].split()[0]))


def _desk_file(path: Path, instruments: tuple[int, ...], n: int) -> None:
    """One OHLCV-1m DBN file of several instruments' bars interleaved in time (each a random walk)."""
    import databento_dbn as dbn
    from portable_ssm.market import ohlcv_records

    records = np.concatenate([ohlcv_records(synthetic_bars("random-walk", n, seed=i), instrument_id=i)
                              for i in instruments])
    records = records[np.argsort(records["ts_event"], kind="stable")]
    meta = dbn.Metadata(dataset="SYNTHETIC", start=int(records["ts_event"][0]), stype_in=dbn.SType.RAW_SYMBOL,
                        stype_out=dbn.SType.INSTRUMENT_ID, schema=dbn.Schema.from_str("ohlcv-1m"), symbols=["SYN"])
    path.write_bytes(meta.encode() + records.tobytes())


@pytest.mark.parametrize("choose", [["--all-instruments"], ["--instrument-id", "11", "12", "13"]])
def test_a_quick_run_over_three_instruments_saves_a_model_that_records_them(tmp_path, monkeypatch, capsys, choose):
    from portable_ssm.market import MarketModel

    _desk_file(tmp_path / "desk.dbn", (11, 12, 13), 200)
    argv = ["--quick", *TINY, *choose, "--data", str(tmp_path / "desk.dbn"), "--out", str(tmp_path / "run")]
    result, _ = run(train_market, argv, monkeypatch, capsys)
    assert result["instruments"] == [11, 12, 13] and result["bars"] == 600
    assert result["train_windows"] > 3 * 120  # every instrument's windows, not one's
    model = MarketModel.load(tmp_path / "run", backend="numpy")
    assert model.instruments == (11, 12, 13)
    assert set(model.info["boundary"]) == {"11", "12", "13"}


def test_several_instruments_need_a_dbn_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_market", "--all-instruments", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs --data with a DBN file"):
        train_market.main()
