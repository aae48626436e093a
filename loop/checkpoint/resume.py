"""Which checkpoint a run starts from, decided before anything in out_dir is written; `start_from`
puts it into the run's parts (or run.init_from's weights, on a fresh start), then claims out_dir.

    run.resume=auto   newest valid checkpoint in out_dir/checkpoints (or, if that dir holds none or
                      none there verifies, the newest valid one in run.mirror); none at all -> a
                      fresh start
    run.resume=never  fresh start; refused if out_dir already holds checkpoints it would overwrite
    run.resume=PATH   that checkpoint dir, which must verify (checkpoints/latest or /best: the
                      one it names); or, once this run has saved since starting there, its
                      newest checkpoint from PATH on (`continued`): the same command reruns on,
                      also where the latest or best it named has moved since, and on a new disk
                      from the mirror's newest, where that one started at PATH
    run.init_from=PATH (fresh starts only) model weights from that checkpoint (or exported
                      model.pt), nothing else (loop/checkpoint/weights.py)
"""
from __future__ import annotations

from pathlib import Path

from loop.checkpoint import runlock, store
from loop.errors import BadInput


def choose_locked(out: Path, run, say=print) -> Path | None:
    """`choose` for run directory `out` (run: the config's run section), with `out` locked first
    (loop/checkpoint/runlock.py): a second run stops before reading a checkpoint the first may be
    writing. A fetch from the mirror makes (and claims) `out`."""
    runlock.hold(out)
    return choose(run.resume, out / "checkpoints", run.mirror, lambda: runlock.claim(out), say)


def start_from(path: Path | None, parts: dict, cfg, dist, metadata: dict, saver) -> None:
    """Before the first step: `parts` (Trainer.parts) restored from checkpoint `path` (`choose`'s;
    `metadata`: this run's, which the restore compares with the checkpoint's), or on a fresh start
    the model's weights from run.init_from; then, still before anything is written, the mirror of
    `saver` (loop/checkpoint/saver.py) opened and out_dir claimed (loop/checkpoint/runlock.py)."""
    from loop.checkpoint import state  # here, not above: state.py imports this module's helpers

    if path:
        saver.origin = state.restore(path, parts, cfg, dist, metadata)
    elif cfg.run.init_from:
        taken = state.warm_start(Path(cfg.run.init_from), parts["model"], parts["ema"], cfg)
        dist.say(f"initialised model weights from {taken}")
    if cfg.run.mirror:  # opened before any write: a bad URL is bad input (said on every rank)
        dist.on_main(lambda: saver.open_mirror(cfg.run.mirror))
    dist.on_main(lambda: runlock.claim(Path(cfg.run.out_dir)))


def choose(resume: str, ckpt_root: Path, mirror: str, before_fetch=lambda: None, say=print) -> Path | None:
    """`before_fetch`: called before a checkpoint from the mirror is written into ckpt_root; `say`:
    where the note on a continued run.resume=PATH goes."""
    if resume == "never":
        if store.step_dirs(ckpt_root):
            raise BadInput(f"run.resume=never, but {ckpt_root} already holds checkpoints that a fresh "
                           f"run would overwrite; use a new run.out_dir, or run.resume=auto to continue from them.")
        if mirror:
            from loop.checkpoint.fetch import listed

            if listed(mirror)[2]:  # the mirror keeps what checkpoints/ keeps: it would prune them
                raise BadInput(f"run.resume=never, but run.mirror={mirror} already holds checkpoints "
                               f"that a fresh run's mirroring would delete; give the run its own "
                               f"run.mirror, or run.resume=auto to continue from them.")
        return None
    if not resume:  # Path("") is "." (here), which would be named "not a valid checkpoint"
        raise BadInput("config key run.resume is empty; expected auto, never or a checkpoint directory.")
    if not store.step_dirs(ckpt_root) and mirror:  # a new disk (a requeue): the newest, if any, is there
        from loop.checkpoint.fetch import fetch_latest

        # run.resume=PATH: only a checkpoint this run saved since starting there (`continued`).
        start = None if resume == "auto" else str(Path(resume).resolve())
        fetched = fetch_latest(mirror, ckpt_root, before_fetch,
                               lambda p: start is None or store.manifest(p).get("resumed_from") == start)
        if fetched and resume == "auto":
            return fetched
    if resume != "auto":
        given = followed(Path(resume))
        return continued(ckpt_root, Path(resume), given, say) or verified(given, "run.resume")
    try:
        path = store.newest_valid(ckpt_root)
    except BadInput:  # none verifies: the mirror's copies are there for this too
        if not mirror:
            raise
        from loop.checkpoint.fetch import fetch_latest

        if (path := fetch_latest(mirror, ckpt_root, before_fetch)) is None:
            raise
    if path is None and (latest := ckpt_root / "latest").is_file():  # its checkpoints deleted by hand
        raise BadInput(f"run.resume=auto: {latest} names {latest.read_text(errors='replace').strip()}, "
                       f"but {ckpt_root} holds no checkpoint; a fresh start would overwrite this "
                       f"run's metrics and model. Expected the checkpoints it names; to start over, "
                       f"use a new run.out_dir (or delete {latest}).")
    return path


