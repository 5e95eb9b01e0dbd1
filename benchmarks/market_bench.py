"""Market data at a desk's scale: streaming latency per bar (old and new paths, 1..1000 instruments) and
DBN reading speed and peak memory on generated 10^7-record files. Prints Markdown tables and a JSON line.

    python benchmarks/market_bench.py                      # both parts
    python benchmarks/market_bench.py --only latency --instruments 1 10
    python benchmarks/market_bench.py --only latency --weights int8   # one storage kind of the projections
    python benchmarks/market_bench.py --only latency --backends jax --weights float32   # JAX's rows
    python benchmarks/market_bench.py --only reading --records 1000000
    python benchmarks/market_bench.py --only breakdown      # where one instrument's bar goes (per --weights, --reps)

Latency: two model shapes (:data:`SHAPES`, float32, random weights), torch limited to one thread,
numpy's BLAS to one thread; a "bar" is one update of every instrument. The seed shape is the one of
the bug reports this project started from (/work/shared/seeds: a Candle Mamba with d_model 256,
``[16, 16]`` SSM matrices, i.e. d_state 16, and ``[8, 60, 256] -> [8, 60, 1024] (d_model -> d_inner)``,
i.e. expand 4); they name no heads (their scan is not Mamba-2's), so headdim is Mamba-2's default 64
(16 heads), and 2 layers is this benchmark's choice. Its weights are 6.1 MiB, its state 130 KiB per
instrument. The second shape is the one the tables before 2026-12-06 18:20 UTC called the seed shape:
``Mamba2Config(d_model=256, n_layer=2)``, i.e. d_state 128 and expand 2 (3.7 MiB of weights, 520 KiB
of state per instrument). Paths: ``StreamPredictor`` (what a user had before issue 46: one
instrument, features rebuilt from Bars, ``portable_ssm.step``); ``MarketStream, portable_ssm.step``
(``fast=False``: that same reference step, for all N rows in one batched call, the old path at
every N; the per-row native step that the tables of 2026-12-06 18:22 UTC call "per row (old)" was
removed from MarketStream); ``MarketStream (new)``: the whole bar, after the checks, in one call of
``portable_ssm.backends.numpy.rows.MarketBar`` (features, inputs, then every row through
``RowsStep``; torch: on zero-copy NumPy views of its tensors), the products through the row kernel
below ``GEMM_ROWS`` rows and OpenBLAS's sgemm from there; with ``--both-products`` also each of the
two at every N. ``--weights`` (default all three) also times ``MarketStream (new)`` of the model
whose backbone projections are stored as int8 or bfloat16 (``MarketModel.quantize``; the row kernel
at every N, sgemm being float32 only; int8 through AVX-512 VNNI where the CPU has it and
``PORTABLE_SSM_CPU_ISA`` is not ``avx2``, which the JSON line's ``int8_vnni`` says); its ``weight_mib``
column is the bytes of the backbone a bar reads (``portable_ssm.params_nbytes``). ``--backends jax``
(not in the default): ``MarketStream (new)`` is ``portable_ssm.step`` between the maps under
``jax.jit``, the old paths op by op. Reading: the files
are written and synced, then each case runs in two fresh processes one after the other and reports
the second's records/s and peak RSS (VmHWM) above the RSS after imports, and the first's seconds
(``first_seconds``: on a VM the first process to touch the output's memory after the files were
written ran up to four times slower).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

FIELDS = ("open", "high", "low", "close", "volume")
#: The latency tables' model shapes (Mamba2Config keyword arguments); the module docstring says why.
#: The backbone projections' storage kinds the latency table times (``MarketModel.quantize``).
WEIGHTS = ("float32", "int8", "bfloat16")
SHAPES = {"seed (d_state 16, expand 4)": dict(d_model=256, n_layer=2, d_state=16, expand=4, headdim=64),
          "d_state 128, expand 2": dict(d_model=256, n_layer=2, d_state=128, expand=2, headdim=64)}


def _seed_model(backend: str, shape: str = next(iter(SHAPES)), weights: str = "float32"):
    from portable_ssm.market import FEATURES, MarketModel, Normaliser

    from portable_ssm import Mamba2Config, init_params, to_backend

    config = Mamba2Config(**SHAPES[shape])
    rng = np.random.default_rng(0)
    head = {"inp.weight": rng.standard_normal((256, len(FEATURES))) / 3, "inp.bias": np.zeros(256),
            "head.weight": rng.standard_normal((1, 256)) / 16, "head.bias": np.zeros(1)}
    head = {k: to_backend(v.astype(np.float32), backend) for k, v in head.items()}
    model = MarketModel(config=config, params=init_params(config, seed=0, backend=backend), head=head,
                        normaliser=Normaliser(mean=np.zeros(len(FEATURES)), std=np.ones(len(FEATURES))))
    return model.quantize(weights)


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_us": round(float(np.median(times)), 1), "p99_us": round(float(np.percentile(times, 99)), 1),
            "bars": len(times)}


def _time_old(model, bars, warmup: int) -> dict[str, float]:
    from portable_ssm.market import StreamPredictor

    predictor = StreamPredictor(model.head, model.params, config=model.config, normaliser=model.normaliser)
    times = []
    for i in range(len(bars)):
        started = time.perf_counter_ns()
        predictor.update(*(float(getattr(bars, f)[i]) for f in FIELDS))
        times.append((time.perf_counter_ns() - started) / 1e3)
    return _summary(times[warmup:])


def _stream(model, n: int, path: str):
    """``model.stream`` of n instruments on ``path``: "reference" (``fast=False``: portable_ssm.step),
    "new" (the default), "row kernel" or "sgemm" (RowsStep with only that product)."""
    from portable_ssm.backends.numpy import rows

    stream = model.stream(list(range(n)), fast=path != "reference")
    if path in ("row kernel", "sgemm"):
        step = rows.RowsStep(stream._bar.step.model, gemm_rows=0 if path == "row kernel" else 1)
        stream._bar = rows.MarketBar(step, *stream._bar.head)
    return stream


def _time_new(model, bars, n: int, warmup: int, path: str) -> dict[str, float]:
    """``MarketStream``'s bars on ``path`` (:func:`_stream`)."""
    stream = _stream(model, n, path)
    ids = np.arange(n)
    rng = np.random.default_rng(n)
    jitter = np.exp(1e-4 * rng.standard_normal((len(bars), n)))  # [T, n]: each instrument its own prices
    columns = {f: getattr(bars, f)[:, None] * (jitter if f != "volume" else np.ones(n)) for f in FIELDS}  # [T, n] each
    times = []
    for i in range(len(bars)):
        row = [np.ascontiguousarray(columns[f][i]) for f in FIELDS]
        started = time.perf_counter_ns()
        stream.update(ids, *row)
        times.append((time.perf_counter_ns() - started) / 1e3)
    return _summary(times[warmup:])


