"""Market data in: DBN files (OHLCV bars, trades, MBP-1 top of book) and csv/parquet tables, as :class:`Bars`.

DBN stores prices as fixed-point integers in 1e-9 units. :func:`fixed_to_float` converts them
exactly: an integer of at most 2**53 in magnitude is an exact float64, and IEEE division by the
exact 1e9 rounds the true quotient once, so the result is the float nearest to ``p / 10**9``.
``UNDEF_PRICE`` becomes NaN. Timestamps stay int64 nanoseconds since the epoch.

Trades and MBP-1 records are events, not bars: :func:`read_bars` cuts them into bars of
``interval_ns`` (trade prices; for MBP-1 the mid of the best bid and ask), each bar stamped with the
start of its interval and known once the interval ends, the DBN OHLCV convention.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

PRICE_SCALE = 1_000_000_000  # DBN fixed-point: 1 unit = 1e-9
UNDEF_PRICE = 2**63 - 1
_EXACT = 2**53
OHLCV_SCHEMAS = ("ohlcv-1s", "ohlcv-1m", "ohlcv-1h", "ohlcv-1d", "ohlcv-eod")
EVENT_SCHEMAS = ("trades", "mbp-1")


@dataclass(frozen=True)
class Bars:
    """``N`` bars in time order: ``ts_event`` int64 ns (bar start), prices float64, volume float64."""

    ts_event: np.ndarray  # [N] int64
    open: np.ndarray  # [N] float64
    high: np.ndarray  # [N] float64
    low: np.ndarray  # [N] float64
    close: np.ndarray  # [N] float64
    volume: np.ndarray  # [N] float64

    def __len__(self) -> int:
        return int(self.ts_event.shape[0])

    def slice(self, start: int, stop: int) -> Bars:
        """Bars ``start`` .. ``stop - 1``."""
        return Bars(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

    def replace_after(self, t: int, other: Bars) -> Bars:
        """These bars up to ``t`` and ``other``'s after it (same length): the leak tests' edit."""
        return Bars(**{f.name: np.concatenate([getattr(self, f.name)[:t + 1], getattr(other, f.name)[t + 1:]])
                       for f in fields(self)})


def fixed_to_float(fixed: np.ndarray) -> np.ndarray:
    """DBN fixed-point prices (int64, 1e-9 units) -> float64, correctly rounded; UNDEF_PRICE -> NaN."""
    fixed = np.asarray(fixed, dtype=np.int64)
    undefined = fixed == UNDEF_PRICE
    defined = fixed[~undefined]
    largest = int(np.abs(defined).max()) if defined.size else 0
    if largest > _EXACT:
        raise ValueError(f"prices: fixed-point magnitudes up to 2**53 convert exactly, got {largest}")
    return np.where(undefined, np.nan, fixed.astype(np.float64) / PRICE_SCALE)


def float_to_fixed(price: np.ndarray) -> np.ndarray:
    """float64 prices -> DBN fixed-point int64 (nearest 1e-9 unit); NaN -> UNDEF_PRICE."""
    price = np.asarray(price, dtype=np.float64)
    return np.where(np.isnan(price), UNDEF_PRICE, np.rint(np.nan_to_num(price) * PRICE_SCALE)).astype(np.int64)


def _decode(path: Path) -> tuple[str, list]:
    """``(schema name, records)`` of a DBN file (``.dbn`` or zstd ``.dbn.zst``)."""
    import databento_dbn as dbn

    compression = dbn.Compression.ZSTD if path.suffix == ".zst" else dbn.Compression.NONE
    decoder = dbn.DBNDecoder(compression=compression)
    records: list = []
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            decoder.write(chunk)
            records.extend(decoder.decode())
    if not records or not isinstance(records[0], dbn.Metadata):
        raise ValueError(f"path: {path} holds no DBN metadata header")
    return str(records[0].schema), records[1:]


def _one_instrument(path: Path, records: list, instrument_id: int | None) -> list:
    ids = sorted({r.instrument_id for r in records})
    if instrument_id is None:
        if len(ids) > 1:
            raise ValueError(f"instrument_id: {path} holds instruments {ids}; choose one")
        return records
    if instrument_id not in ids:
        raise ValueError(f"instrument_id: {instrument_id} is not in {path} (it holds {ids})")
    return [r for r in records if r.instrument_id == instrument_id]


def read_dbn_columns(path: str | Path, *, instrument_id: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """A DBN file's records as columns: ``(schema, {name: [n] array})``; prices float64 (exact),
    ``ts_event`` int64 ns, sizes int64. OHLCV: open/high/low/close/volume; trades: price/size/side;
    MBP-1: price/size/action plus bid_px/ask_px/bid_sz/ask_sz."""
    path = Path(path)
    schema, records = _decode(path)
    records = _one_instrument(path, [r for r in records if hasattr(r, "instrument_id")], instrument_id)
    names = {"ohlcv": ("open", "high", "low", "close", "volume"), "trades": ("price", "size", "side"),
             "mbp-1": ("price", "size", "action", "bid_px_00", "ask_px_00", "bid_sz_00", "ask_sz_00")}
    kind = "ohlcv" if schema in OHLCV_SCHEMAS else schema
    if kind not in names:
        raise ValueError(f"path: {path} has schema {schema!r}; expected one of {OHLCV_SCHEMAS + EVENT_SCHEMAS}")
    prices = {"open", "high", "low", "close", "price", "bid_px_00", "ask_px_00"}
    columns = {"ts_event": np.array([r.ts_event for r in records], dtype=np.int64)}
    for name in names[kind]:
        values = [getattr(r, name) for r in records]
        if name in ("side", "action"):
            columns[name] = np.array([str(v) for v in values], dtype="<U1")
        elif name in prices:
            columns[name.removesuffix("_00")] = fixed_to_float(np.array(values, dtype=np.int64))
        else:
            columns[name.removesuffix("_00")] = np.array(values, dtype=np.int64)
    return schema, columns


def resample(ts_event: np.ndarray, price: np.ndarray, size: np.ndarray, interval_ns: int) -> Bars:
    """Events (time-ordered) -> one OHLCV bar per non-empty interval of ``interval_ns``."""
    if interval_ns <= 0:
        raise ValueError(f"interval_ns: expected a positive bar length in nanoseconds, got {interval_ns}")
    keep = ~np.isnan(price)
    ts_event, price, size = ts_event[keep], price[keep], size[keep].astype(np.float64)
    if ts_event.size == 0:
        raise ValueError("events: no event with a defined price")
    if np.any(np.diff(ts_event) < 0):
        raise ValueError("events: ts_event must be non-decreasing")
    bucket = ts_event // interval_ns
    starts = np.flatnonzero(np.concatenate([[True], bucket[1:] != bucket[:-1]]))
    ends = np.concatenate([starts[1:], [bucket.size]]) - 1
    return Bars(ts_event=bucket[starts] * interval_ns, open=price[starts], high=np.maximum.reduceat(price, starts),
                low=np.minimum.reduceat(price, starts), close=price[ends], volume=np.add.reduceat(size, starts))


def read_bars(path: str | Path, *, instrument_id: int | None = None, interval_ns: int | None = None) -> Bars:
    """Bars from a DBN file: OHLCV records as they are; trades (trade price, size) and MBP-1 (mid
    price, traded size of its trade events) cut into bars of ``interval_ns`` (required for them)."""
    schema, c = read_dbn_columns(path, instrument_id=instrument_id)
    if schema in OHLCV_SCHEMAS:
        return Bars(ts_event=c["ts_event"], open=c["open"], high=c["high"], low=c["low"], close=c["close"],
                    volume=c["volume"].astype(np.float64))
    if interval_ns is None:
        raise ValueError(f"interval_ns: {path} holds {schema} events; give a bar length (e.g. 1_000_000_000)")
    if schema == "trades":
        return resample(c["ts_event"], c["price"], c["size"], interval_ns)
    mid = (c["bid_px"] + c["ask_px"]) / 2  # NaN where a side is undefined
    traded = np.where(c["action"] == "T", c["size"], 0)
    return resample(c["ts_event"], mid, traded, interval_ns)


def write_ohlcv_dbn(path: str | Path, bars: Bars, *, instrument_id: int = 1, schema: str = "ohlcv-1m",
                    dataset: str = "SYNTHETIC", symbol: str = "SYN") -> None:
    """Writes ``bars`` as a DBN OHLCV file with databento-dbn's own encoders (prices to fixed point)."""
    import databento_dbn as dbn

    rtype = getattr(dbn.RType, schema.upper().replace("-", "_"))
    meta = dbn.Metadata(dataset=dataset, start=int(bars.ts_event[0]), stype_in=dbn.SType.RAW_SYMBOL,
                        stype_out=dbn.SType.INSTRUMENT_ID, schema=dbn.Schema.from_str(schema), symbols=[symbol])
    prices = [float_to_fixed(getattr(bars, name)) for name in ("open", "high", "low", "close")]
    volume = np.rint(bars.volume).astype(np.int64)
    with Path(path).open("wb") as f:
        f.write(meta.encode())
        for i in range(len(bars)):
            f.write(bytes(dbn.OHLCVMsg(rtype, 1, instrument_id, int(bars.ts_event[i]), *(int(p[i]) for p in prices),
                                       int(volume[i]))))