def continued(ckpt_root: Path, named: Path, given: Path, say=print) -> Path | None:
    """The newest valid checkpoint in ckpt_root newer than `given` (the checkpoint run.resume=`named`
    names now) saved by a run that started from `named` (its manifest's `resumed_from`): a rerun of
    a command naming run.resume=PATH (after a Ctrl-C, a preemption, a torchrun restart, a requeue)
    went back to PATH and trained those steps again. Keyed on `named`, not on where checkpoints/best
    or /latest points, which moves as this run saves."""
    start = str(named.resolve())
    for path in reversed(store.step_dirs(ckpt_root)):
        if path.resolve() == given.resolve():
            return None  # the rest are older than the start
        if store.manifest(path).get("resumed_from") == start and store.verify(path) is None:
            say(f"note: run.resume={named}: continuing from {path}, which this run saved after "
                f"starting there (to start from {named} again, give a new run.out_dir)")
            return path
    return None


def origin(resume: str, path: Path | None) -> str | None:
    """The checkpoint a run's lineage started from by run.resume=PATH, recorded in each checkpoint
    it saves (`continued` looks for it); inherited through resumes from its own checkpoints."""
    if path is None:
        return None
    recorded = store.manifest(path).get("resumed_from")
    if resume in ("auto", "never") or recorded == str(Path(resume).resolve()):
        return recorded
    return str(Path(resume).resolve())


def followed(path: Path) -> Path:
    """checkpoints/latest and checkpoints/best are files holding a checkpoint's name: that one."""
    if path.name in ("latest", "best") and path.is_file():
        target = path.parent / path.read_text(errors="replace").strip()
        if not target.is_dir():  # deleted by hand, or copied without it
            raise BadInput(f"{path} names {target.name}, which is not in {path.parent}; expected the "
                           f"name of a checkpoint directory there.{checkpoints_near(path.parent)}")
        return target
    return path


def verified(path: Path, key: str) -> Path:
    if not path.exists():  # said first: store.verify would call a missing path's manifest missing
        raise BadInput(f"{key}={path}: no such file or directory; expected a checkpoint directory."
                       f"{checkpoints_near(path)}")
    reason = store.verify(path)
    if reason:
        raise BadInput(f"{key}={path}: not a valid checkpoint ({reason}); expected a checkpoint "
                       f"directory whose manifest.json verifies.{checkpoints_near(path)}")
    return path


def checkpoints_near(path: Path) -> str:
    """Where a run directory, its checkpoints/ or its model.pt was named instead of a checkpoint:
    the ones in it that would do (the newest, and the best if marked), for the error message."""
    for root in (path / "checkpoints", path, path.parent / "checkpoints", path.parent):  # .../checkpoints/best
        if dirs := [d for d in store.step_dirs(root) if d != path]:  # not the one refused
            best = root / (root / "best").read_text(errors="replace").strip() if (root / "best").is_file() else path
            best = f"; the best: {best}" if best != path else ""
            return f" {root} holds checkpoints: the newest is {dirs[-1]}{best}."
    return ""


def after_a_stop(out_dir: str | None) -> str:
    """What a run stopped mid-way leaves, and how to go on (said after Ctrl-C or a console gone);
    `out_dir`: None when the stop came before the config was read."""
    if out_dir and not store.step_dirs(Path(out_dir) / "checkpoints"):
        return "no checkpoint was written yet, so rerunning the same command starts over"
    return ("the steps since the newest checkpoint are lost, the checkpoints are whole; rerun the "
            "same command to continue from the newest")