def latency(instruments: list[int], bars_per_n: dict[int, int], warmup: int, both_products: bool = False,
            weights: tuple[str, ...] = WEIGHTS, backends: tuple[str, ...] = ("numpy", "torch")) -> list[dict]:
    """Rows of the latency table: shape, backend, weights, path, N, median and p99 µs per bar (the
    old paths for float32 weights only; ``MarketStream (new)`` for each of ``weights``) on each of
    ``backends``."""
    import torch
    from portable_ssm.market import synthetic_bars

    from portable_ssm import params_nbytes

    torch.set_num_threads(1)
    rows = []
    with torch.no_grad():
        for shape in SHAPES:
            for backend in backends:
                for kind in weights:
                    model = _seed_model(backend, shape, kind)
                    at = {"shape": shape, "backend": backend, "weights": kind,
                          "weight_mib": round(params_nbytes(model.params) / 2**20, 2)}
                    if kind == "float32":
                        feed = synthetic_bars("planted", bars_per_n.get(1, 1000) + warmup, seed=0)
                        rows.append({**at, "path": "StreamPredictor (old)", "n": 1, **_time_old(model, feed, warmup)})
                        print(json.dumps(rows[-1]), file=sys.stderr)
                    paths = ["reference", "new", *(("row kernel", "sgemm") if both_products else ())]
                    for n in instruments:
                        feed = synthetic_bars("planted", bars_per_n.get(n, 50) + warmup, seed=0)
                        for path in paths if kind == "float32" else ["new"]:
                            label = {"reference": "MarketStream, portable_ssm.step (old)",
                                     "new": "MarketStream (new)"}.get(path, f"MarketStream, RowsStep {path} only")
                            rows.append({**at, "path": label, "n": n, **_time_new(model, feed, n, warmup, path)})
                            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def breakdown(backend: str, reps: int = 400, weights: str = "float32") -> dict[str, float]:
    """Median µs of each stage of one ``MarketStream.update`` of one instrument on the seed shape
    with its projections stored as ``weights`` (time.perf_counter_ns around each stage called
    alone, as ``update`` calls it): the checks, then the one library call of the whole bar
    (``MarketBar``: features, inputs and step) and the step within it (``RowsStep``)."""
    import torch
    from portable_ssm.market import synthetic_bars

    torch.set_num_threads(1)
    stream = _seed_model(backend, weights=weights).stream([0])
    bars = synthetic_bars("planted", 60 + reps, seed=0)
    ids, fields = np.arange(1), [getattr(bars, f)[:, None].copy() for f in FIELDS]  # [T, 1] each

    def median(fn) -> float:
        times = []
        for i in range(reps):
            started = time.perf_counter_ns()
            fn(i)
            times.append(time.perf_counter_ns() - started)
        return round(float(np.median(times)) / 1e3, 1)

    with torch.no_grad():
        for i in range(60):
            stream.update(ids, *(f[i] for f in fields))
        bar = [f[70] for f in fields]
        rows = stream._rows(ids)
        u = np.random.default_rng(0).standard_normal((1, stream._bar.step.model.d_model)).astype(np.float32)
        return {"update (all)": median(lambda i: stream.update(ids, *(f[60 + i] for f in fields))),
                "ids -> rows": median(lambda i: stream._rows(ids)),
                "field checks": median(lambda i: stream._fields(rows, bar)),
                "whole bar (MarketBar: features, inputs, step)": median(lambda i: stream._whole_bar(rows, bar)),
                "native step (RowsStep, norm_f and head.weight inside)": median(lambda i: stream._bar.step(u, None))}


