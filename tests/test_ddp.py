"""Data parallel: a 2-process torchrun job (DDP, gloo on CPU) of an unchanged example script ends
with the parameters a single process reaches on the same global batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from portable_ssm import init_params  # noqa: E402
from portable_ssm.io import load_arrays, load_params  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_timeseries.py"
FLAGS = ["--steps", "3", "--batch-size", "8", "--d-model", "16", "--n-layer", "2", "--d-state", "8",
         "--headdim", "8", "--features", "12", "--seq-len", "16", "--eval-every", "3", "--ckpt-every", "3",
         "--device", "cpu"]


def _train(out: Path, launcher: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, str(SCRIPT), *FLAGS, "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _weights(out: Path) -> dict[str, np.ndarray]:
    params, _ = load_params(out / "model.safetensors")
    arrays, _ = load_arrays(out / "trainer.safetensors")
    return {**params, **{k: v for k, v in arrays.items() if k.startswith("param/")}}


def test_two_process_ddp_run_equals_one_process_on_the_same_global_batch(tmp_path):
    single = _train(tmp_path / "single", [sys.executable])
    ddp = _train(tmp_path / "ddp", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc_per_node=2"])
    assert single["processes"] == 1 and ddp["processes"] == 2
    one, two = _weights(tmp_path / "single"), _weights(tmp_path / "ddp")
    assert set(one) == set(two) and "param/head.weight" in one
    for key, value in one.items():
        np.testing.assert_allclose(two[key], value, rtol=2e-5, atol=2e-6, err_msg=key)
    trained, config = load_params(tmp_path / "single" / "model.safetensors")
    start = init_params(config, seed=0)["layers.0.mixer.in_proj.weight"]
    moved = trained["layers.0.mixer.in_proj.weight"]
    assert not np.allclose(moved, start), "training did not move the weights"
    assert abs(ddp["val_mse"] - single["val_mse"]) <= 1e-5 * abs(single["val_mse"])
