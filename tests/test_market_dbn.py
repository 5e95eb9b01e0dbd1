"""The chunked DBN reader against databento-dbn's record-by-record decoder: the same columns, bit for
bit, for OHLCV, trades and MBP-1, plain and zstd, several instruments, any chunk size; and trades
cut into bars chunk by chunk equal the bars of the whole event array."""

from __future__ import annotations

import numpy as np
import pytest

dbn = pytest.importorskip("databento_dbn")
zstandard = pytest.importorskip("zstandard")
from portable_ssm.market import dbn as dbn_files  # noqa: E402
from portable_ssm.market import fixed_to_float, read_bars, read_bars_by_instrument, read_dbn_columns, resample  # noqa: E402


def _metadata(schema: str) -> bytes:
    return dbn.Metadata(dataset="TEST", start=0, stype_in=dbn.SType.RAW_SYMBOL, stype_out=dbn.SType.INSTRUMENT_ID,
                        schema=dbn.Schema.from_str(schema), symbols=["X"]).encode()


def _records(schema: str, n: int, seed: int) -> list:
    """n records of ``schema`` over instruments 1 and 2, time-ordered, some prices undefined."""
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.integers(0, 400_000_000, n))
    ids = rng.integers(1, 3, n)
    px = rng.integers(90_000_000_000, 110_000_000_000, (n, 4))
    px[:, 2] = px[:, 1] + 10_000_000  # MBP-1's ask over its bid
    for column in (0, 1, 2):  # a price, a bid or an ask undefined now and then
        px[rng.random(n) < 0.05, column] = dbn.UNDEF_PRICE
    size = rng.integers(1, 100, n)
    out = []
    for i in range(n):
        if schema == "ohlcv-1s":
            out.append(dbn.OHLCVMsg(dbn.RType.OHLCV_1S, 1, int(ids[i]), int(ts[i]), *map(int, px[i]), int(size[i])))
        elif schema == "trades":
            out.append(dbn.TradeMsg(1, int(ids[i]), int(ts[i]), int(px[i, 0]), int(size[i]), dbn.Action.TRADE,
                                    dbn.Side.BID if i % 2 else dbn.Side.ASK, 0, int(ts[i]) + 5))
        else:
            action = dbn.Action.TRADE if i % 3 == 0 else dbn.Action.ADD
            out.append(dbn.MBP1Msg(1, int(ids[i]), int(ts[i]), int(px[i, 0]), int(size[i]), action, dbn.Side.BID,
                                   0, int(ts[i]) + 5, levels=dbn.BidAskPair(bid_px=int(px[i, 1]), ask_px=int(px[i, 2]),
                                                                              bid_sz=3, ask_sz=4)))
    return out


def _reference(records: list, schema: str, instrument_id: int) -> dict[str, np.ndarray]:
    """The columns, one Python object per record (the reader before the chunked one)."""
    mine = [r for r in records if r.instrument_id == instrument_id]
    out = {"ts_event": np.array([r.ts_event for r in mine], dtype=np.int64)}
    names = {"ohlcv-1s": ("open", "high", "low", "close"), "trades": ("price",),
             "mbp-1": ("price", "bid_px_00", "ask_px_00")}[schema]
    for name in names:
        out[name.removesuffix("_00")] = fixed_to_float(np.array([getattr(r, name) for r in mine], dtype=np.int64))
    if schema == "ohlcv-1s":
        out["volume"] = np.array([r.volume for r in mine], dtype=np.int64)
    else:
        out["size"] = np.array([r.size for r in mine], dtype=np.int64)
        out["side"] = np.array([str(r.side) for r in mine], dtype="<U1")
    if schema == "mbp-1":
        out["action"] = np.array([str(r.action) for r in mine], dtype="<U1")
    return out