def read_table(path: str | Path, *, time: str, close: str, open: str | None = None, high: str | None = None,
               low: str | None = None, volume: str | None = None) -> Bars:
    """Bars from a csv or parquet table with the columns named explicitly (no column is guessed).

    ``time`` is parsed as a date-time (or taken as int64 ns when it is integer); a missing
    open/high/low falls back to the close, a missing volume to zeros. Rows are sorted by time.
    """
    import pandas as pd

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".parquet", ".pq"):
        raise ValueError(f"path: expected a .csv or .parquet table, got {path}")
    table = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    chosen = {"time": time, "close": close, "open": open, "high": high, "low": low, "volume": volume}
    missing = {k: v for k, v in chosen.items() if v is not None and v not in table.columns}
    if missing:
        raise ValueError(f"columns: {missing} not in {path} (it has {list(table.columns)})")
    stamp = table[time]
    ts = (stamp.to_numpy(np.int64) if pd.api.types.is_integer_dtype(stamp)
          else pd.to_datetime(stamp, utc=True).to_numpy("datetime64[ns]").astype(np.int64))
    order = np.argsort(ts, kind="stable")

    def column(name: str | None, fallback: np.ndarray) -> np.ndarray:
        return fallback if name is None else table[name].to_numpy(np.float64)[order]

    c = column(close, np.empty(0))
    return Bars(ts_event=ts[order], open=column(open, c), high=column(high, c), low=column(low, c), close=c,
                volume=column(volume, np.zeros_like(c)))
