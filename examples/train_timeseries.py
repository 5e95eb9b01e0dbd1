"""Next-step regression on multivariate sequences ``[60, 256]`` with Mamba-2 (the original user's job).

A sample is ``--seq-len`` time steps of F features (e.g. asset returns). The model reads steps
0..t and predicts step t+1; the loss is the mean squared error on standardised features. Baselines
on the same validation set: the naive last value (predict x_t for x_{t+1}), and the mean (zero).

Data. By default a synthetic market with learnable structure: 8 latent factors follow an
autoregression whose coefficient (momentum +0.6 or reversal -0.4) and volatility switch with a
persistent two-state regime; each asset loads on one factor with a lag of 0 to 3 steps, plus its own
noise. Lagging assets follow leaders, the regime sets how factors continue. ``--data FILE`` reads
your sequences instead: ``.npy`` holding ``[N, L, F]`` sequences or a ``[T, F]`` table, ``.csv`` or
``.parquet`` tables (rows are time steps, numeric columns are features). Tables are cut into
windows of ``--seq-len`` steps; the first 90% train and the last 10% validate (time order kept),
standardised with the training statistics.

    python examples/train_timeseries.py --quick
    torchrun --nproc_per_node=2 examples/train_timeseries.py --quick
    python examples/train_timeseries.py --data prices.parquet --steps 5000 --out runs/prices
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from common import Task, base_parser, last, parse, report, setup_distributed, teardown, train
from portable_ssm.backends.torch import Mamba2Module
from torch import nn

from portable_ssm import Mamba2Config

DEFAULTS = dict(steps=2000, batch_size=32, lr=2e-3, d_model=128, n_layer=4, d_state=64, eval_every=100,
                ckpt_every=500, out="runs/timeseries", headdim=16)
QUICK = dict(steps=300, batch_size=16, lr=3e-3, d_model=64, n_layer=2, d_state=16, eval_every=50,
             ckpt_every=150)
FACTORS, VAL_SEQUENCES = 8, 256


def market(rng: np.random.Generator, n: int, length: int, features: int) -> np.ndarray:
    """``n`` synthetic sequences ``[n, length, features]`` of regime-switching, lead-lag returns."""
    coef, vol = np.array([0.6, -0.4]), np.array([0.6, 1.0])
    lag = (np.arange(features) // FACTORS) % 4  # steps each asset trails its factor
    factor = np.arange(features) % FACTORS
    fixed = np.random.default_rng(12345)  # the market's structure is the same for every sample
    beta = fixed.uniform(0.5, 1.5, features) * np.where(fixed.random(features) < 0.3, -1.0, 1.0)
    steps = length + 3 + 8  # 3 for the longest lag, 8 to forget the zero start
    regime = np.empty((n, steps), np.int64)
    regime[:, 0] = rng.integers(0, 2, n)
    flips = rng.random((n, steps)) < 0.05
    shocks = rng.standard_normal((n, steps, FACTORS))
    f = np.zeros((n, steps, FACTORS))
    for t in range(1, steps):
        regime[:, t] = np.where(flips[:, t], 1 - regime[:, t - 1], regime[:, t - 1])
        f[:, t] = coef[regime[:, t], None] * f[:, t - 1] + vol[regime[:, t], None] * shocks[:, t]
    when = np.arange(steps - length, steps)[:, None] - lag[None, :]  # [length, features]
    returns = beta * f[:, when, factor] + 0.5 * rng.standard_normal((n, length, features))
    return returns.astype(np.float32)


def read_sequences(path: Path, length: int) -> np.ndarray:
    """``[N, L, F]`` float32 sequences from a .npy / .csv / .parquet file (tables cut into windows)."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        data = np.load(path, allow_pickle=False)
    elif suffix in (".csv", ".parquet", ".pq"):
        import pandas as pd

        table = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        data = table.select_dtypes("number").to_numpy()
    else:
        raise SystemExit(f"--data: expected a .npy, .csv or .parquet file, got {path}")
    if data.ndim == 2:
        windows = data.shape[0] // length
        data = data[:windows * length].reshape(windows, length, data.shape[1])  # [T, F] -> [N, L, F]
    if data.ndim != 3 or data.shape[0] < 2 or data.shape[1] < 2:
        raise SystemExit(f"--data: expected at least 2 sequences [N, L, F] (or a [T, F] table with "
                         f"T >= 2*{length}), got shape {data.shape}")
    if not np.isfinite(data).all():
        raise SystemExit(f"--data: {path} holds NaN or infinite values")
    return data.astype(np.float32)


