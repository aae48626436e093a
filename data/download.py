"""Fetch a data file once, verify it against a pinned sha256, and keep it in the cache.

    from data.download import fetch
    path = fetch("input.txt", [url, mirror_url], "86c4e6aa...", Path("data/cache/shakespeare"))

A file already in place with the pinned hash is used as is: no network access at all. Otherwise each
URL is tried in order, streamed into a temp file next to the destination while it is hashed, fsynced,
checked, and only then renamed into place, so a kill, a dropped connection or a wrong file never
leaves anything half-written under the final name (the temp file is removed on every failure). When
every URL fails, `BadInput` (exit 2) lists each URL with its reason and says where to put the file by
hand, for machines that cannot reach the internet. A full disk is not the URL's fault: its OSError
goes up at once (train.py: exit 3, free space in data.cache_dir).
"""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

from loop.checkpoint.atomic import fsync_dir
from loop.config.paths import writable_dir
from loop.errors import NO_ROOM, BadInput

TIMEOUT_S = 30.0  # per socket operation (connect, each read): a stalled server fails, a slow one not
CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch(name: str, urls: list[str], sha256: str, dest_dir: Path, origin: str = "",
          timeout: float = TIMEOUT_S) -> Path:
    """`dest_dir/name` with content hashing to `sha256`: from the cache, else from the first URL that
    serves the right bytes. Raises BadInput naming every URL tried and the hand-placement path, with
    `origin` (default: the first URL) as the place to download the file from by hand."""
    dest = Path(dest_dir) / name
    failures = []
    if dest.is_file():
        got = sha256_of(dest)
        if got == sha256:
            return dest
        failures.append(f"the cached {dest} (checksum mismatch: got {got}, expected {sha256})")
    try:
        writable_dir("config key data.cache_dir", str(dest.parent))  # a read-only one: downloaded only
    except BadInput as e:  # a file placed by hand that does not match is the cause to name first
        raise BadInput(f"{e} {'; '.join(failures)}." if failures else str(e)) from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    for url in urls:
        print(f"downloading {url} -> {dest}")
        try:
            _download(url, dest, sha256, timeout)
            return dest
        except _Failed as e:
            failures.append(f"{url} ({e})")
            print(f"  failed: {e}")
    raise BadInput(
        f"data: cannot fetch {name}; tried {'; '.join(failures)}. Download it yourself from "
        f"{origin or urls[0]} and place it at {dest.resolve()} (sha256 {sha256}), "
        f"or set data.url to a mirror that serves it.")


class _Failed(Exception):
    """One URL did not give the right file; the message is the reason shown to the user."""


def _download(url: str, dest: Path, sha256: str, timeout: float) -> None:
    # The same directory (os.replace is atomic), under a name no other process has (another PID
    # namespace's process sharing the cache has the same PID): created here, never another's.
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        digest = hashlib.sha256()
        got = 0
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "xb") as f:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                f.write(chunk)
                got += len(chunk)
            f.flush()
            os.fsync(f.fileno())
            length = response.headers.get("Content-Length", "")
        if length.isdigit() and got < int(length):  # read(n) returns short, no IncompleteRead
            raise _Failed(f"the connection closed after {got:,} of {int(length):,} bytes")
        if digest.hexdigest() != sha256:
            raise _Failed(f"checksum mismatch: got {digest.hexdigest()}, expected {sha256}")
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except urllib.error.HTTPError as e:
        raise _Failed(f"HTTP {e.code} {e.reason}")
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
        # HTTPException: the server hung up mid-file; ValueError: a malformed URL
        if isinstance(e, OSError) and e.errno in NO_ROOM:  # the disk, not the URL: the next URL
            e.filename = str(dest)  # would fail too (train.py: exit 3); a failed write names no file
            raise
        raise _Failed(_reason(e))
    finally:
        tmp.unlink(missing_ok=True)


def _reason(e: Exception) -> str:
    """A short, plain reason for a network failure."""
    cause = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(cause, socket.gaierror):
        return f"offline or unknown host: {cause.strerror}"
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, TimeoutError):
        return "timed out"
    return getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
