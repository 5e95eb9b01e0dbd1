"""Which files of a model directory may be read: regular files inside it, never anything else.

A checkpoint directory (or a Hugging Face cache snapshot) names the only files a loader reads:

* :func:`regular` tells a missing file (False) from a regular one (True) and refuses a FIFO,
  socket, device or directory in its place (CheckpointError naming the path), so nothing waits
  on a pipe;
* :func:`check_inside` refuses a file whose real path lies outside the directory (a symlink to
  ``/etc/passwd`` named ``config.json``). In a Hub cache snapshot
  (``models--org--name/snapshots/<commit>/``) the allowed places are that snapshot and that
  repository's ``blobs/``, where huggingface_hub links every file; nowhere else in the cache;
* :func:`read_regular` reads a file's bytes after opening it non-blocking and checking, on the
  open descriptor, that it is a regular file no larger than a limit.

Errors name the path and never quote the file's bytes.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any, BinaryIO

from .errors import CheckpointError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def as_path(path: Any, name: str = "path") -> str:
    """``path`` as a str: TypeError naming ``name`` unless it is a str or a str ``os.PathLike``,
    ValueError when it is empty or holds a NUL character."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{name}: expected a str or os.PathLike path, got {type(path).__name__}")
    if not path or "\0" in path:
        raise ValueError(f"{name}: expected a non-empty path without NUL characters, got {path!r}")
    return path


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or other special file"


def regular(path: str) -> bool:
    """True when ``path`` is (or links to) a regular file, False when nothing is there (a dangling
    symlink included); CheckpointError naming ``path`` when something else is."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: {_kind(mode)}, not a regular file")
    return True


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([root, path]) == root


def allowed_roots(folder: str) -> tuple[str, ...]:
    """The real directories files of ``folder`` may resolve into: ``folder`` itself, and when it is
    (inside) a Hub cache snapshot ``<repo>/snapshots/<commit>``, that repository's ``blobs/``."""
    root = os.path.realpath(folder)
    head, parts = root, []
    while True:
        head, tail = os.path.split(head)
        if not tail:
            return (root,)
        parts.append(tail)
        if len(parts) >= 2 and parts[-1] == "snapshots" and _COMMIT.match(parts[-2]) \
                and os.path.basename(head).startswith("models--"):
            return (root, os.path.join(head, "blobs"))


def check_inside(path: str, folder: str, what: str = "the model directory") -> None:
    """CheckpointError naming ``path`` unless its real path lies inside ``folder`` (or, for a Hub
    cache snapshot, inside its repository's ``blobs/``): a symlink out of ``folder`` is refused."""
    real = os.path.realpath(path)
    if not any(_within(real, root) for root in allowed_roots(folder)):
        cache = " or its Hugging Face cache blobs/" if len(allowed_roots(folder)) > 1 else ""
        raise CheckpointError(f"{path}: a symlink that resolves outside {what} {folder}{cache}; only files "
                              f"inside it are read")


def open_regular(path: str | os.PathLike, *, what: str = "", error: type[Exception] = CheckpointError,
                 buffering: int = -1) -> tuple[BinaryIO, int]:
    """``path`` opened for binary reading, and its size. It is opened non-blocking (a FIFO or a
    device, even one swapped in after a check, never hangs the open) and checked on the open
    descriptor: ``error`` naming ``path`` (and ``what`` it should be) unless it is a regular file;
    OSError (e.g. FileNotFoundError) when it cannot be opened at all."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            expected = f"not a {what}: it is " if what else ""
            raise error(f"{path}: {expected}{_kind(info.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (:func:`open_regular`), at most ``limit`` of them;
    CheckpointError naming ``path`` for a non-regular or too large file."""
    f, size = open_regular(path, buffering=0)
    with f:
        if size > limit:
            raise CheckpointError(f"{path}: {size} bytes, more than the {limit} this file may hold")
        chunks, size = [], 0
        while size <= limit:
            chunk = f.read(min(limit + 1 - size, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    if size > limit:  # the file grew since the check
        raise CheckpointError(f"{path}: more than the {limit} bytes this file may hold")
    return b"".join(chunks)