@pytest.mark.parametrize("schema", ["ohlcv-1s", "trades", "mbp-1"])
@pytest.mark.parametrize("compressed", [False, True])
def test_chunked_reader_equals_the_record_by_record_decoder(tmp_path, schema, compressed, numpy_path):
    """Through NumPy's ufuncs and through the compiled pass that takes OHLCV chunks (``numpy_path``)."""
    records = _records(schema, 300, seed=len(schema))
    data = _metadata(schema) + b"".join(bytes(r) for r in records)
    path = tmp_path / ("f.dbn.zst" if compressed else "f.dbn")
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if compressed else data)
    for instrument in (1, 2):
        expected = _reference(records, schema, instrument)
        for chunk in (1, 7, 64, 1 << 18):
            got_schema, got = read_dbn_columns(path, instrument_id=instrument, chunk_records=chunk)
            assert got_schema == schema
            for name, values in expected.items():
                assert got[name].dtype == values.dtype, name
                np.testing.assert_array_equal(got[name], values, err_msg=f"{name}, chunk {chunk}")


def test_zstd_files_of_several_frames_read_whole(tmp_path):
    records = _records("trades", 200, seed=3)
    data = _metadata("trades") + b"".join(bytes(r) for r in records)
    compressor = zstandard.ZstdCompressor()
    (tmp_path / "m.dbn.zst").write_bytes(compressor.compress(data[:1000]) + compressor.compress(data[1000:]))
    np.testing.assert_array_equal(read_dbn_columns(tmp_path / "m.dbn.zst", instrument_id=1)[1]["ts_event"],
                                  _reference(records, "trades", 1)["ts_event"])


