"""The way back from the checkpoint mirror (loop/checkpoint/mirror.py): with no local checkpoint
(a new machine), `fetch_latest(cfg.run.mirror, root)` copies in the newest mirrored one that verifies.
A mirrored copy without its manifest was cut short (the manifest is copied last): it is passed over.
"""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import sys
from pathlib import Path

from loop.checkpoint.atomic import atomic_write, fsync_dir
from loop.checkpoint.mirror import base_name, open_target, step_copies
from loop.checkpoint.store import MANIFEST, step_dirs, verify
from loop.errors import BadInput

INCOMPLETE = f"incomplete (no {MANIFEST}; a copy was cut short)"  # skipped: never a copy to miss


def listed(target: str) -> tuple:
    """(fs, root, the step dirs mirrored there, oldest first); BadInput if it cannot be listed."""
    fs, root = open_target(target)
    try:
        return fs, root, step_copies(fs, root)
    except OSError as e:  # e.g. a file where the directory should be: before anything is written
        raise BadInput(f"run.mirror={target}: cannot list it ({e.strerror or e}). Expected a "
                       f"directory path or an fsspec URL this machine can read.") from e


def fetch_latest(target: str, local_root: Path, before_write=lambda: None, wanted=lambda _: True) -> Path | None:
    """Copy the newest mirrored checkpoint that verifies into local_root (atomic: temp dir then rename,
    so local_root/step_XXXXXXXX appears complete or not at all) and return its local path; None if the
    mirror holds none, or if `wanted` (of the verified copy) says no to it. Invalid mirrored ones
    are skipped with a warning on stderr naming them; if none of those with a manifest can be
    fetched, BadInput. `before_write` is called before anything is written (the trainer makes and
    locks run.out_dir)."""
    fs, root, mirrored = listed(target)
    local_root = Path(local_root)
    if mirrored:
        before_write()
    refused = 0
    for _, src in reversed(mirrored):
        name = base_name(src)
        final, tmp = local_root / name, local_root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            reason = _download(fs, src, tmp)
        except (OSError, ValueError, KeyError, TypeError) as e:
            reason = f"{type(e).__name__}: {e}"
        reason = reason or verify(tmp)
        if reason is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"warning: skipping mirrored checkpoint {target}/{name}: {reason}", file=sys.stderr)
            refused += reason != INCOMPLETE
            continue
        if not wanted(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        shutil.rmtree(final, ignore_errors=True)  # a leftover at this step: replace it
        os.replace(tmp, final)
        fsync_dir(local_root)
        if step_dirs(local_root)[-1] == final:  # never point `latest` back at an older step
            atomic_write(local_root / "latest", name.encode())
        # Said: the resume line names the local copy, and a mirror two runs share hands one the
        # other's checkpoints without a word otherwise.
        print(f"note: no valid checkpoint in {local_root}; {name} fetched from run.mirror={target} (a "
              f"mirror holds one run's checkpoints: give each run its own)")
        return final
    if refused:  # a fresh start would delete them from the mirror: an error (a credential, a full
        # disk) must not cost the run its checkpoints, as none verifying locally does not
        with contextlib.suppress(OSError):
            local_root.rmdir()  # made for the fetch; empty again
        raise BadInput(f"run.mirror={target}: none of its {refused} whole checkpoints could be fetched "
                       f"or verifies (see the warnings above); expected at least one valid checkpoint, "
                       f"as a fresh start would delete them from the mirror. Fix what the warnings "
                       f"name, or give the run a new run.mirror.")
    return None


def _download(fs, src: str, tmp: Path) -> str | None:
    """Copy one mirrored checkpoint into tmp, fsynced; the reason it is unusable, or None."""
    if not fs.exists(posixpath.join(src, MANIFEST)):
        return INCOMPLETE
    names = json.loads(fs.cat_file(posixpath.join(src, MANIFEST)))["files"]
    for name in [*names, MANIFEST]:
        if name != posixpath.basename(name) or name in ("", ".", ".."):  # no writing outside tmp
            return f"{MANIFEST} names a file outside its dir: {name!r}"
        with fs.open(posixpath.join(src, name), "rb") as f, open(tmp / name, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
    fsync_dir(tmp)
    return None
