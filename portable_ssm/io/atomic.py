"""Durable, atomic file replacement: readers of ``path`` see the old file or the new one, never part of one.

:func:`replace_atomically` writes into a fresh temporary file beside ``path`` (a unique name per
call, so concurrent writers never share one), flushes and fsyncs it, renames it over ``path``
(``os.replace``) and fsyncs the directory so the rename survives a power cut. On any failure the
temporary file is removed and the OSError names ``path`` (not the temporary name).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import BinaryIO


def _create_temporary(path: str) -> tuple[str, BinaryIO]:
    """A new, empty file beside ``path`` opened for writing (mode from the umask, as open() gives)."""
    folder, name = os.path.split(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            return tmp, os.fdopen(os.open(tmp, flags, 0o666), "wb")
        except FileExistsError:
            continue


def _fsync_folder(folder: str) -> None:
    """Makes a rename in ``folder`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def replace_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Calls ``write(f)`` on a temporary file and publishes it as ``path`` only once it is complete
    and on disk. OSError (its errno kept) naming ``path`` when the folder is not writable, the disk
    is full or the file too large; nothing is left behind then."""
    path = os.fspath(path)
    tmp = None
    try:
        tmp, f = _create_temporary(path)
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        reason = err.strerror or str(err)
        raise (type(err)(err.errno, f"cannot write {path}: {reason}") if err.errno is not None
               else type(err)(f"cannot write {path}: {reason}")) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _fsync_folder(os.path.dirname(path))