class Regressor(nn.Module):
    """features -> d_model (linear) -> Mamba-2 backbone -> features (linear): ``[b, l, F] -> [b, l, F]``."""

    def __init__(self, features: int, core: Mamba2Module) -> None:
        super().__init__()
        self.inp = nn.Linear(features, core.config.d_model)
        self.core = core
        self.head = nn.Linear(core.config.d_model, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.core(self.inp(x)))


def data_source(args: argparse.Namespace) -> tuple[Callable[[int], np.ndarray], np.ndarray]:
    """``(batch(step), validation [N, L, F])``: synthetic or from ``--data``, standardised."""
    if args.data is None:
        def batch(step: int) -> np.ndarray:
            rng = np.random.default_rng([args.seed, 1, step])
            return market(rng, args.batch_size, args.seq_len, args.features)

        val = market(np.random.default_rng([args.seed, 0]), VAL_SEQUENCES, args.seq_len, args.features)
        return batch, val
    data = read_sequences(Path(args.data), args.seq_len)
    split = min(len(data) - 1, max(1, int(0.9 * len(data))))  # both sides keep a sequence
    train_set, val = data[:split], data[split:]
    mean, std = train_set.mean(axis=(0, 1)), train_set.std(axis=(0, 1)) + 1e-8
    train_set, val = (train_set - mean) / std, (val - mean) / std

    def batch(step: int) -> np.ndarray:
        rows = np.random.default_rng([args.seed, 1, step]).integers(0, len(train_set), args.batch_size)
        return train_set[rows]

    return batch, val


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", help="your sequences: .npy [N, L, F] or [T, F], .csv / .parquet [T, F]")
    p.add_argument("--seq-len", type=int, default=60, help="time steps per sequence")
    p.add_argument("--features", type=int, default=256, help="features of the synthetic market")
    return parse(p, DEFAULTS, QUICK, argv)


def main() -> None:
    args = arguments()
    started = time.time()
    dist = setup_distributed(args.device)
    batch_np, val_np = data_source(args)
    val = torch.from_numpy(val_np).to(dist.device)
    config = Mamba2Config(d_model=args.d_model, n_layer=args.n_layer, d_state=args.d_state,
                          headdim=args.headdim)
    torch.manual_seed(args.seed)
    core = Mamba2Module(config, seed=args.seed, device=dist.device, checkpoint_blocks=args.checkpoint_blocks)
    model = Regressor(val_np.shape[-1], core).to(dist.device)
    last_value = float(((val[:, :-1] - val[:, 1:]) ** 2).mean())
    zero = float((val[:, 1:] ** 2).mean())

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(batch_np(step))
        return x[:, :-1], x[:, 1:]  # inputs steps 0..L-2, targets steps 1..L-1

    def loss(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ((net(inputs).float() - targets) ** 2).mean()

    def evaluate(net: nn.Module) -> dict[str, float]:
        return {"val_loss": float(loss(net, val[:, :-1], val[:, 1:])), "last_value_loss": last_value,
                "zero_loss": zero}

    task = Task("timeseries", model, core, batch, loss, evaluate)
    history = train(task, args, dist, Path(args.out))
    mse = last(history, "val_loss")
    report(dist, {"example": "timeseries", "val_mse": mse, "last_value_mse": last_value, "zero_mse": zero,
                  "mse_vs_last_value": mse / last_value, "steps": args.steps, "processes": dist.world,
                  "seconds": round(time.time() - started, 1), "beats_baseline": bool(mse < 0.8 * last_value)})
    teardown(dist)


if __name__ == "__main__":
    main()
