"""Replays a DBN file as a live feed through a trained market model, one bar at a time, with latency.

The predictor (``portable_ssm.market.StreamPredictor``) keeps the Mamba-2 state and runs
``portable_ssm.step`` once per bar: no window is recomputed, and its predictions equal the batch
forward over the same bars. It reads what ``train_market.py`` left in ``--run``: ``model.safetensors``
(the backbone), ``trainer.safetensors`` (the ``inp`` / ``head`` maps) and ``market.json``
(normaliser, target). ``--latency`` instead times updates of a seed-sized model (d_model 256,
2 layers, random weights) on NumPy and PyTorch and prints the median and p99 in microseconds.

    python examples/train_market.py --quick --out runs/market
    python examples/stream_market.py --run runs/market --limit 20
    python examples/stream_market.py --latency
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from portable_ssm.market import FEATURES, Bars, Normaliser, StreamPredictor, read_bars, synthetic_bars

from portable_ssm import Mamba2Config, init_params, load_arrays, load_params, to_backend

HEAD_PREFIX = "param/"


def load_predictor(run: Path, backend: str) -> tuple[StreamPredictor, dict]:
    """The trained model in ``run`` as a :class:`StreamPredictor` on ``backend``, and its market.json."""
    info = json.loads((run / "market.json").read_text())
    params, config = load_params(run / "model.safetensors", backend=backend)
    arrays, _ = load_arrays(run / "trainer.safetensors", backend=backend)
    head = {k[len(HEAD_PREFIX):]: v for k, v in arrays.items() if k.startswith(HEAD_PREFIX)}
    normaliser = Normaliser(mean=np.array(info["mean"]), std=np.array(info["std"]))
    return StreamPredictor(head, params, config=config, normaliser=normaliser), info


def replay(predictor: StreamPredictor, bars: Bars, info: dict, limit: int | None) -> list[float]:
    """Feeds the bars one by one; prints each prediction and its latency; returns the latencies (µs)."""
    latencies = []
    for i in range(len(bars)):
        started = time.perf_counter_ns()
        out = predictor.update(bars.open[i], bars.high[i], bars.low[i], bars.close[i], bars.volume[i])
        latencies.append((time.perf_counter_ns() - started) / 1e3)
        if out is None or (limit is not None and i > limit):
            continue
        value = (f"next {info['horizon']}-bar return {out * info['target_scale']:+.3e}"
                 if info["target"] == "return" else f"P(up over {info['horizon']} bars) {1 / (1 + math.exp(-out)):.3f}")
        ts = np.datetime64(int(bars.ts_event[i]), "ns")
        print(f"{ts}  close {bars.close[i]:.4f}  {value}  ({latencies[-1]:.0f} µs)")
    return latencies


def seed_sized(backend: str, seed: int) -> StreamPredictor:
    """A random d_model 256, 2-layer predictor (the old system's model size) on ``backend``."""
    config = Mamba2Config(d_model=256, n_layer=2)
    rng = np.random.default_rng(seed)
    head = {"inp.weight": rng.standard_normal((256, len(FEATURES))) / math.sqrt(len(FEATURES)),
            "inp.bias": np.zeros(256), "head.weight": rng.standard_normal((1, 256)) / 16, "head.bias": np.zeros(1)}
    head = {k: to_backend(v.astype(np.float32), backend) for k, v in head.items()}
    normaliser = Normaliser(mean=np.zeros(len(FEATURES)), std=np.ones(len(FEATURES)))
    return StreamPredictor(head, init_params(config, seed=seed, backend=backend), config=config,
                           normaliser=normaliser)


def latency(bars: int, warmup: int) -> None:
    """Median and p99 microseconds per update of the seed-sized model on NumPy and PyTorch (CPU)."""
    import os

    import torch

    torch.set_num_threads(1)  # one update is a few small matmuls: threads only add overhead
    feed = synthetic_bars("planted", bars + warmup, seed=0)
    results: dict = {"load_average_at_start": [round(v, 1) for v in os.getloadavg()], "torch_threads": 1}
    for backend in ("numpy", "torch"):
        predictor = seed_sized(backend, seed=0)
        times = replay(predictor, feed, {}, limit=-1)[warmup:]
        results[backend] = {"median_us": round(float(np.median(times)), 1),
                            "p99_us": round(float(np.percentile(times, 99)), 1), "updates": len(times)}
        print(f"{backend}: median {results[backend]['median_us']} µs, p99 {results[backend]['p99_us']} µs "
              f"per update over {len(times)} bars (d_model 256, 2 layers, float32)")
    results["load_average_at_end"] = [round(v, 1) for v in os.getloadavg()]
    print(json.dumps({"example": "stream_market_latency", **results}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/market", help="the directory train_market.py wrote")
    p.add_argument("--data", help="the DBN file to replay (default: the run's own data file)")
    p.add_argument("--backend", choices=("numpy", "torch"), default="numpy", help="where the predictor runs")
    p.add_argument("--limit", type=int, help="print only the first LIMIT predictions (all are still made)")
    p.add_argument("--latency", action="store_true", help="time the seed-sized model on NumPy and PyTorch")
    p.add_argument("--bars", type=int, default=2000, help="--latency: timed updates per backend")
    p.add_argument("--warmup", type=int, default=100, help="--latency: untimed updates first")
    args = p.parse_args()
    if args.latency:
        latency(args.bars, args.warmup)
        return
    predictor, info = load_predictor(Path(args.run), args.backend)
    bars = read_bars(args.data or info["data"])
    times = replay(predictor, bars, info, args.limit)
    print(json.dumps({"example": "stream_market", "bars": len(bars), "backend": args.backend,
                      "median_us": round(float(np.median(times)), 1),
                      "p99_us": round(float(np.percentile(times, 99)), 1)}))


if __name__ == "__main__":
    main()
