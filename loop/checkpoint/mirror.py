"""Checkpoint mirror: a background copy of each completed checkpoint to `run.mirror` (the way back,
to a machine with no checkpoint: loop/checkpoint/fetch.py).

`run.mirror` is a directory (e.g. a mounted bucket) or any fsspec URL (`memory://b/run`, `file:///x`,
`s3://b/run` with s3fs installed): one fsspec code path for all. Use:
    mirror = Mirror(cfg.run.mirror)       # before anything is written: BadInput if unusable
                                          # (an unknown protocol, a local directory it cannot make)
    mirror.submit(store.save(root, ...), {p.name for p in store.step_dirs(root)})
    mirror.close()                        # end of run: waits for the queued copies
Object stores have no atomic rename, so the manifest is copied after the data files (then `latest`):
a copy cut short has no manifest, is never fetched and is deleted by the next prune. A copy that
still fails after its retries prints one warning and is dropped; nothing here raises into training.
"""
from __future__ import annotations

import json
import posixpath
import queue
import sys
import tempfile
import threading
from functools import partial
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from loop.checkpoint.store import MANIFEST, STEP_DIR, verify
from loop.errors import BadInput


def open_target(target: str):
    try:
        return fsspec.core.url_to_fs(target)
    except (ImportError, ValueError) as e:  # unknown protocol, or its backend (s3fs...) missing
        raise BadInput(f"run.mirror={target}: cannot open it ({e}). Expected a directory path or an "
                       f"fsspec URL whose backend is installed (e.g. pip install s3fs for s3://).")


def step_copies(fs, root: str) -> list[tuple[int, str]]:
    """(step, path) of the step dirs in the mirror, oldest first; [] if the mirror does not exist.
    A symbolic link (a local mirror's) is not one: pruning it would delete what it links to."""
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), e["name"]) for e in entries
                  if (m := STEP_DIR.match(base_name(e["name"]))) and not e.get("islink"))


def base_name(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))


