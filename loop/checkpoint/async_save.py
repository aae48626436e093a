"""Asynchronous checkpoints: copy the state to CPU memory, write it in a background thread.

The training thread pays only for the copy; serialising, hashing, fsync and retention happen while
training goes on. The writing itself is `loop.checkpoint.store.save`, so an async checkpoint is the same
atomic, verified checkpoint, byte for byte (on CPU; from CUDA only the device tag in the pickle
differs, and loading maps to the CPU anyway). Use:
    saver = AsyncSaver(dist.for_thread())  # several processes: the writers' own group (below)
    saver.save(root, step, files, keep_last, meta, best, midway, then=on_done)  # files: state.files(...)
    saver.wait()     # before anything reads or rolls back to the checkpoints, and before exiting
    saver.close()    # end of run (also on preemption): the last checkpoint is on disk after this
A failed background write is re-raised in the training thread by the next save/wait/close.

With several processes every rank saves at the same steps, and the writers of all ranks meet in
store.save's collectives (the manifest over every rank's files, the barrier before `latest`
moves; with FSDP also DCP's write of the shards) on a gloo group of their own, so they never
interleave with the training thread's collectives on the other groups.
"""
from __future__ import annotations

import copy
import ctypes
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from loop.checkpoint import store  # looked up at call time: tests wrap store.save

T = TypeVar("T")


def _memcpy(s: torch.UntypedStorage) -> torch.UntypedStorage:
    # Not s.clone(): its copy_ runs on the intra-op thread pool, and on a busy 2-core machine each
    # parallel copy can wait ~4 ms for a worker (430 ms for a snapshot, against 3 ms for plain memcpy).
    out = torch.UntypedStorage(s.nbytes())
    if s.nbytes():
        ctypes.memmove(out.data_ptr(), s.data_ptr(), s.nbytes())
    return out


def _cpu_copy(t: torch.Tensor, storages: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    if t.layout != torch.strided:  # sparse and the like: no plain storage to share
        return t.detach().to("cpu", copy=True)
    # Copy storages, not tensors: tied weights (wte/lm_head) and views must keep sharing one
    # storage, or torch.save would write them twice and the file would differ from a sync save.
    s = t.untyped_storage()
    if s._cdata not in storages:  # _cdata: the storage's identity, as torch.save keys it
        storages[s._cdata] = s.cpu() if s.device.type != "cpu" else _memcpy(s)  # .cpu() copies
    return torch.empty(0, dtype=t.dtype).set_(storages[s._cdata], t.storage_offset(), t.size(), t.stride())


def snapshot(obj: T) -> T:
    """Deep copy of a nested state (dicts/lists/tuples of tensors and primitives) with every tensor
    copied to CPU memory (detached clones), so training can keep changing the originals."""
    memo: dict[int, Any] = {}
    storages: dict[int, torch.UntypedStorage] = {}

    def seed(x: Any) -> None:  # every tensor reachable through dicts, lists and tuples
        if isinstance(x, torch.Tensor) and id(x) not in memo:
            memo[id(x)] = _cpu_copy(x, storages)
        elif isinstance(x, (dict, list, tuple)):
            for v in x.values() if isinstance(x, dict) else x:
                seed(v)

    seed(obj)
    # deepcopy takes the tensors' CPU copies from the memo and copies everything else as it is:
    # dict subclasses keep their type and attributes (a state_dict's OrderedDict and _metadata),
    # and objects that appear twice stay one object, so the pickle comes out the same.
    return copy.deepcopy(obj, memo)


class AsyncSaver:
    """At most one checkpoint write in flight, in a background thread; errors come back to the caller."""

    def __init__(self, dist=None) -> None:
        self.dist = dist  # loop.distributed.group.Dist for store.save's collectives; None: one process
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    def save(self, root: Path, step: int, files: dict[str, object], keep_last: int, meta: dict,
             keep: set[str] | frozenset[str] = frozenset(), midway: Callable[[], None] | None = None,
             then: Callable[[Path], None] | None = None,
             shards: Callable[[], Callable[[Path], list[str]]] | None = None) -> None:
        """Wait for the previous save to finish (at most one in flight, so checkpoints land in order and
        memory stays bounded), snapshot `files`, then call loop.checkpoint.store.save(root, step, snap, keep_last,
        meta, keep, midway) in a background thread, then `then(path)` (e.g. mirror submit / best pointer).
        `shards` (FSDP), called here after the wait, copies this rank's shards and returns the
        function store.save calls in the thread to write them (loop/distributed/fsdp.py::staged_writer)."""
        self.wait()
        if self._closed:
            raise RuntimeError(f"AsyncSaver: save(step={step}) after close()")
        args = (Path(root), step, snapshot(files), keep_last, snapshot(meta), frozenset(keep), midway,
                self.dist, shards() if shards else None)
        # Not a daemon: if the process exits without close(), the interpreter still finishes the
        # write instead of dropping what may be the last (e.g. the preemption) checkpoint.
        self._thread = threading.Thread(target=self._write, args=(args, then), name=f"checkpoint-save-{step}")
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a write is still in flight (bench/ckpt_stall.py times the steps that overlap it)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the in-flight save is done; re-raise its exception if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None  # raised once: a later save can try again
            raise error

    def close(self) -> None:
        self._closed = True
        self.wait()

    def _write(self, args: tuple, then: Callable[[Path], None] | None) -> None:
        try:
            path = store.save(*args)
            if then is not None:
                then(path)
        except BaseException as e:  # noqa: BLE001 -- every failure must reach the training thread
            self._error = e
