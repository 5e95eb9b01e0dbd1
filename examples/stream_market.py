"""Replays a DBN file as a live feed through a trained market model, one bar at a time, with latency.

``MarketModel.load`` reads what ``train_market.py`` left in ``--run`` (model.safetensors,
head.safetensors, market.json) and ``model.stream()`` gives a ``MarketStream``: it keeps the
Mamba-2 state and the last bar, and turns each new bar into one prediction without recomputing a
window; its predictions equal ``model.predict(bars)`` over the same bars. ``--latency`` times the
old and new paths for one seed-sized instrument (``benchmarks/market_bench.py``, which also times
10 to 1000 instruments and DBN reading).

    python examples/train_market.py --quick --out runs/market
    python examples/stream_market.py --run runs/market --limit 20
    python examples/stream_market.py --latency
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from portable_ssm.market import Bars, MarketModel, MarketStream, read_bars

FIELDS = ("open", "high", "low", "close", "volume")


def replay(model: MarketModel, stream: MarketStream, bars: Bars, limit: int | None) -> list[float]:
    """Feeds the bars one by one; prints each prediction and its latency; returns the latencies (µs)."""
    latencies, ids = [], np.array(stream.instruments[:1])
    for i in range(len(bars)):
        started = time.perf_counter_ns()
        out = stream.update(ids, *(getattr(bars, name)[i:i + 1] for name in FIELDS))[0]
        latencies.append((time.perf_counter_ns() - started) / 1e3)
        if np.isnan(out) or (limit is not None and i > limit):
            continue
        value = float(model.to_target(out))
        text = (f"next {model.horizon}-bar return {value:+.3e}" if model.target == "return"
                else f"P(up over {model.horizon} bars) {value:.3f}")
        ts = np.datetime64(int(bars.ts_event[i]), "ns")
        print(f"{ts}  close {bars.close[i]:.4f}  {text}  ({latencies[-1]:.0f} µs)")
    return latencies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/market", help="the directory train_market.py wrote")
    p.add_argument("--data", help="the DBN file to replay (default: the run's own data file)")
    p.add_argument("--backend", choices=("numpy", "torch"), default="numpy", help="where the predictor runs")
    p.add_argument("--limit", type=int, help="print only the first LIMIT predictions (all are still made)")
    p.add_argument("--latency", action="store_true", help="time a seed-sized model's update, old and new paths")
    p.add_argument("--bars", type=int, default=1000, help="--latency: timed updates per path")
    p.add_argument("--warmup", type=int, default=50, help="--latency: untimed updates first")
    args = p.parse_args()
    if args.latency:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        import market_bench

        rows = market_bench.latency([1], {1: args.bars}, args.warmup)
        print(json.dumps({"example": "stream_market_latency", "rows": rows}))
        return
    model = MarketModel.load(Path(args.run), backend=args.backend)
    instrument = model.instruments[0] if model.instruments else None
    bars = read_bars(args.data or model.info["data"], instrument_id=instrument)
    times = replay(model, model.stream([0 if instrument is None else instrument]), bars, args.limit)
    print(json.dumps({"example": "stream_market", "bars": len(bars), "backend": args.backend,
                      "median_us": round(float(np.median(times)), 1),
                      "p99_us": round(float(np.percentile(times, 99)), 1)}))


if __name__ == "__main__":
    main()
