"""Crash-safe file writes: a reader sees the old file or the new one, never half of either.

The pattern (temp file in the same directory, fsync, `os.replace`, fsync the directory) is what
makes a SIGKILL or power cut at any moment harmless. Checkpoints use the directory version.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
