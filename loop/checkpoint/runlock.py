"""One run per run directory: rank 0 holds a lock on `<run.out_dir>/.lock` while it trains; and
no run in a directory that holds files a run writes but that no run made (`refuse_foreign`), nor
inside what another run writes (`refuse_nested`).

A second `train.py` on the same `run.out_dir` (launched twice by mistake, or requeued while the
first job still runs) would interleave its checkpoints and metrics with the first one's. It exits 2
instead, naming the process that holds the directory, and writes nothing.

The lock is a POSIX record lock (`fcntl.lockf`): the kernel drops it when the process that holds it
ends, however it ends (SIGKILL too), so there is never a stale lock to delete by hand; processes
forked from the holder (DataLoader workers) do not hold it; and NFS implements this kind of lock
(untested here: the project's machines have local disks only). It lasts until train.py's main
returns (`release`), however it returns, so a process that goes on (a notebook) does not keep a
finished run's directory from the next run; until then the descriptor stays open, because closing
any descriptor of the file would drop the lock. Where the filesystem has no locks, the run says so
and goes on unguarded.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

from loop.errors import NO_ROOM, BadInput

_held: dict[Path, int | None] = {}  # run dirs this process holds -> the lock's fd (None: no locks)
_unsigned: set[Path] = set()  # of those, where this process made .lock and has written nothing


def hold(out: Path, sign: bool = False) -> None:
    """Lock `out/.lock` until `release()`, or raise BadInput naming the process that
    holds it. Once per directory; one that does not exist yet is locked when called again after it
    is made. `sign`: write this process's name into the file, for the message a second run prints;
    only once the run writes files, so bad input found after locking changes nothing there."""
    out = out.resolve()
    if out not in _held:
        if not out.is_dir():
            return
        refuse_foreign(out)  # before .lock marks it as a run's
        made = not (out / ".lock").exists()
        _held[out] = _lock(out / ".lock")
        if made:
            _unsigned.add(out)
    fd = _held[out]
    if sign:
        _unsigned.discard(out)
    if sign and fd is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)


def claim(out: Path) -> None:
    """Make run directory `out` and hold it, signed: from here on the run writes there; the temp
    copies of its files and checkpoints that a kill mid-write left go."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # where the permission bits say yes and the file system no (/proc, /sys)
        if e.errno in NO_ROOM:
            raise  # a full disk: exit 3, as for any write (train.py)
        raise BadInput(f"config key run.out_dir={out}: cannot make the directory ({e.strerror}); "
                       f"expected a directory this user can write to.") from None
    hold(out, sign=True)
    for d, names in ((out, WRITTEN_ALONE), (out / "checkpoints", ("latest", "best"))):
        for tmp in (t for name in names for t in d.glob(f".{name}.tmp-*")):
            tmp.unlink(missing_ok=True)  # a kill mid-write left it (loop/checkpoint/atomic.py)
    for tmp in (out / "checkpoints").glob(".tmp-*"):  # a checkpoint, or a mirror's copy, cut short
        shutil.rmtree(tmp, ignore_errors=True)


def release() -> None:
    """Unlock every run directory this process holds (closing the descriptor drops the lock). A
    .lock this process made in a directory it then wrote nothing in (bad input) goes too: left, it
    would mark a user's directory as a run's, and a later run there would overwrite their files."""
    for out in _unsigned:
        (out / ".lock").unlink(missing_ok=True)
    _unsigned.clear()
    for fd in _held.values():
        if fd is not None:
            os.close(fd)
    _held.clear()


# What a run writes at the top of run.out_dir (the README's table; tests/test_runlock.py keeps this
# list whole).
RUN_FILES = ("config.yaml", "metadata.json", "metrics.jsonl", "tb", "checkpoints", "summary.json",
             "model.pt", "report.md", "loss_vs_step.png", "loss_vs_tokens.png", "lr.png",
             "tokens_per_s.png", "gpu_memory.png", "profile")
# Of those, the files only the run holding the lock writes (tools.report writes the report too).
WRITTEN_ALONE = ("config.yaml", "metadata.json", "metrics.jsonl", "summary.json", "model.pt")


def is_run(d: Path) -> bool:
    """A directory a run made: every run makes .lock first; one copied without it still has the
    metadata.json a run wrote (any file of that name would mark a user's directory as a run's, and
    the run would overwrite their model.pt)."""
    if (d / ".lock").exists():
        return True
    try:
        meta = json.loads((d / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "code_sha256" in meta


def refuse_foreign(out: Path) -> None:
    """An existing directory that no run made (run.out_dir=. in a project, a home directory) but
    that holds a file a run writes: a run would overwrite it (a model.pt of the user's, say)."""
    if is_run(out):
        return
    clash = [n for n in RUN_FILES if (out / n).exists()]
    if clash:
        raise BadInput(f"run.out_dir {out} holds {', '.join(clash)}, which a run writes, and no run "
                       f"made it (no .lock, nor a metadata.json a run wrote): a run would overwrite "
                       f"them. Expected a new or empty directory, or a run's; give another "
                       f"run.out_dir, or move them.")


def refuse_nested(key: str, path: Path, also: Path | None = None) -> None:
    """run.out_dir or a local run.mirror inside what a run writes (a run directory's `checkpoints/`,
    `tb/`...): one run's pruning would delete what another keeps there (a run inside another's
    step directory; a mirror on a run's own checkpoints). `also`: a run directory not made yet."""
    path = path.resolve()
    also = also and also.resolve()
    for run in path.parents:
        part = path.relative_to(run).parts[0]
        if part in RUN_FILES and (run == also or is_run(run)):
            raise BadInput(f"{key} {path} is inside {run / part}, which the run in {run} writes "
                           f"and prunes; expected a directory outside what a run writes. Give "
                           f"another {key}.")


def _lock(path: Path) -> int | None:
    if path.is_symlink():  # the run writes its name there: never into a file outside out_dir
        raise BadInput(f"run.out_dir {path.parent}: its .lock is a symbolic link (to {os.readlink(path)}); "
                       f"expected a file the run makes. Delete the link, or give another run.out_dir.")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:  # a link made since the check above
            raise
        return _lock(path)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        holder = os.read(fd, 200).decode(errors="replace").strip()
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):  # held by another process
            holder = holder or "a process that has not written its name yet"
            raise BadInput(f"run.out_dir {path.parent}: another run is using it ({holder}); wait for "
                           f"it to end, or give this run another run.out_dir.")
        print(f"note: cannot lock {path} ({e.strerror}): a second run on this run.out_dir would not "
              f"be noticed")
        return None
