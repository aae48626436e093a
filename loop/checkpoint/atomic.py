"""Crash-safe file writes: a reader sees the old file or the new one, never half of either.

The pattern (temp file in the same directory, fsync, `os.replace`, fsync the directory) is what
makes a SIGKILL or power cut at any moment harmless. Checkpoints use the directory version.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def naming(path: Path):
    """An OSError inside names `path` if it names no file: a write() the disk refuses names none,
    and the user needs to know where to free space."""
    try:
        yield
    except OSError as e:
        e.filename = e.filename or str(path)
        raise


def write_synced(path: Path, data: bytes) -> None:
    with naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_synced(tmp, data)
    except BaseException as e:  # a full disk, Ctrl-C: the part written goes; the old file is untouched
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            e.filename = str(path)  # the file the user knows, not the temp one
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
