"""Writing a run's checkpoints: when one counts, and what follows it.

`Saver.save(step, parts, ...)` writes checkpoint `step`, every rank taking part: never one whose
weights or running statistics are not all finite (a resume would start from them); under FSDP
with every rank's buffers made equal first; either at once or, with train.async_save, copied to CPU
memory and written by a background thread (loop/checkpoint/async_save.py). Once it is complete,
`checkpoints/best` names the best checkpoint and the mirror (run.mirror) gets a copy. The files and
their atomic write: loop/checkpoint/state.py and loop/checkpoint/store.py.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from loop.checkpoint import state, store
from loop.checkpoint.async_save import AsyncSaver
from loop.checkpoint.atomic import atomic_write
from loop.distributed import fsdp
from loop.distributed.group import Dist


class Saver:
    def __init__(self, root: Path, keep_last: int, dist: Dist, async_save: bool, watched: set[str] = frozenset(),
                 sharded: bool = False):
        """`watched`: the buffers checked with the weights (loop/guards/nonfinite.py::watched_buffers);
        `sharded`: the model is FSDP's, saved as every rank's shards."""
        self.root, self.keep_last, self.dist, self.watched, self.sharded = root, keep_last, dist, watched, sharded
        self.writer = AsyncSaver(dist.for_thread()) if async_save else None
        self.mirror = None  # rank 0's loop.checkpoint.mirror.Mirror: it alone writes checkpoints
        self.origin: str | None = None  # where run.resume=PATH began (resume.origin), in each manifest
        self.midway: Callable[[int], None] | None = None  # after a save's first file (faults.*)

    def open_mirror(self, target: str) -> None:
        """Before anything is written: a mirror that cannot be used is bad input."""
        from loop.checkpoint.mirror import Mirror

        self.mirror = Mirror(target)

    def save(self, step: int, parts: dict, run_facts: dict, best_step: int) -> None:
        """Checkpoint `step` of `parts` (loop/checkpoint/state.py), `run_facts` beside them in state.pt;
        `best_step`: the best checkpoint's step, kept by retention and named by `best` (0: none)."""
        model, ema = parts["model"], parts["ema"]
        tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n in self.watched)]
        checks = [torch.isfinite(fsdp.local(t)).all() for t in tensors]
        # On one device: FSDP's CPU offload keeps the weights in host memory, the buffers on the GPU.
        finite = torch.stack([c.to(checks[0].device) for c in checks]).all()
        if self.dist.sum_host([float(not finite)])[0]:  # FSDP: each rank sees only its shards
            print(f"warning: step {step}: weights or buffers are not all finite; no checkpoint written",
                  file=sys.stderr)
            return
        if self.sharded:  # every rank's copy of each buffer the same, whichever one DCP keeps
            for module in (model, *([ema.module] if ema else [])):
                self.dist.sync_buffers(module)
        best = f"step_{best_step:08d}" if best_step else None
        meta = {"config_sha256": run_facts["config_sha256"], "world_size": self.dist.world,
                "resumed_from": self.origin}
        files = state.files(parts, self.dist.rank, self.sharded, run_facts)
        midway = partial(self.midway, step) if self.midway else None
        args = (self.root, step, files, self.keep_last, meta, {best} - {None}, midway)
        then = partial(self.saved, best=best)
        optimizer, averaged = parts["optimizer"], ema.module if ema else None
        if self.writer:  # returns once the state (FSDP: and this rank's shards) is copied
            shards = partial(fsdp.staged_writer, model, optimizer, averaged, self.writer.dist.cpu_group)
            self.writer.save(*args, then=then if self.dist.main else None,
                             shards=shards if self.sharded else None)
        else:
            shards = partial(fsdp.write, fsdp.state_dict(model, optimizer, averaged)) if self.sharded else None
            path = store.save(*args, dist=self.dist, shards=shards)
            if self.dist.main:
                then(path)

    def saved(self, path: Path, best: str | None) -> None:
        """After checkpoint `path` is complete (in the writer thread when saving asynchronously)."""
        self.point(best)
        if self.mirror:  # the best too where only the mirror has it (a resume fetched the newest alone)
            self.mirror.submit(path, {p.name for p in store.step_dirs(self.root)} | ({best} - {None}))

    def point(self, best: str | None) -> None:
        """`checkpoints/best` names checkpoint `best` where it is here; else nothing (none yet, or,
        resumed back in time, one the run before deleted)."""
        if best and (self.root / best).is_dir():
            atomic_write(self.root / "best", best.encode())
        else:
            (self.root / "best").unlink(missing_ok=True)

    def repair(self, path: Path, best_step: int) -> None:
        """At a resume from the newest checkpoint here (rank 0, once out_dir is the run's): what its
        save does after the checkpoint's rename, done again (`latest`, retention, `best`, the
        mirror's copies). A kill in between left the rest undone, for good were that save the
        run's last: pointers naming older checkpoints, one too many (or one half deleted), copies
        the mirror never got."""
        if not ((dirs := store.step_dirs(self.root)) and dirs[-1].resolve() == path.resolve()):
            return
        best = f"step_{best_step:08d}" if best_step else None
        atomic_write(self.root / "latest", path.name.encode())
        store.prune(self.root, self.keep_last, {best} - {None}, path)
        self.point(best)
        if self.mirror:  # the copies it lacks, oldest first, then its `latest`
            keep = {d.name for d in store.step_dirs(self.root)} | ({best} - {None})
            missing = [d for d in store.step_dirs(self.root) if not self.mirror.holds(d)]
            for d in missing:
                self.mirror.submit(d, keep)
            if missing or self.mirror.latest() != path.name:
                self.mirror.name_latest(path)

    def wait(self) -> None:
        """The checkpoint being written, if any, is on disk after this (before reading them)."""
        if self.writer:
            self.writer.wait()

    def close(self) -> None:
        """The last checkpoint on disk, then the mirror's queued copies done."""
        try:
            if self.writer:
                self.writer.close()
        finally:
            if self.mirror:
                self.mirror.close()