@pytest.mark.parametrize("schema", ["ohlcv-1s", "trades"])
def test_each_reader_opens_a_file_and_walks_its_zstd_frames_once(tmp_path, monkeypatch, schema):
    data = _metadata(schema) + b"".join(bytes(r) for r in _records(schema, 50, seed=5))
    path = tmp_path / "f.dbn.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    calls = []
    for name in ("open_regular", "_zstd_frames_whole"):
        original = getattr(dbn_files, name)
        monkeypatch.setattr(dbn_files, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    readers = [lambda: read_bars(path, instrument_id=1, interval_ns=10**9),
               lambda: read_bars_by_instrument(path, interval_ns=10**9)]
    if schema == "ohlcv-1s":
        readers.append(lambda: read_dbn_columns(path, instrument_id=1))
    for read in readers:
        calls.clear()
        read()
        assert calls == ["open_regular", "_zstd_frames_whole"]


def _whole_array_bars(records: list, schema: str, instrument_id: int):
    """The bars of ``resample`` (NumPy) over one instrument's whole event arrays: trade prices, or
    MBP-1 mids with the size of trade events only."""
    c = _reference(records, schema, instrument_id)
    if schema == "trades":
        return resample(c["ts_event"], c["price"], c["size"], 1_000_000_000)
    return resample(c["ts_event"], (c["bid_px"] + c["ask_px"]) / 2, np.where(c["action"] == "T", c["size"], 0),
                    1_000_000_000)


@pytest.mark.parametrize("schema", ["trades", "mbp-1"])
@pytest.mark.parametrize("chunk", [1, 3, 50, 1 << 18])
def test_events_cut_into_bars_chunk_by_chunk_equal_the_bars_of_the_whole_array(tmp_path, schema, chunk, numpy_path):
    """Bit for bit, through NumPy's ufuncs and through the compiled cutter (``numpy_path``), one
    instrument chosen out of two or the file's only one."""
    records = _records(schema, 400, seed=9)
    alone = [r for r in records if r.instrument_id == 2]
    (tmp_path / "t.dbn").write_bytes(_metadata(schema) + b"".join(bytes(r) for r in records))
    (tmp_path / "one.dbn").write_bytes(_metadata(schema) + b"".join(bytes(r) for r in alone))
    whole = _whole_array_bars(records, schema, 2)
    for bars in (read_bars(tmp_path / "t.dbn", instrument_id=2, interval_ns=1_000_000_000, chunk_records=chunk),
                 read_bars(tmp_path / "one.dbn", interval_ns=1_000_000_000, chunk_records=chunk)):
        for name in ("ts_event", "open", "high", "low", "close", "volume"):
            np.testing.assert_array_equal(getattr(bars, name), getattr(whole, name), err_msg=name)


def _faulty_file(tmp_path, fault: str, schema: str = "trades"):
    """A 40-record file of instrument 1 with one fault at record 25 (or none), and its header's length."""
    records = _records(schema, 40, seed=5)
    data = bytearray(_metadata(schema))
    head, size = len(data), len(bytes(records[0]))
    for i, r in enumerate(records):
        r.instrument_id = 7 if i == 25 and fault == "second instrument" else 1
        data += bytes(r)
    at = head + size * 25
    if fault == "out of time order":
        data[at + 8:at + 16] = (0).to_bytes(8, "little")
    elif fault == "rtype":
        data[at + 1] = 1
    elif fault == "undefined ts_event":
        data[at + 8:at + 16] = (2**64 - 1).to_bytes(8, "little")
    elif fault == "price beyond 2**53":  # a trade's price, an OHLCV record's open
        data[at + 16:at + 24] = (2**53 + 1).to_bytes(8, "little")
    (tmp_path / "f.dbn").write_bytes(bytes(data))
    return tmp_path / "f.dbn", head


@pytest.mark.parametrize("schema", ["trades", "ohlcv-1s"])
@pytest.mark.parametrize(("fault", "message"), [
    ("out of time order", r"f\.dbn: records out of time order: record 25 has ts_event 0, earlier than record 24's"),
    ("second instrument", r"f\.dbn: holds instruments \[1, 7\]; choose one with instrument_id"),
    ("rtype", r"f\.dbn: record 25 has length (48|56) bytes and rtype 1; a (trades|ohlcv-1s) file holds"),
    ("undefined ts_event", r"f\.dbn: record 25 has an undefined ts_event"),
    ("price beyond 2**53", r"f\.dbn: field '(price|open)': prices: fixed-point magnitudes up to 2\*\*53"),
])
def test_a_faulty_file_gets_the_same_error_on_either_path(tmp_path, numpy_path, schema, fault, message):
    """The compiled passes leave a chunk they would refuse to the NumPy path, whose error names it."""
    from portable_ssm.market import MarketDataError

    path, _ = _faulty_file(tmp_path, fault, schema)
    for chunk in (16, 1 << 18):
        with pytest.raises(MarketDataError, match=message):
            read_bars(path, interval_ns=1_000_000_000, chunk_records=chunk)


def test_the_compiled_passes_leave_a_chunk_they_refuse_and_the_state_untouched(tmp_path):
    from portable_ssm.backends.numpy import kernels
    from portable_ssm.market import layout

    if kernels.library() is None:
        pytest.skip("NumPy's CPU kernels: not usable here (an x86-64 CPU with AVX2 and FMA and a C++ compiler)")
    for schema in ("trades", "ohlcv-1s"):
        for fault in ("none", "out of time order", "second instrument", "rtype", "undefined ts_event",
                      "price beyond 2**53"):
            path, head = _faulty_file(tmp_path, fault, schema)
            records = np.frombuffer(path.read_bytes()[head:], dtype=layout(schema))  # [40]
            state = np.array([-1, -1, -1], dtype=np.int64)
            if schema == "trades":
                got = kernels.event_bars(records, 0, False, -1, 0, 1_000_000_000, state)
            else:
                out = {name: np.zeros(40, dtype) for name, dtype in kernels.OHLCV_COLUMNS.items()}
                got = kernels.ohlcv_columns(records, 32, -1, 0, state, out, 0)
            if fault == "none":
                assert got is not None and state.tolist() == [1, int(records["ts_event"][-1]), 39]
            else:
                assert got is None and state.tolist() == [-1, -1, -1], (schema, fault)
