"""Checkpoints: the full training state, written atomically, verified before use.

Layout under `<out_dir>/checkpoints/`:
    step_00000100/state.pt        model, optimizer, scheduler, scaler, EMA, monitor, progress, config (rank 0)
    step_00000100/rng_rank0.pt    every RNG stream of rank 0 (one file per rank)
    step_00000100/manifest.json   step, sizes and sha256 of the files above; written last
    (train.strategy=fsdp: also __<rank>_0.distcp and .metadata, the sharded model, optimizer and EMA)
    latest                        name of the newest complete checkpoint (for people and tools)
A checkpoint is written into a temp dir, fsynced, then renamed into place, so a kill at any
moment leaves either the complete checkpoint or none. It counts only if its manifest verifies.
A write the system refuses (a full disk, a quota) removes its temp dir and ends the run (GaveUp,
exit 3) with the checkpoints before it whole.
Files hold only tensors and primitives: they load with `torch.load(weights_only=True)`, and a
pickle that would run code is refused.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch

from loop.checkpoint.atomic import atomic_write, fsync_dir, write_synced
from loop.distributed.group import Dist
from loop.errors import NO_ROOM, BadInput, GaveUp

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the bytes of every parameter and buffer of a model's state_dict, in its order.
    Flattened first: a 0-dim buffer (BatchNorm's num_batches_tracked) cannot be viewed as bytes."""
    h = hashlib.sha256()
    for t in state.values():
        h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def step_dirs(root: Path, upto: int | None = None) -> list[Path]:
    """Complete-looking checkpoint dirs, oldest first; with `upto`, those of that step or before."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for step, p in sorted(found) if upto is None or step <= upto]


def verify(path: Path) -> str | None:
    """None if the manifest verifies; else the reason it does not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, want in manifest["files"].items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if f.stat().st_size != want["size"]:
                return f"{name} has {f.stat().st_size} bytes, manifest says {want['size']}"
            if hashlib.sha256(f.read_bytes()).hexdigest() != want["sha256"]:
                return f"{name} does not match its sha256"
        if "state.pt" not in manifest["files"]:  # every checkpoint has one (rank 0's shared state)
            return f"{MANIFEST} lists no state.pt"
        # One copied under a newer step's name would be the newest at every rerun, and retrained.
        if (m := STEP_DIR.match(path.name)) and manifest.get("step") != int(m[1]):
            return f"its name says step {int(m[1])}, its {MANIFEST} step {manifest.get('step')!r}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # AttributeError: "files" no dict
        return f"{MANIFEST} is missing, unreadable or malformed ({type(e).__name__}: {e})"
    return None


def manifest(path: Path) -> dict:
    """A checkpoint's manifest.json ({} if it cannot be read: `verify` says why)."""
    try:
        found = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def newest_valid(root: Path, upto: int | None = None) -> Path | None:
    """The newest checkpoint that verifies (of step `upto` or before); invalid newer ones are
    skipped with a warning."""
    dirs = step_dirs(root, upto)
    for path in reversed(dirs):
        reason = verify(path)
        if reason is None:
            return path
        print(f"warning: skipping checkpoint {path}: {reason}", file=sys.stderr)
    if dirs:
        raise BadInput(f"run.resume=auto: none of the {len(dirs)} checkpoints in {root} verifies "
                       f"(see the warnings above); expected at least one valid checkpoint. Point "
                       f"run.resume at one, or use a new run.out_dir.")
    return None


def load(path: Path, name: str) -> dict:
    f = path / name
    try:
        with open(f, "rb") as fh:
            head = fh.read(4)
    except OSError as e:
        raise BadInput(f"checkpoint file {f}: cannot read it ({e.strerror}).")
    if head[:4] != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save: a zip, or a legacy pickle
        # Unpickling text reads its bytes as opcodes: IndexError or 'Unsupported operand 123'.
        what = f"it starts with {head!r}" if head else "it is empty"
        raise BadInput(f"checkpoint file {f}: not a file torch.save wrote ({what}); expected a "
                       f"checkpoint's state.pt or an exported model.pt.")
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only met something other than tensors/primitives
        raise refused(f, e) from None
    except (RuntimeError, EOFError, OSError) as e:  # e.g. a zip that was truncated when written
        why = str(e).split(". ")[0].strip() or type(e).__name__  # torch's first sentence: its reason
        raise BadInput(f"checkpoint file {f}: not a readable torch checkpoint ({why}); it is cut short or "
                       f"damaged: expected one torch.save wrote whole, e.g. an older checkpoint of the run.")


