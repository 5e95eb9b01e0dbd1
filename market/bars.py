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

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ._checks import MarketDataError, as_path, check_choice, check_int, open_regular
from .dbn import OHLCV_SCHEMAS, RTYPES, DbnFile, TimeOrder, check_records, layout

PRICE_SCALE = 1_000_000_000  # DBN fixed-point: 1 unit = 1e-9
UNDEF_PRICE = 2**63 - 1
_EXACT = 2**53
_PRICES = ("open", "high", "low", "close")


@dataclass(frozen=True)
class Bars:
    """``N`` bars in time order: ``ts_event`` int64 ns (bar start), prices float64, volume float64.

    Checked when built: six 1-D arrays of one length, ``ts_event`` int64 and the rest float64
    (TypeError / ValueError naming the field; nothing is converted)."""

    ts_event: np.ndarray  # [N] int64
    open: np.ndarray  # [N] float64
    high: np.ndarray  # [N] float64
    low: np.ndarray  # [N] float64
    close: np.ndarray  # [N] float64
    volume: np.ndarray  # [N] float64

    def __post_init__(self) -> None:
        n = None
        for f in fields(self):
            value = getattr(self, f.name)
            want = np.int64 if f.name == "ts_event" else np.float64
            if not isinstance(value, np.ndarray) or value.dtype != want:
                got = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
                raise TypeError(f"{f.name}: expected a {np.dtype(want).name} NumPy array, got {got}")
            if value.ndim != 1 or (n is not None and value.shape[0] != n):
                raise ValueError(f"{f.name}: expected shape [{'N' if n is None else n}], got {value.shape}")
            n = value.shape[0]

    def __len__(self) -> int:
        return int(self.ts_event.shape[0])

    def slice(self, start: int, stop: int) -> Bars:
        """Bars ``start`` .. ``stop - 1`` (ints with ``0 <= start <= stop <= N``)."""
        start = check_int("start", start, minimum=0, maximum=len(self))
        stop = check_int("stop", stop, minimum=start, maximum=len(self))
        return Bars(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

    def replace_after(self, t: int, other: Bars) -> Bars:
        """These bars up to ``t`` and ``other``'s after it (same length): the leak tests' edit."""
        t = check_int("t", t, minimum=0, maximum=len(self) - 1)
        if not isinstance(other, Bars) or len(other) != len(self):
            raise ValueError(f"other: expected Bars of length {len(self)}, got {other!r:.60}")
        return Bars(**{f.name: np.concatenate([getattr(self, f.name)[:t + 1], getattr(other, f.name)[t + 1:]])
                       for f in fields(self)})


def fixed_to_float(fixed: np.ndarray) -> np.ndarray:
    """DBN fixed-point prices (an integer array, 1e-9 units) -> float64, correctly rounded;
    UNDEF_PRICE -> NaN. TypeError for a non-integer array (no silent cast), ValueError beyond 2**53."""
    fixed = np.asarray(fixed)
    if fixed.dtype == np.bool_ or not np.issubdtype(fixed.dtype, np.integer):
        raise TypeError(f"fixed: expected an integer array of fixed-point prices, got dtype {fixed.dtype}")
    fixed = fixed.astype(np.int64, copy=False)
    if fixed.size == 0:
        return np.zeros(fixed.shape)
    undefined = fixed == UNDEF_PRICE
    if undefined.any():
        defined = np.where(undefined, 0, fixed)
        return np.where(undefined, np.nan, _exact_quotient(defined))
    return _exact_quotient(fixed)


def _exact_quotient(fixed: np.ndarray) -> np.ndarray:
    low, high = int(fixed.min()), int(fixed.max())
    if max(-low, high) > _EXACT:
        raise ValueError(f"prices: fixed-point magnitudes up to 2**53 convert exactly, got {max(-low, high)}")
    return fixed / PRICE_SCALE  # int64 -> float64 exactly (|p| <= 2**53), then one rounding


def float_to_fixed(price: np.ndarray) -> np.ndarray:
    """float64 prices -> DBN fixed-point int64 (nearest 1e-9 unit); NaN -> UNDEF_PRICE; ValueError
    for an infinite price or one beyond 2**53 units."""
    price = np.asarray(price, dtype=np.float64)
    defined = ~np.isnan(price)
    units = np.rint(np.where(defined, price, 0.0) * PRICE_SCALE)
    if not np.isfinite(units).all() or np.abs(units).max(initial=0.0) > _EXACT:
        raise ValueError("price: expected finite prices within 2**53 fixed-point units (about 9e6)")
    return np.where(defined, units, UNDEF_PRICE).astype(np.int64)


def _as_instrument(instrument_id: int | None) -> int | None:
    return None if instrument_id is None else check_int("instrument_id", instrument_id, minimum=0, maximum=2**32 - 1)


#: A compiled pass over one unchecked chunk: ``(schema, first, records, chosen, state) -> taken``.
Compiled = Callable[[str, int, np.ndarray, int, np.ndarray], bool]


class _Selection:
    """The records of one instrument of an open ``dbn``, chunk by chunk: ``instrument_id``'s, or the
    file's only one's (MarketDataError when several are there and none is chosen), checked for time
    order."""

    def __init__(self, dbn: DbnFile, instrument_id: int | None) -> None:
        self.dbn, self.instrument_id = dbn, instrument_id
        self.order, self.only = TimeOrder(dbn.path), None

    def __call__(self, first: int, records: np.ndarray) -> np.ndarray:
        """The chunk's records (the first at file index ``first``) of the instrument."""
        ids = records["instrument_id"]
        if self.instrument_id is None:
            self.only = int(ids[0]) if self.only is None else self.only
            if (ids != self.only).any():
                seen = sorted({self.only, *np.unique(ids).tolist()})
                raise MarketDataError(f"{self.dbn.path}: holds instruments {seen}; choose one with instrument_id")
            index = first + np.arange(records.shape[0])
        else:
            index = first + np.flatnonzero(ids == self.instrument_id)
            records = records[index - first]
        self.order.check(records["ts_event"].view(np.int64), index)
        return records

    def state(self) -> np.ndarray:
        """What is carried from chunk to chunk, as the compiled passes read and update it: int64
        ``[3]``, the instrument read (-1: none yet or one chosen), the last ts_event and its index."""
        return np.array([-1 if self.only is None else self.only, self.order.last, self.order.last_index],
                        dtype=np.int64)

    def carry(self, state: np.ndarray) -> None:
        """Takes back :meth:`state` as a compiled pass left it."""
        self.only = None if state[0] < 0 else int(state[0])
        self.order.last, self.order.last_index = int(state[1]), int(state[2])

    def chunks(self, chunk_records: int, compiled: Compiled | None) -> Iterator[np.ndarray]:
        """The instrument's records of each chunk of the file that ``compiled`` (``compiled(schema,
        first, records, chosen, state) -> bool``, or None; chosen: the instrument asked for or -1)
        did not take: it reads the unchecked chunk in one pass and updates ``state`` where it takes
        it; the rest are checked and selected here, so the errors are the NumPy path's."""
        chosen, schema = -1 if self.instrument_id is None else self.instrument_id, self.dbn.schema
        for first, records in self.dbn.records(chunk_records):
            state = self.state()
            if compiled is not None and compiled(schema, first, records, chosen, state):
                self.carry(state)
                continue
            check_records(records, schema, first, self.dbn.path)
            yield self(first, records)


def _file_prices(path: str, records: np.ndarray, name: str) -> np.ndarray:
    """:func:`fixed_to_float` of one field of a file's records; MarketDataError naming the file."""
    try:
        return fixed_to_float(records[name])
    except ValueError as err:
        raise MarketDataError(f"{path}: field {name!r}: {err}") from None


def _price_block(path: str, records: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """``[n, len(names)]`` float64 prices of adjacent int64 fields ``names`` of ``records`` in one
    pass each (convert, range check, divide), equal bit for bit to :func:`fixed_to_float`; falls
    back to it per field when a price is undefined or beyond 2**53 units."""
    first = records.dtype.fields[names[0]][1]
    n, words = records.shape[0], records.dtype.itemsize // 8
    raw = records.view(np.int64).reshape(n, words)  # [n, words]: the records as 8-byte words
    block = raw[:, first // 8:first // 8 + len(names)].astype(np.float64)  # [n, len(names)], exact below 2**53
    if n and max(block.max(), -block.min()) >= _EXACT:  # UNDEF_PRICE or out of range: the exact path decides
        return np.stack([_file_prices(path, records, name) for name in names], axis=1)
    block /= PRICE_SCALE
    return block


def _columns(path: str, schema: str, records: np.ndarray) -> dict[str, np.ndarray]:
    """One chunk's records as the columns :func:`read_dbn_columns` returns."""
    out = {"ts_event": records["ts_event"].astype(np.int64)}
    if schema in OHLCV_SCHEMAS:
        prices = _price_block(path, records, _PRICES)  # [n, 4]
        out.update({name: prices[:, i] for i, name in enumerate(_PRICES)})
        out["volume"] = records["volume"].astype(np.int64)
        return out
    out.update(price=_file_prices(path, records, "price"), size=records["size"].astype(np.int64),
               side=records["side"].astype("<U1"))
    if schema == "mbp-1":
        out.update(action=records["action"].astype("<U1"), bid_px=_file_prices(path, records, "bid_px_00"),
                   ask_px=_file_prices(path, records, "ask_px_00"), bid_sz=records["bid_sz_00"].astype(np.int64),
                   ask_sz=records["ask_sz_00"].astype(np.int64))
    return out


#: Records the columns grow by at a time when a zstd stream outruns its size hint (about 50 MiB of
#: OHLCV columns): ``ndarray.resize`` zero-fills what it adds, so a doubling made up to the output's
#: size resident again, where a fixed step leaves one step; past 32 MiB an array is its own mapping,
#: which ``realloc`` grows by moving pages, not bytes.
GROW_RECORDS = 1 << 20


class _Columns:
    """The chunks' columns joined into arrays allocated once: of the file's record count when it
    bounds them (a plain file), else of the zstd frame's content size when it records one, grown
    by :data:`GROW_RECORDS` (``ndarray.resize``) when the records outrun that hint."""

    def __init__(self, capacity: int, exact: bool) -> None:
        self.capacity, self.grows, self.out, self.n = capacity, not exact, None, 0

    def _room(self, m: int, dtypes: dict[str, np.dtype]) -> None:
        """Columns of ``dtypes`` with room for ``m`` more rows."""
        if self.out is None:  # untouched pages cost no memory: only the rows written are resident
            self.capacity = max(self.capacity, m) if self.grows else self.capacity
            self.out = {name: np.empty(self.capacity, dtype) for name, dtype in dtypes.items()}
        if self.n + m > self.capacity:
            self.capacity = self.n + m + GROW_RECORDS
            for values in self.out.values():
                values.resize(self.capacity, refcheck=False)  # no view of these arrays exists yet

    def add(self, columns: dict[str, np.ndarray]) -> None:
        m = columns["ts_event"].shape[0]
        self._room(m, {name: v.dtype for name, v in columns.items()})
        for name, values in columns.items():
            self.out[name][self.n:self.n + m] = values
        self.n += m

    def compiled(self, schema: str, first: int, records: np.ndarray, chosen: int, state: np.ndarray) -> bool:
        """An OHLCV chunk's columns written in place by one compiled pass (``ohlcv_columns`` of
        NumPy's CPU kernels, the values of :func:`_columns` bit for bit; :meth:`_Selection.chunks`
        says the rest); False where it leaves the chunk to the NumPy path."""
        from portable_ssm.backends.numpy import kernels

        if kernels.library() is None:
            return False
        self._room(records.shape[0], kernels.OHLCV_COLUMNS)
        m = kernels.ohlcv_columns(records, RTYPES[schema], chosen, first, state, self.out, self.n)
        self.n += m or 0
        return m is not None

    def result(self, path: str, schema: str) -> dict[str, np.ndarray]:
        if self.out is None:
            empty = _columns(path, schema, np.zeros(0, layout(schema)))
            return {name: np.zeros(0, v.dtype) for name, v in empty.items()}
        if self.grows:  # give back the unused tail (realloc shrinks in place)
            for values in self.out.values():
                values.resize(self.n, refcheck=False)
        return {name: values[:self.n] for name, values in self.out.items()}


def read_dbn_columns(path: str | os.PathLike, *, instrument_id: int | None = None,
                     chunk_records: int = 1 << 18) -> tuple[str, dict[str, np.ndarray]]:
    """A DBN file's records as columns: ``(schema, {name: [n] array})``; prices float64 (exact),
    ``ts_event`` int64 ns, sizes int64. OHLCV: open/high/low/close/volume; trades: price/size/side;
    MBP-1: also action, bid_px/ask_px/bid_sz/ask_sz. Read in chunks of ``chunk_records`` records
    (:mod:`.dbn`: memory of the columns plus one chunk). ``instrument_id`` picks one instrument;
    without it the file must hold one. MarketDataError naming the file (and record) for anything
    malformed, truncated or out of time order (see :mod:`portable_ssm.market.dbn`)."""
    path = os.fspath(as_path("path", path))
    instrument_id = _as_instrument(instrument_id)
    chunk_records = check_int("chunk_records", chunk_records, minimum=1)
    with DbnFile(path) as dbn:
        return dbn.schema, _read_columns(dbn, instrument_id, chunk_records)


def _read_columns(dbn: DbnFile, instrument_id: int | None, chunk_records: int) -> dict[str, np.ndarray]:
    """:func:`read_dbn_columns` of an open file."""
    sink = _Columns(*dbn.capacity())
    compiled = sink.compiled if dbn.schema in OHLCV_SCHEMAS else None
    for records in _Selection(dbn, instrument_id).chunks(chunk_records, compiled):
        sink.add(_columns(dbn.path, dbn.schema, records))
    columns = sink.result(dbn.path, dbn.schema)
    if columns["ts_event"].shape[0] == 0 and instrument_id is not None:
        raise MarketDataError(f"{dbn.path}: holds no record of instrument_id {instrument_id}")
    return columns


class _BarCutter:
    """Cuts time-ordered events into OHLCV bars of ``interval_ns`` chunk by chunk, carrying the
    last (possibly unfinished) bar across chunks: no event array is ever held whole."""

    def __init__(self, interval_ns: int) -> None:
        self.interval, self.done, self.carry = interval_ns, [], None

    def add(self, ts_event: np.ndarray, price: np.ndarray, size: np.ndarray) -> None:
        """Events ``[n]`` (ts int64, price float64 with NaN undefined, size) after those added before."""
        keep = ~np.isnan(price)
        ts_event, price, size = ts_event[keep], price[keep], size[keep].astype(np.float64)
        if ts_event.size == 0:
            return
        bucket = ts_event // self.interval
        starts = np.flatnonzero(np.concatenate([[True], bucket[1:] != bucket[:-1]]))
        ends = np.concatenate([starts[1:], [bucket.size]]) - 1
        bars = np.stack([bucket[starts].astype(np.float64), price[starts], np.maximum.reduceat(price, starts),
                         np.minimum.reduceat(price, starts), price[ends], np.add.reduceat(size, starts)])  # [6, n_bars]
        self.merge(bucket[starts], bars)

    def compiled(self, schema: str, first: int, records: np.ndarray, chosen: int, state: np.ndarray) -> bool:
        """A chunk of events cut into bars by one compiled pass (``event_bars`` of NumPy's CPU
        kernels, the arithmetic of :meth:`add` bit for bit; :meth:`_Selection.chunks` says the
        rest); False where it leaves the chunk to the NumPy path."""
        from portable_ssm.backends.numpy import kernels

        bars = kernels.event_bars(records, RTYPES[schema], schema == "mbp-1", chosen, first, self.interval, state)
        if bars is not None:
            self.merge(*bars)
        return bars is not None

    def merge(self, buckets: np.ndarray, bars: np.ndarray) -> None:
        """The next events' bars, ``buckets [k]`` and ``bars [6, k]`` (bucket, open, high, low,
        close, volume; kept, and the first written to), the first joining the bar carried from
        before where they share a bucket."""
        if buckets.size == 0:
            return
        if self.carry is not None:
            carried_bucket, row = self.carry
            if buckets[0] == carried_bucket:
                bars[1:, 0] = (row[1], max(row[2], bars[2, 0]), min(row[3], bars[3, 0]), bars[4, 0],
                               row[5] + bars[5, 0])
            else:
                self.done.append((np.array([carried_bucket]), row[:, None]))
        self.done.append((buckets[:-1], bars[:, :-1]))
        self.carry = (int(buckets[-1]), bars[:, -1].copy())

    def bars(self, path: str) -> Bars:
        """Every bar so far (the last one included); MarketDataError when there is none."""
        if self.carry is None:
            raise MarketDataError(f"{path}: no event with a defined price to make a bar of")
        pieces = [*self.done, (np.array([self.carry[0]]), self.carry[1][:, None])]
        buckets = np.concatenate([b for b, _ in pieces]).astype(np.int64)
        values = np.concatenate([v for _, v in pieces], axis=1)  # [6, n_bars]
        return Bars(ts_event=buckets * self.interval, open=values[1], high=values[2], low=values[3], close=values[4],
                    volume=values[5])


def resample(ts_event: np.ndarray, price: np.ndarray, size: np.ndarray, interval_ns: int) -> Bars:
    """Events (time-ordered) -> one OHLCV bar per non-empty interval of ``interval_ns``: ``ts_event``
    int64 ``[n]``, ``price`` float ``[n]`` (NaN: undefined, skipped), ``size`` ``[n]``."""
    interval_ns = check_int("interval_ns", interval_ns, minimum=1)
    ts_event, price, size = np.asarray(ts_event), np.asarray(price, dtype=np.float64), np.asarray(size)
    shapes = {ts_event.shape, price.shape, size.shape}
    if ts_event.dtype != np.int64 or ts_event.ndim != 1 or len(shapes) != 1:
        raise ValueError(f"ts_event, price, size: expected [n] arrays (ts_event int64), got {ts_event.dtype} "
                         f"{ts_event.shape}, {price.shape}, {size.shape}")
    back = np.flatnonzero(np.diff(ts_event) < 0)
    if back.size:
        raise ValueError(f"ts_event: must be non-decreasing; event {int(back[0]) + 1} is earlier than the one before")
    cutter = _BarCutter(interval_ns)
    cutter.add(ts_event, price, size)
    if cutter.carry is None:
        raise ValueError("price: no event with a defined price")
    return cutter.bars("events")


def read_bars(path: str | os.PathLike, *, instrument_id: int | None = None, interval_ns: int | None = None,
              chunk_records: int = 1 << 18) -> Bars:
    """Bars from a DBN file (plain or zstd): OHLCV records as they are; trades (trade price, size)
    and MBP-1 (mid price, traded size of its trade events) cut into bars of ``interval_ns`` (an
    int >= 1, required for them) as the file streams by, never holding every event. Errors as
    :func:`read_dbn_columns`."""
    path = os.fspath(as_path("path", path))
    instrument_id = _as_instrument(instrument_id)
    interval_ns = None if interval_ns is None else check_int("interval_ns", interval_ns, minimum=1)
    chunk_records = check_int("chunk_records", chunk_records, minimum=1)
    with DbnFile(path) as dbn:
        if dbn.schema in OHLCV_SCHEMAS:
            c = _read_columns(dbn, instrument_id, chunk_records)
            return Bars(ts_event=c["ts_event"], open=c["open"], high=c["high"], low=c["low"], close=c["close"],
                        volume=c["volume"].astype(np.float64))
        if interval_ns is None:
            raise ValueError(f"interval_ns: {path} holds {dbn.schema} events; give a bar length (e.g. 1_000_000_000)")
        cutter = _BarCutter(interval_ns)
        for records in _Selection(dbn, instrument_id).chunks(chunk_records, cutter.compiled):
            cutter.add(*_events(path, dbn.schema, records))
    return cutter.bars(path)


def _by_instrument(dbn: DbnFile, wanted: np.ndarray | None, chunk_records: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(instrument_id, records)`` for each instrument in each chunk of ``dbn`` (all, or those in
    ``wanted``), each chunk's records checked, each instrument's for time order on their own."""
    orders: dict[int, TimeOrder] = {}
    for first, records in dbn.records(chunk_records):
        check_records(records, dbn.schema, first, dbn.path)
        ids = records["instrument_id"]
        keep = np.arange(ids.shape[0]) if wanted is None else np.flatnonzero(np.isin(ids, wanted))
        keep = keep[np.argsort(ids[keep], kind="stable")]  # grouped by instrument, file order within each
        starts = np.flatnonzero(np.concatenate([[True], ids[keep][1:] != ids[keep][:-1]])) if keep.size else keep
        for start, stop in zip(starts, [*starts[1:], keep.size]):
            index = keep[start:stop]
            instrument = int(ids[index[0]])
            mine = records[index]
            orders.setdefault(instrument, TimeOrder(dbn.path)).check(mine["ts_event"].view(np.int64), first + index)
            yield instrument, mine


def read_bars_by_instrument(path: str | os.PathLike, *, instrument_ids: Any = None, interval_ns: int | None = None,
                            chunk_records: int = 1 << 18) -> dict[int, Bars]:
    """Every instrument's bars from one pass over a DBN file: ``{instrument_id: Bars}`` (all of
    them, or those in ``instrument_ids``), ids ascending. OHLCV records as they are; trades and
    MBP-1 cut into bars of ``interval_ns`` per instrument as :func:`read_bars` does. Each
    instrument's records must be in time order; errors as :func:`read_dbn_columns`."""
    path = os.fspath(as_path("path", path))
    wanted = None
    if instrument_ids is not None:
        wanted = np.array([_as_instrument(i) for i in instrument_ids], dtype=np.int64)
    interval_ns = None if interval_ns is None else check_int("interval_ns", interval_ns, minimum=1)
    chunk_records = check_int("chunk_records", chunk_records, minimum=1)
    pieces: dict[int, list[dict[str, np.ndarray]]] = {}
    cutters: dict[int, _BarCutter] = {}
    with DbnFile(path) as dbn:
        schema = dbn.schema
        if schema not in OHLCV_SCHEMAS and interval_ns is None:
            raise ValueError(f"interval_ns: {path} holds {schema} events; give a bar length (e.g. 1_000_000_000)")
        for instrument, records in _by_instrument(dbn, wanted, chunk_records):
            if schema in OHLCV_SCHEMAS:
                pieces.setdefault(instrument, []).append(_columns(path, schema, records))
            else:
                cutters.setdefault(instrument, _BarCutter(interval_ns)).add(*_events(path, schema, records))
    if schema not in OHLCV_SCHEMAS:
        return {i: cutters[i].bars(path) for i in sorted(cutters)}
    out = {}
    for i in sorted(pieces):
        mine = pieces.pop(i)
        c = {name: np.concatenate([p[name] for p in mine]) for name in ("ts_event", *_PRICES, "volume")}
        out[i] = Bars(ts_event=c["ts_event"], open=c["open"], high=c["high"], low=c["low"], close=c["close"],
                      volume=c["volume"].astype(np.float64))
    return out


def _events(path: str, schema: str, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ts_event, price, size)`` of trade or MBP-1 records as bars are cut from them (MBP-1: the
    mid price, and the size of trade events only)."""
    ts = records["ts_event"].astype(np.int64)
    if schema == "trades":
        return ts, _file_prices(path, records, "price"), records["size"]
    bid, ask = _file_prices(path, records, "bid_px_00"), _file_prices(path, records, "ask_px_00")
    traded = np.where(records["action"] == b"T", records["size"], 0)
    return ts, (bid + ask) / 2, traded  # the mid is NaN where a side is undefined


def ohlcv_records(bars: Bars, *, instrument_id: int = 1, schema: str = "ohlcv-1m") -> np.ndarray:
    """``bars`` as a structured array of DBN OHLCV records (:func:`portable_ssm.market.dbn.layout`)."""
    records = np.zeros(len(bars), layout(schema))
    records["length"], records["rtype"], records["publisher_id"] = records.dtype.itemsize // 4, RTYPES[schema], 1
    records["instrument_id"], records["ts_event"] = instrument_id, bars.ts_event
    for name in _PRICES:
        records[name] = float_to_fixed(getattr(bars, name))
    records["volume"] = np.rint(bars.volume)
    return records


def write_ohlcv_dbn(path: str | os.PathLike, bars: Bars, *, instrument_id: int = 1, schema: str = "ohlcv-1m",
                    dataset: str = "SYNTHETIC", symbol: str = "SYN") -> None:
    """Writes ``bars`` as a DBN OHLCV file: databento-dbn's metadata header, then the records
    (prices to fixed point), atomically (a temporary file, fsynced, renamed over ``path``)."""
    import databento_dbn as dbn

    from portable_ssm.io.atomic import replace_atomically

    if not isinstance(bars, Bars) or len(bars) == 0:
        raise ValueError(f"bars: expected non-empty Bars, got {bars!r:.60}")
    schema = check_choice("schema", schema, OHLCV_SCHEMAS)
    instrument_id = check_int("instrument_id", instrument_id, minimum=0, maximum=2**32 - 1)
    if (bars.volume < 0).any() or not np.isfinite(bars.volume).all() or (bars.ts_event < 0).any():
        raise ValueError("bars: DBN stores non-negative finite volumes and non-negative timestamps")
    meta = dbn.Metadata(dataset=dataset, start=int(bars.ts_event[0]), stype_in=dbn.SType.RAW_SYMBOL,
                        stype_out=dbn.SType.INSTRUMENT_ID, schema=dbn.Schema.from_str(schema), symbols=[symbol])
    records = ohlcv_records(bars, instrument_id=instrument_id, schema=schema)

    def write(f) -> None:
        f.write(meta.encode())
        f.write(records.tobytes())

    replace_atomically(as_path("path", path), write)


def read_table(path: str | Path, *, time: str, close: str, open: str | None = None, high: str | None = None,
               low: str | None = None, volume: str | None = None) -> Bars:
    """Bars from a csv or parquet table with the columns named explicitly (no column is guessed).

    ``time`` is parsed as a date-time (or taken as int64 ns when it is integer); a missing
    open/high/low falls back to the close, a missing volume to zeros. Rows are sorted by time.
    """
    path = as_path("path", path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".parquet", ".pq"):
        raise ValueError(f"path: expected a .csv or .parquet table, got {path}")
    for name, value in (("time", time), ("close", close), ("open", open), ("high", high), ("low", low),
                        ("volume", volume)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name}: expected a column name (str), got {type(value).__name__}")
    try:
        return _table_bars(path, suffix, time=time, close=close, open=open, high=high, low=low, volume=volume)
    except (MarketDataError, OSError):
        raise
    except Exception as err:  # noqa: BLE001 (pandas / pyarrow parse errors have no common type)
        raise MarketDataError(f"{path}: not a readable price table ({type(err).__name__}: {err})") from None


def _table_bars(path: Path, suffix: str, **chosen: str | None) -> Bars:
    """:func:`read_table`'s work on checked arguments (any parse error is the caller's to wrap)."""
    import pandas as pd

    f, _ = open_regular(path)
    with f:
        table = pd.read_csv(f) if suffix == ".csv" else pd.read_parquet(f)
    time, close, open, high, low, volume = (chosen[k] for k in ("time", "close", "open", "high", "low", "volume"))
    missing = {k: v for k, v in chosen.items() if v is not None and v not in table.columns}
    if missing:
        raise MarketDataError(f"{path}: columns {missing} are not in it (it has {list(map(str, table.columns))[:50]})")
    stamp = table[time]
    if stamp.isna().any():
        raise MarketDataError(f"{path}: column {time!r} has a missing time at row {int(np.argmax(stamp.isna()))}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pandas' "could not infer format": parsed one by one
        ts = (stamp.to_numpy(np.int64) if pd.api.types.is_integer_dtype(stamp)
              else pd.to_datetime(stamp, utc=True).to_numpy("datetime64[ns]").astype(np.int64))
    order = np.argsort(ts, kind="stable")

    def column(name: str | None, fallback: np.ndarray) -> np.ndarray:
        return fallback if name is None else table[name].to_numpy(np.float64)[order]

    c = column(close, np.empty(0))
    return Bars(ts_event=ts[order], open=column(open, c), high=column(high, c), low=column(low, c), close=c,
                volume=column(volume, np.zeros_like(c)))