# --- reading ---


def _write_files(folder: Path, records: int) -> dict[str, Path]:
    """The generated files: OHLCV-1s (one instrument, and ten interleaved), trades; plain and zstd."""
    import databento_dbn as dbn
    import zstandard
    from portable_ssm.market import layout

    rng = np.random.default_rng(0)
    ts = 1_700_000_000_000_000_000 + np.cumsum(rng.integers(0, 2_000_000, records, dtype=np.int64))
    price = 100_000_000_000 + np.cumsum(rng.integers(-10_000_000, 10_001_000, records, dtype=np.int64))
    files = {}
    for name, schema, instruments in (("ohlcv", "ohlcv-1s", 1), ("ohlcv10", "ohlcv-1s", 10), ("trades", "trades", 1)):
        r = np.zeros(records, layout(schema))
        r["length"], r["rtype"], r["publisher_id"] = r.dtype.itemsize // 4, 32 if schema != "trades" else 0, 1
        r["instrument_id"] = 1 + np.arange(records) % instruments
        r["ts_event"] = ts
        if schema == "trades":
            r["price"], r["size"], r["ts_recv"] = price, 1 + np.arange(records) % 7, ts
            r["action"], r["side"] = b"T", b"B"
        else:
            r["open"], r["close"] = price, price + 1_000_000
            r["high"], r["low"], r["volume"] = price + 5_000_000, price - 5_000_000, 1 + np.arange(records) % 50
        meta = dbn.Metadata(dataset="BENCH", start=int(ts[0]), stype_in=dbn.SType.RAW_SYMBOL,
                            stype_out=dbn.SType.INSTRUMENT_ID, schema=dbn.Schema.from_str(schema), symbols=["X"])
        path = folder / f"{name}.dbn"
        with path.open("wb") as f:
            f.write(meta.encode())
            f.write(r.tobytes())
        files[name] = path
        del r
        if instruments == 1:
            for suffix, size in ((".zst", None), (".sized.zst", path.stat().st_size)):  # size: in the frame
                packed = folder / f"{name}.dbn{suffix}"
                with path.open("rb") as src, packed.open("wb") as dst:
                    zstandard.ZstdCompressor(level=1).copy_stream(src, dst, size=-1 if size is None else size)
                files[name + suffix] = packed
    return files