def refused(f: Path, e: pickle.UnpicklingError) -> BadInput:
    """The error for file `f`, which unpickling refused: it names a class or function to call."""
    why = [ln.strip().split(" Please")[0] for ln in str(e).splitlines() if "Unsupported" in ln][:1]
    why = why or [type(e).__name__]
    return BadInput(f"checkpoint file {f}: refused to load it: it is not a checkpoint of plain "
                    f"tensors and primitives ({why[0]}). Only load checkpoints you trust.")


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save(root: Path, step: int, files: dict[str, object], keep_last: int, meta: dict,
         keep: set[str] = frozenset(), midway: Callable[[], None] | None = None, dist=None,
         shards: Callable[[Path], list[str]] | None = None) -> Path:
    """Write `files` (name -> object for torch.save) as checkpoint `step`; return its path.
    `shards`, if given, is called by every rank with the directory being written, writes its
    part of a sharded state there, and returns the names of the files it wrote.

    With several processes every rank calls this with its own files (rank 0: the shared state and
    its RNG; rank r: its RNG); rank 0 writes the manifest over all of them and moves the directory
    into place after every rank has written. `meta` (config hash, world size) goes into the
    manifest. Afterwards only the newest `keep_last` checkpoints, those in `keep` and this one remain."""
    dist = dist or Dist()
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    try:
        if dist.main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # left by a write that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        _write(tmp, final, step, files, meta, midway, dist, shards)
    except OSError as e:  # a full disk, a quota: the part written goes, the checkpoints before stay
        shutil.rmtree(tmp, ignore_errors=True)
        fix = ("Free space there (a save needs room for one checkpoint more than train.keep_last)"
               if e.errno in NO_ROOM else "Make it a directory this user can write to (with several "
               "nodes, run.out_dir must be on storage they all see: each writes its part there)")
        raise GaveUp(f"checkpoint step {step}: cannot write it in {root} ({e.strerror}). Nothing of "
                     f"it is kept, and the checkpoints before it are whole. {fix} and rerun the same "
                     f"command to continue from the newest.") from e
    if dist.main:
        fsync_dir(root)
        atomic_write(root / "latest", final.name.encode())
        prune(root, keep_last, keep, final)  # only after the new one is complete
    dist.barrier()
    return final


def prune(root: Path, keep_last: int, keep: set[str], final: Path) -> None:
    """Retention: only the newest `keep_last` checkpoints, those named in `keep` and `final` (the
    one just written) remain. Never `final`: a resume back in time (run.resume=PATH) saves steps
    older than those the run before left here."""
    for old in step_dirs(root)[:-keep_last]:
        if old.name not in keep and old != final:
            shutil.rmtree(old, ignore_errors=True)


def _write(tmp: Path, final: Path, step: int, files: dict[str, object], meta: dict,
           midway: Callable[[], None] | None, dist: Dist, shards: Callable[[Path], list[str]] | None) -> None:
    """Every rank's files into `tmp`, then (rank 0) the manifest over them all, and `tmp` -> `final`."""
    entries = {}
    for name in shards(tmp) if shards else []:
        with open(tmp / name, "rb") as f:
            size, digest = os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()
        entries[name] = {"size": size, "sha256": digest}
    for i, (name, obj) in enumerate(files.items()):
        data = to_bytes(obj)
        write_synced(tmp / name, data)
        entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if i == 0 and midway is not None:
            midway()
    gathered = dist.gather_to_main(entries)
    if dist.main:
        manifest = {"step": step, **meta, "files": {k: v for e in gathered for k, v in e.items()}}
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        if final.exists():  # an invalid leftover, or a step saved before a resume from an older
            shutil.rmtree(final)  # checkpoint (run.resume=path): this run's state replaces it
        os.replace(tmp, final)
