"""DBN files (plain or zstd) read in bounded memory: chunks of records as NumPy structured arrays.

A DBN file is ``b"DBN"``, a version byte, a little-endian u32 length, that many bytes of metadata
(decoded by databento-dbn), then fixed-size records. Every record opens with the same header::

    length u8 (in 4-byte words) | rtype u8 | publisher_id u16 | instrument_id u32 | ts_event u64

and the schema fixes the rest (:data:`LAYOUTS`; plus ``ts_out`` u64 when the metadata says so).
:func:`iter_records` decompresses (zstd is recognised by its magic number, not the file name)
and cuts the stream into chunks of at most ``chunk_records`` records, each ``np.frombuffer`` over
one reused buffer: no Python object per record, memory of one chunk at a time.

Rules at the door (each a :class:`MarketDataError` naming the file, and the record where one is
at fault): the file must be a regular file (a FIFO is refused unopened); the header must be DBN
and its metadata decodable; every record must have the schema's length and rtype; the stream
must end on a record boundary (a truncated file, or a truncated zstd frame, is refused, never
read short); ``ts_event`` must be defined and non-decreasing over the records read (records out of
time order are refused, not sorted).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from ._checks import MarketDataError, check_int, open_regular

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_METADATA_BYTES = 64 << 20  # symbology mappings can be long; anything beyond this is refused
CHUNK_RECORDS = 1 << 18  # records per chunk: 14 MiB of OHLCV, the bounded working set
MAX_ZSTD_RATIO = 64  # a zstd frame's claimed content size is trusted up to this many times the file's size
_ZSTD_OUT = 1 << 20  # bytes a zstd read decompresses at a time, into one reused buffer

_HEADER = [("length", "u1"), ("rtype", "u1"), ("publisher_id", "<u2"), ("instrument_id", "<u4"), ("ts_event", "<u8")]
_TRADE = [("price", "<i8"), ("size", "<u4"), ("action", "S1"), ("side", "S1"), ("flags", "u1"), ("depth", "u1"),
          ("ts_recv", "<u8"), ("ts_in_delta", "<i4"), ("sequence", "<u4")]
_LEVEL = [("bid_px_00", "<i8"), ("ask_px_00", "<i8"), ("bid_sz_00", "<u4"), ("ask_sz_00", "<u4"),
          ("bid_ct_00", "<u4"), ("ask_ct_00", "<u4")]
#: Record layouts (little-endian, packed as DBN writes them): OHLCV 56 bytes, trades 48, MBP-1 80.
LAYOUTS = {"ohlcv": _HEADER + [("open", "<i8"), ("high", "<i8"), ("low", "<i8"), ("close", "<i8"), ("volume", "<u8")],
           "trades": _HEADER + _TRADE, "mbp-1": _HEADER + _TRADE + _LEVEL}
#: The rtype each schema's records carry.
RTYPES = {"ohlcv-1s": 32, "ohlcv-1m": 33, "ohlcv-1h": 34, "ohlcv-1d": 35, "ohlcv-eod": 36, "trades": 0, "mbp-1": 1}
OHLCV_SCHEMAS = ("ohlcv-1s", "ohlcv-1m", "ohlcv-1h", "ohlcv-1d", "ohlcv-eod")
EVENT_SCHEMAS = ("trades", "mbp-1")


def layout(schema: str, *, ts_out: bool = False) -> np.dtype:
    """The structured dtype of one ``schema`` record (with the trailing ``ts_out`` when set)."""
    fields = LAYOUTS["ohlcv" if schema in OHLCV_SCHEMAS else schema]
    return np.dtype(fields + ([("ts_out", "<u8")] if ts_out else []))


def _plain_blocks(f: BinaryIO, size: int) -> Iterator[bytes]:
    while block := f.read(size):
        yield block


def _zstd_frames_whole(f: BinaryIO, path: str) -> None:
    """MarketDataError unless the file is whole zstd frames (RFC 8878; skippable frames allowed):
    each frame's header and block headers are walked to its end (3 bytes read a block, by pread),
    so a stream cut anywhere, even between two blocks, is refused before anything is read from it."""
    fd, size, at = f.fileno(), os.fstat(f.fileno()).st_size, 0
    cut = MarketDataError(f"{path}: truncated: the zstd stream ends inside a frame")

    def take(n: int) -> bytes:
        data = os.pread(fd, n, at)
        if len(data) < n:
            raise cut
        return data

    while at < size:
        magic = int.from_bytes(take(4), "little")
        if magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its size, then that many bytes
            at += 8 + int.from_bytes(take(8)[4:], "little")
        elif magic != 0xFD2FB528:
            raise MarketDataError(f"{path}: corrupt zstd stream (no frame starts at byte {at})")
        else:
            descriptor = take(5)[4]
            if descriptor & 0x08:
                raise MarketDataError(f"{path}: corrupt zstd stream (a reserved bit set in the frame at byte {at})")
            single, fcs = descriptor >> 5 & 1, descriptor >> 6
            at += 5 + (1 - single) + (0, 1, 2, 4)[descriptor & 3] + (single, 2, 4, 8)[fcs]  # the frame header
            last = False
            while not last:
                block = int.from_bytes(take(3), "little")
                last, kind, length = bool(block & 1), block >> 1 & 3, block >> 3
                if kind == 3:
                    raise MarketDataError(f"{path}: corrupt zstd stream (a reserved block type at byte {at})")
                at += 3 + (1 if kind == 1 else length)  # an RLE block holds one byte
            at += 4 * (descriptor >> 2 & 1)  # the content checksum
        if at > size:
            raise cut


def _zstd_blocks(f: BinaryIO, path: str) -> Iterator[memoryview]:
    """The decompressed stream of one or more zstd frames (:func:`_zstd_frames_whole` first), in
    pieces of at most :data:`_ZSTD_OUT` bytes decompressed into one reused buffer (each valid until
    the next); a MarketDataError for a corrupt or cut stream."""
    try:
        import zstandard
    except ImportError:
        raise ImportError(f"{path} is zstd-compressed: reading it needs zstandard "
                          f"(pip install 'portable_ssm[market]')") from None

    _zstd_frames_whole(f, path)
    buffer = memoryview(bytearray(_ZSTD_OUT))
    try:
        with zstandard.ZstdDecompressor().stream_reader(f, read_size=_ZSTD_OUT, read_across_frames=True,
                                                        closefd=False) as reader:
            while got := reader.readinto(buffer):
                yield buffer[:got]
    except zstandard.ZstdError as err:
        raise MarketDataError(f"{path}: corrupt zstd stream ({err})") from None


def _take(stream: Iterator[bytes], have: bytes, n: int) -> bytes:
    """``have`` extended from ``stream`` to at least ``n`` bytes (fewer only at the end)."""
    parts, total = [have], len(have)
    while total < n:
        block = next(stream, None)
        if block is None:
            break
        parts.append(bytes(block))  # a zstd piece's buffer is reused by the next
        total += len(block)
    return b"".join(parts)


def _metadata(stream: Iterator[bytes], path: str) -> tuple[Any, bytes, int]:
    """The decoded metadata, the bytes read past it, and the header's length (8 + metadata)."""
    import databento_dbn as dbn

    data = _take(stream, b"", 8)
    if len(data) < 8 or data[:3] != b"DBN":
        raise MarketDataError(f"{path}: not a DBN file: it does not start with b'DBN' and a version")
    length = int.from_bytes(data[4:8], "little")
    if length > MAX_METADATA_BYTES:
        raise MarketDataError(f"{path}: not a DBN file: metadata of {length} bytes exceeds {MAX_METADATA_BYTES}")
    data = _take(stream, data, 8 + length)
    if len(data) < 8 + length:
        raise MarketDataError(f"{path}: truncated: the file ends inside its {length}-byte metadata")
    try:
        metadata = dbn.Metadata.decode(data[:8 + length])
    except Exception as err:  # noqa: BLE001 (databento-dbn's decode errors have no common type)
        raise MarketDataError(f"{path}: corrupt DBN metadata ({err})") from None
    return metadata, data[8 + length:], 8 + length


