"""The cache of compiled kernel libraries: a library is trusted only after it was written whole.

A library is stored as ``<name>.so`` beside a record ``<name>.so.sha256`` (its size and sha256),
each written to a temporary file in the cache folder, fsync'd and renamed into place, the record
after the library, then the folder fsync'd: a process killed or a disk filled mid-write leaves no
file under the final name that could pass the check. :func:`damage` checks an entry before it is
loaded: both are regular files (not links, FIFOs or folders; opened without following a link and
without blocking) of this user's that no one else may write, the library's size and sha256 are the
record's and (on Linux) its ELF program headers and loaded segments lie inside the file. A
truncated library loaded through ``dlopen`` maps pages past the file's end and kills the process
with SIGBUS at the first call into them, so nothing here loads a file that fails the check. :func:`locked` serialises
the builds of one entry across processes (where ``fcntl`` exists), so
processes building at once do not write one library's record beside another's file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The environment variable naming the folder the built libraries are cached in.
CACHE_ENV = "PORTABLE_SSM_CACHE"
#: The record's suffix, after the library's name.
RECORD_SUFFIX = ".sha256"
#: The most bytes a record may hold (``<size> <64 hex digits>\n``).
RECORD_MAX = 128
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where built libraries are kept: ``$PORTABLE_SSM_CACHE``, else ``$XDG_CACHE_HOME/portable_ssm``
    (``~/.cache/portable_ssm``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "portable_ssm"


def record_path(library: Path) -> Path:
    """The record (size and sha256) kept beside ``library``."""
    return library.with_name(library.name + RECORD_SUFFIX)


def _open_owned(path: Path) -> tuple[int, os.stat_result]:
    """``path`` opened for reading without following a link or blocking (a FIFO), with its status;
    OSError (naming what is wrong) where it is not a regular file of this user's that no one else may
    write."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        status = os.fstat(fd)
        owner = os.getuid() if hasattr(os, "getuid") else status.st_uid
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if status.st_uid != owner or status.st_mode & 0o022:
            raise OSError(f"{path.name} is another user's or writable by others")
    except BaseException:
        os.close(fd)
        raise
    return fd, status


def _digest(fd: int, size: int) -> str:
    """The sha256 of the first ``size`` bytes read from ``fd``."""
    h = hashlib.sha256()
    left = size
    while left > 0:
        chunk = os.read(fd, min(_CHUNK, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def _elf_problem(fd: int, size: int) -> str | None:
    """What makes the file at ``fd`` (``size`` bytes) no whole ELF library for Linux's loader to map
    (no ELF header; program headers or a loaded segment reaching past its end), or None. A second
    check beside the sha256: a record written for a truncated file still cannot make it loaded.
    Other systems' formats are not parsed."""
    if not sys.platform.startswith("linux"):
        return None
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF":
        return "not an ELF library"
    if head[4:6] != b"\x02\x01":  # not 64-bit little-endian: left to the loader
        return None
    phoff, = struct.unpack_from("<Q", head, 0x20)
    entry_size, count = struct.unpack_from("<HH", head, 0x36)
    if entry_size < 56 or phoff + entry_size * count > size:
        return "its program headers reach past its end"
    table = os.pread(fd, entry_size * count, phoff)
    for i in range(count):
        kind, = struct.unpack_from("<I", table, i * entry_size)
        offset, = struct.unpack_from("<Q", table, i * entry_size + 8)
        length, = struct.unpack_from("<Q", table, i * entry_size + 32)
        if kind == 1 and offset + length > size:  # PT_LOAD
            return "a loaded segment reaches past its end"
    return None


def damage(library: Path) -> str | None:
    """Why the cached ``library`` may not be loaded ("missing" where neither it nor its record
    exists), or None where it and its record are whole, this user's and agree."""
    record = record_path(library)
    if not os.path.lexists(library) and not os.path.lexists(record):
        return "missing"
    try:
        fd, _ = _open_owned(record)
        try:
            text = os.read(fd, RECORD_MAX + 1)
        finally:
            os.close(fd)
    except OSError as error:
        return f"its record {record.name} is unreadable ({error.strerror or error})"
    fields = text.decode("ascii", "replace").split()
    if len(text) > RECORD_MAX or len(fields) != 2 or not fields[0].isdigit() or len(fields[1]) != 64:
        return f"its record {record.name} is malformed"
    size, want = int(fields[0]), fields[1].lower()
    try:
        fd, status = _open_owned(library)
        try:
            if status.st_size != size:
                return f"{status.st_size} bytes where {size} were written"
            if _digest(fd, size) != want:
                return "its contents differ from the sha256 written with it"
            return _elf_problem(fd, size)
        finally:
            os.close(fd)
    except OSError as error:
        return f"unreadable ({error.strerror or error})"


def _write_durably(target: Path, data: bytes, mode: int) -> None:
    """``data`` into ``target``: a temporary file beside it, fsync'd, then renamed over it (any file,
    link or FIFO there is replaced; a folder there raises OSError)."""
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _sync_folder(folder: Path) -> None:
    """fsync ``folder`` so the renames in it survive a crash (where folders can be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def store(library: Path, data: bytes) -> None:
    """``data`` (a built library) as the cached ``library`` and then its record, each durably; an
    empty folder in the library's place is removed first (any other folder: OSError)."""
    for path in (library, record_path(library)):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
    _write_durably(library, data, 0o755)
    _write_record(library, data)


def _write_record(library: Path, data: bytes) -> None:
    _write_durably(record_path(library), f"{len(data)} {hashlib.sha256(data).hexdigest()}\n".encode(), 0o644)
    _sync_folder(library.parent)


def record(library: Path) -> None:
    """The record of ``library`` as it is now (a library another tool wrote whole, as torch's
    ``cpp_extension`` does), written durably beside it; OSError where it is no regular file of this
    user's that no one else may write."""
    fd, status = _open_owned(library)
    try:
        data = os.pread(fd, status.st_size, 0)
    finally:
        os.close(fd)
    _write_record(library, data)


@contextlib.contextmanager
def locked(library: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``<library>.lock`` (where ``fcntl`` exists; else nothing) for the
    block, so one process at a time builds and stores ``library``."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: builds at once may still race, each store stays whole
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(library.with_name(library.name + ".lock"), flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{library.name}.lock is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