class Mirror:
    """A daemon thread copies the checkpoints queued by `submit`: training never waits on it."""

    def __init__(self, target: str, retries: int = 3, backoff_s: float = 0.5):
        self.target, self.retries, self.backoff_s = target, retries, backoff_s
        self.fs, self.root = open_target(target)
        if isinstance(self.fs, LocalFileSystem):
            # A directory that cannot be made (a typo, a mount that is not there) is bad input at once,
            # not a warning at every checkpoint of a run that thinks it is backed up. Object stores
            # are left to their first copy: they have no directories, and a user allowed to write
            # a prefix may not be allowed to look at the bucket.
            try:
                self.fs.makedirs(self.root, exist_ok=True)
                tempfile.TemporaryFile(dir=self.root).close()  # one it may not write to, likewise
            except OSError as e:
                raise BadInput(f"run.mirror={target}: cannot make the directory or write in it "
                               f"({e.strerror or e}). Expected a directory this user can write to, "
                               f"or an fsspec URL.") from e
        self._queue: queue.Queue = queue.Queue()
        self._abandon = threading.Event()  # set when close() times out: skip what is left
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="checkpoint-mirror", daemon=True)
        self._thread.start()

    def submit(self, ckpt_dir: Path, keep: set[str]) -> None:
        """Queue a copy of a completed checkpoint dir; returns at once. After copying, delete mirrored
        checkpoint dirs whose names are not in `keep` (the local retention set), so the mirror holds
        what the local dir holds."""
        if self._closed:
            print(f"warning: mirror {self.target}: closed, not copying {ckpt_dir}", file=sys.stderr)
        else:  # an unbounded queue: put never blocks
            self._queue.put((Path(ckpt_dir), frozenset(keep)))

    def holds(self, ckpt_dir: Path) -> bool:
        """Whether the mirror holds checkpoint `ckpt_dir` whole: its manifest (copied last) there, byte
        for byte (not another start's checkpoint of the same step). True where the mirror cannot be
        read now: nothing is copied again, its whole copy deleted first, on a guess."""
        try:
            mine = (ckpt_dir / MANIFEST).read_bytes()
        except OSError:  # not whole here either (damaged by hand): nothing to copy
            return True
        try:
            there = self.fs.cat_file(posixpath.join(self.root, ckpt_dir.name, MANIFEST))
        except FileNotFoundError:
            return False
        except Exception:  # noqa: BLE001 -- backends raise their own types (botocore...)
            return True
        return there == mine

    def name_latest(self, ckpt_dir: Path) -> None:
        """Queue the mirror's `latest` naming `ckpt_dir`, after the copies queued before it."""
        if not self._closed:
            self._queue.put((Path(ckpt_dir), None))

    def latest(self) -> str | None:
        """The checkpoint the mirror's `latest` names (the last one copied), or None."""
        try:
            return self.fs.cat_file(posixpath.join(self.root, "latest")).decode(errors="replace")
        except Exception:  # noqa: BLE001 -- none yet, or unreachable now (as in `holds`)
            return None

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for queued copies (at the end of a run) and stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abandon.set()  # no more retries, nothing queued copied; a part copy is never fetched
            print(f"warning: mirror {self.target}: copies still running after {timeout_s}s were "
                  f"abandoned", file=sys.stderr)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None and not self._abandon.is_set():
            ckpt_dir, keep = item
            if keep is None:  # `latest` alone (name_latest)
                self._retrying(self._name, ckpt_dir.name, "could not write latest")
                continue
            if not ckpt_dir.exists():  # pruned by the local retention: a newer checkpoint is queued
                continue
            if reason := verify(ckpt_dir):
                print(f"warning: mirror {self.target}: not copying {ckpt_dir}, it does not verify "
                      f"({reason})", file=sys.stderr)
            else:  # pruned before the copy too: a full mirror would refuse every copy from then on
                keep |= {ckpt_dir.name}
                self._retrying(partial(self._prune, replacing=ckpt_dir.name), keep,
                               "could not delete old checkpoints")
                self._retrying(self._copy, ckpt_dir, f"could not copy {ckpt_dir}")
                self._retrying(self._prune, keep, "could not delete old checkpoints")

    def _retrying(self, fn, arg, what: str) -> None:
        """fn(arg), tried again after a growing wait; the last failure is a warning."""
        for attempt in range(self.retries + 1):
            try:
                return fn(arg)
            except Exception as e:  # noqa: BLE001 -- backends raise their own types (botocore...),
                # and one that escaped would kill the thread and silently end all mirroring
                if attempt == self.retries or self._abandon.wait(self.backoff_s * 2 ** attempt):
                    print(f"warning: mirror {self.target}: {what} ({type(e).__name__}: {e}); "
                          f"training goes on", file=sys.stderr)
                    return

    def _copy(self, ckpt_dir: Path) -> None:
        fs, dest = self.fs, posixpath.join(self.root, ckpt_dir.name)
        try:
            names = json.loads((ckpt_dir / MANIFEST).read_text())["files"]
            if fs.exists(posixpath.join(dest, MANIFEST)):  # a re-copy must not look complete midway
                fs.rm_file(posixpath.join(dest, MANIFEST))
            fs.makedirs(dest, exist_ok=True)  # needed by local dirs; a no-op on object stores
            for name in [*names, MANIFEST]:  # manifest last: its presence means the rest is there
                fs.put_file(str(ckpt_dir / name), posixpath.join(dest, name))
        except FileNotFoundError:
            if ckpt_dir.exists():
                raise
            return  # pruned locally mid-copy (a newer one is queued); the part copy is pruned next
        self._name(ckpt_dir.name)

    def _name(self, name: str) -> None:
        self.fs.pipe_file(posixpath.join(self.root, "latest"), name.encode())

    def _prune(self, keep: frozenset[str], replacing: str = "") -> None:
        """Delete the mirrored checkpoints not in `keep` except the newest complete one (a failing
        mirror keeps something to resume from), and every copy cut short: it holds space and is never
        fetched (no manifest; this thread is the only writer, so none is in progress). `replacing`:
        the step about to be copied again (run.resume=PATH back in time saved it anew); its
        earlier copy goes too, and is not the one kept, since the copy that follows overwrites it."""
        mirrored = [(path, self.fs.exists(posixpath.join(path, MANIFEST)))
                    for _, path in step_copies(self.fs, self.root)]
        newest = next((base_name(path) for path, whole in reversed(mirrored)
                       if whole and base_name(path) != replacing), None)
        for path, whole in mirrored:
            if not whole or base_name(path) not in keep - {replacing} | {newest}:
                if whole:  # manifest first: a delete cut short leaves no valid-looking dir
                    self.fs.rm_file(posixpath.join(path, MANIFEST))
                self.fs.rm(path, recursive=True)