def _schema(metadata: Any, path: str) -> str:
    schema = None if metadata.schema is None else str(metadata.schema.value if hasattr(metadata.schema, "value")
                                                      else metadata.schema)
    if schema not in RTYPES:
        raise MarketDataError(f"{path}: schema {schema!r} is not read here; expected one of {tuple(RTYPES)}")
    return schema


def check_records(records: np.ndarray, schema: str, first: int, path: str) -> None:
    """Every record has the schema's length and rtype, and a defined ts_event."""
    words, rtype = records.dtype.itemsize // 4, RTYPES[schema]
    bad = np.flatnonzero((records["length"] != words) | (records["rtype"] != rtype))
    if bad.size:
        r = records[bad[0]]
        raise MarketDataError(f"{path}: record {first + int(bad[0])} has length {int(r['length']) * 4} bytes and "
                              f"rtype {int(r['rtype'])}; a {schema} file holds {words * 4}-byte records of "
                              f"rtype {rtype}")
    undefined = np.flatnonzero(records["ts_event"] > np.uint64(2**63 - 1))
    if undefined.size:
        raise MarketDataError(f"{path}: record {first + int(undefined[0])} has an undefined ts_event")


def iter_records(path: str | os.PathLike, *,
                 chunk_records: int = CHUNK_RECORDS) -> Iterator[tuple[str, int, np.ndarray]]:
    """``(schema, index of the chunk's first record, records)`` for each chunk of at most
    ``chunk_records`` records of a DBN file (plain or zstd), ``records`` a read-only structured
    array of :func:`layout` that is valid until the next chunk is read (plain and zstd files are
    read into one reused buffer: copy what you keep). Checks each record's length, rtype and ts_event (see
    the module docstring); the order of ts_event is the caller's to check (:class:`TimeOrder`)."""
    chunk_records = check_int("chunk_records", chunk_records, minimum=1)
    with DbnFile(path) as dbn:
        for first, records in dbn.records(chunk_records):
            check_records(records, dbn.schema, first, dbn.path)
            yield dbn.schema, first, records


