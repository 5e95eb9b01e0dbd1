"""The chunked DBN reader against databento-dbn's record-by-record decoder: the same columns, bit for
bit, for OHLCV, trades and MBP-1, plain and zstd, several instruments, any chunk size; and trades
cut into bars chunk by chunk equal the bars of the whole event array."""

from __future__ import annotations

import numpy as np
import pytest

dbn = pytest.importorskip("databento_dbn")
zstandard = pytest.importorskip("zstandard")
from portable_ssm.market import fixed_to_float, read_bars, read_dbn_columns, resample  # noqa: E402


def _metadata(schema: str) -> bytes:
    return dbn.Metadata(dataset="TEST", start=0, stype_in=dbn.SType.RAW_SYMBOL, stype_out=dbn.SType.INSTRUMENT_ID,
                        schema=dbn.Schema.from_str(schema), symbols=["X"]).encode()


def _records(schema: str, n: int, seed: int) -> list:
    """n records of ``schema`` over instruments 1 and 2, time-ordered, some prices undefined."""
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.integers(0, 400_000_000, n))
    ids = rng.integers(1, 3, n)
    px = rng.integers(90_000_000_000, 110_000_000_000, (n, 4))
    px[rng.random(n) < 0.05, 0] = dbn.UNDEF_PRICE
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
                                   0, int(ts[i]) + 5, levels=dbn.BidAskPair(bid_px=int(px[i, 1]),
                                                                              ask_px=int(px[i, 1]) + 10_000_000,
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
def test_chunked_reader_equals_the_record_by_record_decoder(tmp_path, schema, compressed):
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


@pytest.mark.parametrize("chunk", [1, 3, 50, 1 << 18])
def test_trades_cut_into_bars_chunk_by_chunk_equal_the_bars_of_the_whole_array(tmp_path, chunk):
    records = _records("trades", 400, seed=9)
    (tmp_path / "t.dbn").write_bytes(_metadata("trades") + b"".join(bytes(r) for r in records))
    columns = _reference(records, "trades", 2)
    whole = resample(columns["ts_event"], columns["price"], columns["size"], 1_000_000_000)
    bars = read_bars(tmp_path / "t.dbn", instrument_id=2, interval_ns=1_000_000_000, chunk_records=chunk)
    for name in ("ts_event", "open", "high", "low", "close", "volume"):
        np.testing.assert_array_equal(getattr(bars, name), getattr(whole, name), err_msg=name)


@pytest.mark.parametrize("schema", ["ohlcv-1s", "trades", "mbp-1"])
def test_every_instruments_bars_from_one_pass_equal_reading_each_alone(tmp_path, schema):
    from portable_ssm.market import read_bars_by_instrument

    records = _records(schema, 500, seed=11)
    (tmp_path / "f.dbn").write_bytes(_metadata(schema) + b"".join(bytes(r) for r in records))
    interval = None if schema == "ohlcv-1s" else 1_000_000_000
    every = read_bars_by_instrument(tmp_path / "f.dbn", interval_ns=interval, chunk_records=37)
    assert sorted(every) == [1, 2]
    for instrument, bars in every.items():
        alone = read_bars(tmp_path / "f.dbn", instrument_id=instrument, interval_ns=interval)
        for name in ("ts_event", "open", "high", "low", "close", "volume"):
            np.testing.assert_array_equal(getattr(bars, name), getattr(alone, name), err_msg=f"{instrument} {name}")
    assert list(read_bars_by_instrument(tmp_path / "f.dbn", instrument_ids=[2], interval_ns=interval)) == [2]


def test_one_instrument_out_of_time_order_is_refused_naming_its_record(tmp_path):
    from portable_ssm.market import MarketDataError, read_bars_by_instrument

    rows = [(1, 10), (2, 5), (1, 20), (2, 4)]  # instrument 2 steps back at record 3; the file as a whole too
    data = _metadata("ohlcv-1s") + b"".join(bytes(dbn.OHLCVMsg(dbn.RType.OHLCV_1S, 1, i, ts, 5, 5, 5, 5, 1))
                                            for i, ts in rows)
    (tmp_path / "o.dbn").write_bytes(data)
    with pytest.raises(MarketDataError, match="record 3 has ts_event 4, earlier than record 1's 5"):
        read_bars_by_instrument(tmp_path / "o.dbn")



def test_a_zstd_frames_content_size_sizes_the_columns_and_a_larger_claim_is_capped(tmp_path):
    from portable_ssm.market import MarketDataError
    from portable_ssm.market.dbn import MAX_ZSTD_RATIO, record_capacity

    records = _records("ohlcv-1s", 300, seed=4)
    data = _metadata("ohlcv-1s") + b"".join(bytes(r) for r in records)
    for name, sized in (("sized", True), ("unsized", False)):
        path = tmp_path / f"{name}.dbn.zst"
        path.write_bytes(zstandard.ZstdCompressor(write_content_size=sized).compress(data))
        assert record_capacity(path) == ((len(data) // 56 if sized else 0), False)  # a hint (header included)
        np.testing.assert_array_equal(read_dbn_columns(path, instrument_id=2)[1]["open"],
                                      _reference(records, "ohlcv-1s", 2)["open"])
    # 10^5 zero records compress far beyond the ratio trusted: the hint is capped by the file's size
    path = tmp_path / "zeros.dbn.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(data + bytes(56 * 10**5)))
    assert record_capacity(path) == (path.stat().st_size * MAX_ZSTD_RATIO // 56, False)
    assert record_capacity(path)[0] < 10**5
    with pytest.raises(MarketDataError, match="record 300 has length 0 bytes"):
        read_dbn_columns(path)


def test_a_zstd_stream_without_its_size_grows_its_columns_by_a_fixed_step_and_reads_every_record(tmp_path,
                                                                                                monkeypatch):
    """Past its size hint the columns grow by GROW_RECORDS, not doubling (``resize`` zero-fills what it
    adds, so a doubling made up to the output's size resident again); the records are all there."""
    from portable_ssm.market import bars as bars_module

    records = _records("ohlcv-1s", 300, seed=5)
    path = tmp_path / "streamed.dbn.zst"
    path.write_bytes(zstandard.ZstdCompressor(write_content_size=False).compress(
        _metadata("ohlcv-1s") + b"".join(bytes(r) for r in records)))
    monkeypatch.setattr(bars_module, "GROW_RECORDS", 5)
    seen, real = [], bars_module._Columns.add
    monkeypatch.setattr(bars_module._Columns, "add",
                        lambda self, c: real(self, c) or seen.append((self.n, self.capacity)))
    for instrument in (1, 2):
        seen.clear()
        columns = read_dbn_columns(path, instrument_id=instrument, chunk_records=16)[1]
        assert len(seen) > 5 and all(capacity <= n + 5 for n, capacity in seen[1:])  # a step past at most
        want = _reference(records, "ohlcv-1s", instrument)
        for name, values in want.items():
            np.testing.assert_array_equal(columns[name], values, err_msg=f"{instrument} {name}")