def _status_mib(field: str) -> float:
    """A memory figure of /proc/self/status in MiB (VmRSS now, VmHWM the peak of this program:
    unlike ru_maxrss it does not carry the parent's peak across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _read_case(path: str, case: str) -> None:
    """One reading case in this (fresh) process; prints its JSON. Imports are made before the
    clock starts: NumPy's CPU kernels' (the compiled bar cutter's) as well as the readers'."""
    from portable_ssm.backends.numpy import kernels
    from portable_ssm.market import read_bars, read_dbn_columns

    kernels.library()

    base = _status_mib("VmRSS")
    started = time.perf_counter()
    if case == "columns":
        schema, columns = read_dbn_columns(path)
        out = sum(v.nbytes for v in columns.values())
        n = columns["ts_event"].shape[0]
    elif case == "filter":
        schema, columns = read_dbn_columns(path, instrument_id=3)
        out = sum(v.nbytes for v in columns.values())
        n = None
    elif case == "bars":
        bars = read_bars(path, interval_ns=1_000_000_000)
        out, n = sum(getattr(bars, f).nbytes for f in ("ts_event", *FIELDS)), None
    elif case == "decompress":  # the zstd frame alone into one reused buffer, nothing parsed: any reader's floor
        import zstandard

        buffer, out, n = bytearray(1 << 20), 0, None
        with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as reader:
            while reader.readinto(buffer):
                pass
    else:  # "reference": the reader before the chunked one: one databento-dbn object per record
        import databento_dbn as dbn

        decoder, records = dbn.DBNDecoder(), []
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                decoder.write(chunk)
                records.extend(r for r in decoder.decode() if hasattr(r, "instrument_id"))
        columns = {"ts_event": np.array([r.ts_event for r in records], dtype=np.int64)}
        for name in ("open", "high", "low", "close"):
            columns[name] = np.array([getattr(r, name) for r in records], dtype=np.int64) / 1e9
        columns["volume"] = np.array([r.volume for r in records], dtype=np.int64)
        out, n = sum(v.nbytes for v in columns.values()), len(records)
    seconds = time.perf_counter() - started
    peak = _status_mib("VmHWM")
    print(json.dumps({"seconds": seconds, "peak_above_imports_mib": round(peak - base, 1),
                      "output_mib": round(out / 2**20, 1), "records_read": n}))


def reading(records: int, reference_records: int) -> list[dict]:
    """Rows of the reading table (each case in a fresh process)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("MARKET_BENCH_DIR")) as tmp:
        files = _write_files(Path(tmp), records)
        (Path(tmp) / "small").mkdir()
        small = _write_files(Path(tmp) / "small", reference_records)
        os.sync()  # the files' dirty pages written back now, not while a reading case is timed
        cases = [("OHLCV-1s, all columns", files["ohlcv"], "columns", records),
                 ("OHLCV-1s + zstd, all columns", files["ohlcv.zst"], "columns", records),
                 ("OHLCV-1s + zstd (content size in the frame), all columns", files["ohlcv.sized.zst"], "columns",
                  records),
                 ("OHLCV-1s, 10 instruments, one chosen", files["ohlcv10"], "filter", records),
                 ("trades -> 1 s bars", files["trades"], "bars", records),
                 ("trades + zstd -> 1 s bars", files["trades.zst"], "bars", records),
                 ("OHLCV-1s + zstd, decompression alone (nothing parsed)", files["ohlcv.zst"], "decompress", records),
                 ("trades + zstd, decompression alone (nothing parsed)", files["trades.zst"], "decompress", records),
                 (f"OHLCV-1s, record by record (databento-dbn objects, {reference_records:.0e} records)",
                  small["ohlcv"], "reference", reference_records)]
        for label, path, case, n in cases:
            runs = []
            for _ in range(2):  # the first process after the files were written runs slower on a VM: keep both
                done = subprocess.run([sys.executable, __file__, "_read", str(path), case], capture_output=True,
                                      text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            result = runs[1]
            rows.append({"case": label, "records": n, "file_mib": round(path.stat().st_size / 2**20, 1),
                         "records_per_s": round(n / result["seconds"]), **result,
                         "first_seconds": round(runs[0]["seconds"], 3)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_read":
        _read_case(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("latency", "reading", "breakdown"))
    p.add_argument("--instruments", type=int, nargs="+", default=[1, 10, 100, 1000])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--both-products", action="store_true",
                   help="also time RowsStep with the row kernel only and with sgemm only at every N")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS),
                   help="storage kinds of the backbone's projections to time (MarketModel.quantize)")
    p.add_argument("--backends", nargs="+", choices=("numpy", "torch", "jax"), default=["numpy", "torch"],
                   help="the latency table's backends (jax: MarketStream's compiled bar beside op by op)")
    p.add_argument("--bars", type=int, help="bars timed at every N (default: 1000 at N = 1 down to 30 at 1000)")
    p.add_argument("--reps", type=int, default=400, help="calls of each stage --only breakdown times")
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--reference-records", type=int, default=1_000_000)
    args = p.parse_args()
    from portable_ssm.backends.numpy import kernels

    result = {"load_average_at_start": [round(v, 1) for v in os.getloadavg()], "cpus": os.cpu_count(),
              "int8_vnni": kernels.vnni_products()}
    if args.only == "breakdown":
        result["breakdown"] = {f"{backend}, {kind}": breakdown(backend, args.reps, kind)
                               for backend in ("numpy", "torch") for kind in args.weights}
        print(json.dumps(result["breakdown"], indent=1))
    if args.only in (None, "latency"):
        bars = {1: 1000, 10: 300, 100: 100, 1000: 30} if args.bars is None else dict.fromkeys(args.instruments,
                                                                                                args.bars)
        result["latency"] = latency(args.instruments, bars, args.warmup, args.both_products, tuple(args.weights),
                                    tuple(args.backends))
        print(_table(result["latency"], ["shape", "backend", "weights", "weight_mib", "path", "n", "median_us",
                                         "p99_us", "bars"]))
    if args.only in (None, "reading"):
        result["reading"] = reading(args.records, args.reference_records)
        print(_table(result["reading"], ["case", "records", "file_mib", "records_per_s", "seconds", "first_seconds",
                                         "peak_above_imports_mib", "output_mib"]))
    result["load_average_at_end"] = [round(v, 1) for v in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