class DbnFile:
    """One DBN file (plain or zstd) opened for one read: its header checked and decoded once
    (a zstd file's frames walked first, :func:`_zstd_frames_whole`), then :meth:`records`. A
    context manager; errors as :func:`iter_records`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file, self._size = open_regular(self.path)
        try:
            self.schema, self.dtype, self.compressed, self._stream, self._head = _open_stream(self._file, self.path)
        except BaseException:
            self._file.close()
            raise
        self._header = self._file.tell()  # a plain file is left just past its metadata

    def __enter__(self) -> DbnFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def capacity(self) -> tuple[int, bool]:
        """``(records, exact)``: a plain file holds at most ``records`` (from its size; ``exact``
        True); a zstd one about that many when its first frame records its content size (capped at
        :data:`MAX_ZSTD_RATIO` times the file's size, a claim is not trusted), else 0 (``exact``
        False: a hint to allocate by, the reader grows past it)."""
        if not self.compressed:
            return max(self._size - self._header, 0) // self.dtype.itemsize, True
        content = _frame_content_size(os.pread(self._file.fileno(), 18, 0))
        return min(content or 0, self._size * MAX_ZSTD_RATIO) // self.dtype.itemsize, False

    def records(self, chunk_records: int = CHUNK_RECORDS) -> Iterator[tuple[int, np.ndarray]]:
        """``(index of the chunk's first record, records)`` as :func:`iter_records` gives them,
        without the records' checks, which the caller makes (:func:`check_records`, or a compiled
        pass that leaves any chunk it refuses to it); the stream's own (truncation) are made here.
        Read once: the stream is not rewound."""
        chunk_records = check_int("chunk_records", chunk_records, minimum=1)
        size = self.dtype.itemsize
        blocks = (_fill(itertools.chain([self._head], self._stream), size * chunk_records) if self.compressed
                  else _read_into(self._file, size * chunk_records))
        first, rest = 0, b""
        for data in blocks:
            n = len(data) // size  # whole records: every block but the last is a multiple
            records = np.frombuffer(data, dtype=self.dtype, count=n)
            records.flags.writeable = False
            rest = data[n * size:]
            if n:
                yield first, records
                first += n
        if len(rest):
            raise MarketDataError(f"{self.path}: truncated: {len(rest)} bytes of a partial {size}-byte "
                                  f"record {first} at the end")


def _read_into(f: BinaryIO, size: int) -> Iterator[memoryview]:
    """The rest of a plain file in blocks of ``size`` bytes (the last shorter), each read into one
    reused buffer: no allocation or copy per block."""
    buffer = memoryview(bytearray(size))
    while True:
        done = 0
        while done < size:
            got = f.readinto(buffer[done:])
            if not got:
                break
            done += got
        if done:
            yield buffer[:done]
        if done < size:
            return


def _open_stream(f: BinaryIO, path: str) -> tuple[str, np.dtype, bool, Iterator[bytes], bytes]:
    """The schema, record dtype, whether the file is zstd, the rest of the decompressed stream and
    the bytes already read past the metadata (a plain file is left positioned just past it)."""
    compressed = f.read(4) == ZSTD_MAGIC
    f.seek(0)
    stream = _zstd_blocks(f, path) if compressed else _plain_blocks(f, 1 << 16)
    metadata, rest, header = _metadata(stream, path)
    if not compressed:
        f.seek(header)
        rest = b""
    schema = _schema(metadata, path)
    return schema, layout(schema, ts_out=bool(metadata.ts_out)), compressed, stream, rest


def _frame_content_size(header: bytes) -> int | None:
    """The decompressed size a zstd frame header records, or None (unknown or unreadable)."""
    import zstandard

    try:
        content = zstandard.get_frame_parameters(header).content_size
    except zstandard.ZstdError:
        return None
    return None if content in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) else content


def _fill(stream: Iterator[bytes], size: int) -> Iterator[memoryview]:
    """``stream`` regrouped into blocks of ``size`` bytes (the last one shorter), each copied once
    into one reused buffer: no join, no slice copy, no allocation per block."""
    buffer, done = memoryview(bytearray(size)), 0
    for piece in stream:
        piece, start = memoryview(piece), 0
        while start < len(piece):
            take = min(size - done, len(piece) - start)
            buffer[done:done + take] = piece[start:start + take]
            done, start = done + take, start + take
            if done == size:
                yield buffer
                done = 0
    if done:
        yield buffer[:done]


class TimeOrder:
    """Checks that ``ts_event`` never decreases across the chunks of one file (carrying the last one)."""

    def __init__(self, path: str) -> None:
        self.path, self.last, self.last_index = path, -1, -1

    def check(self, ts: np.ndarray, index: np.ndarray) -> None:
        """``ts [n]`` int64 of the records at file positions ``index [n]``: MarketDataError naming
        the first record earlier than the one before it."""
        if ts.size == 0:
            return
        back = np.flatnonzero(ts[1:] < ts[:-1])
        if ts[0] < self.last:
            bad, before, before_index = 0, self.last, self.last_index
        elif back.size:
            bad = int(back[0]) + 1
            before, before_index = int(ts[bad - 1]), int(index[bad - 1])
        else:
            self.last, self.last_index = int(ts[-1]), int(index[-1])
            return
        raise MarketDataError(f"{self.path}: records out of time order: record {int(index[bad])} has ts_event "
                              f"{int(ts[bad])}, earlier than record {before_index}'s {before}; sort the file by "
                              f"ts_event first")
