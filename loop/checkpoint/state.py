"""What a checkpoint holds, gathered from the trainer's parts and put back into them.

`save` writes a checkpoint of the trainer (rank 0 the shared state, every rank its RNG), and
`capture` returns the checkpoint's files: `state.pt` (model with unwrapped keys, optimizer,
scheduler, GradScaler, EMA, best/early-stop tracking, progress, config) and `rng_rank<r>.pt`
(this rank's RNG streams). With FSDP the model, optimizer and EMA weights are not in `state.pt`:
every rank writes its shards of them with torch.distributed.checkpoint (loop/distributed/fsdp.py). `restore`
loads them in an order that matters: RNG streams last, since building and loading the other parts
may draw from them.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from loop import optim, rng
from loop.checkpoint import resume, store
from loop.checkpoint.atomic import atomic_write
from loop.config.load import changed_keys, config_hash, to_dict
from loop.distributed import fsdp
from loop.ema import ema_state, load_ema_state


@dataclass
class Progress:
    step: int = 0  # optimizer steps done, skipped ones included
    samples: int = 0  # training samples consumed by those steps: the data position
    tokens: int = 0  # target tokens in those samples
    skipped: int = 0  # steps dropped because the loss or gradients were not finite
    overflows: int = 0  # fp16 steps skipped by the GradScaler (scale backed off)
    empty: int = 0  # steps skipped because their batches held no target (every y -100)
    train_s: float = 0.0  # wall time spent training, over every session
    micro_split: int = 1  # each loaded batch is cut in this many micro-batches (doubles on OOM)
    rollbacks: int = 0  # times training went back to a checkpoint after a non-finite step
    skip_windows: list[int] = field(default_factory=list)  # data positions never trained on


def capture(t) -> dict[str, object]:  # t: loop.trainer.Trainer
    """Checkpoint files: shared state (rank 0 only) and this rank's RNG streams."""
    mine = {f"rng_rank{t.dist.rank}.pt": rng.capture()}
    if not t.dist.main:
        return mine
    return {
        "state.pt": {
            "model": None if t.sharded else t.raw.state_dict(),
            "optimizer": None if t.sharded else t.optimizer.state_dict(), "sharded": t.sharded,
            "scheduler": t.scheduler.state_dict(), "scaler": t.scaler.state_dict(),
            "ema": ema_state(t.ema, t.sharded) if t.ema else None,
            "monitor": t.monitor.state_dict(), "progress": asdict(t.progress),
            "config": to_dict(t.cfg), "config_sha256": config_hash(t.cfg), "world_size": t.dist.world,
            "metadata": t.metadata,
        },
        **mine,
    }


def restore(t, path: Path) -> None:
    t.dist.say(f"loading checkpoint {path} ...")
    hyper = optim.config_hyperparameters(t.optimizer)
    state = resume.load_model_state(path, t.raw, t.cfg, t.optimizer)
    for note in what_changed(state, t.cfg, t.dist.world, t.metadata):
        t.dist.say(f"note: {note}")
    t.scheduler.load_state_dict(state["scheduler"])
    optim.reapply(t.optimizer, t.scheduler, hyper)
    if state["scaler"] and t.lab != "no_scaler_state":  # empty when fp16 is off; lab: dropped
        t.scaler.load_state_dict(state["scaler"])
    if t.ema and state["ema"]:
        load_ema_state(t.ema, state["ema"], path)
    elif t.ema:  # ema.enabled turned on at this resume: the average starts from the weights resumed
        t.ema.module.load_state_dict(t.raw.state_dict())
    was, now = state["config"]["train"], t.cfg.train
    same = (was.get("best_metric"), was.get("best_mode")) == (now.best_metric, now.best_mode)
    t.monitor.load_state_dict(state["monitor"] if same else {})  # else no yardstick: start over
    if not same:
        t.dist.say(f"note: train.best_metric/best_mode {was.get('best_metric')}/{was.get('best_mode')} "
                   f"-> {now.best_metric}/{now.best_mode}: the best checkpoint and early stopping "
                   f"start over from this step")
    t.progress = Progress(**state["progress"])
    t.origin = resume.origin(t.cfg.run.resume, path)
    mine = f"rng_rank{t.dist.rank}.pt"
    if t.lab == "no_rng_restore":  # lab: the streams go on from wherever this process is
        pass
    elif (path / mine).exists():
        rng.restore(store.load(path, mine))  # last: nothing above draws from it
    else:  # more processes than the run that saved it: this rank's streams start fresh
        rng.seed_everything(rng.rank_seed(t.cfg.run.seed, t.dist.rank, t.progress.step))
        print(f"note: rank {t.dist.rank}: {path} has no {mine} (saved with world size "
              f"{state['world_size']}); its random streams start from a new seed")
    t.dist.say(f"resumed from {path} at step {t.progress.step}")
    if reason := t.monitor.state.stop_reason:
        t.dist.say(f"note: this run stopped early ({reason}), so nothing more is trained; to train "
                   f"on, rerun with a larger train.early_stop_patience, or 0")
    if t.progress.step > t.cfg.train.max_steps:
        t.dist.say(f"note: the checkpoint is past train.max_steps={t.cfg.train.max_steps}, so nothing "
                   f"is trained; to stop at step {t.cfg.train.max_steps}, resume from an older "
                   f"checkpoint (run.resume=PATH) or start a new run.out_dir")
    _note_later_checkpoints(t, path)


def what_changed(state: dict, cfg, world: int, metadata: dict) -> list[str]:
    """What differs from the run that wrote the checkpoint: allowed, and said. `metadata`: this
    run's (loop/observe/metadata.py; empty on ranks but 0, which say nothing)."""
    notes, changed = [], changed_keys(state["config"], cfg)
    if "run.init_from" in changed and cfg.run.init_from:  # the same command rerun has it unchanged
        changed.remove("run.init_from")
        notes.append(f"run.init_from={cfg.run.init_from} is not used: it starts a fresh run, and this "
                     f"one resumes from its checkpoint; to start from those weights, give the run a "
                     f"new run.out_dir")
    if changed:
        notes.append(f"config differs from the checkpoint's in: {', '.join(changed)}; this run's "
                     f"values apply from here on")
    if "run.seed" in changed:  # the order is a function of (seed, epoch, index): loop/data/sampler.py
        notes.append("with another run.seed the rest of this epoch follows another order, so some of "
                     "its samples are trained on twice and some not at all, and validation reads "
                     "other batches (its losses compare with the run before's no more)")
    saved, now = state["metadata"].get("data"), metadata.get("data")  # None: older code, rank > 0
    if saved is not None and now is not None:
        keys = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
        if saved.get("sha256") and saved.get("sha256") == now.get("sha256"):
            keys = [k for k in keys if k != "source"]  # the same corpus, by another path
        if keys:
            notes.append(f"the data differs from the checkpoint's run ("
                         f"{'; '.join(f'{k} {saved.get(k)} -> {now.get(k)}' for k in keys)}); "
                         f"training goes on from the same sample position in it, not bit for bit "
                         f"as before")
    if moved := platform_change(state["metadata"], state["world_size"], metadata, world):
        notes.append(f"this resume is not where the checkpoint was written ({moved}): the run "
                     f"goes on, exact to floating-point rounding; bit for bit holds only on the "
                     f"same machine, versions and process count")
    if batch := global_batch_change(state["config"], state["world_size"], cfg, world):
        notes.append(batch)
    return notes


def platform_change(saved: dict, saved_world: int, now: dict, world: int) -> str:
    """What decides float rounding and differs between two runs' metadata: the versions of torch,
    numpy and CUDA, the CPU model, the GPU models (of runs on CUDA), the process count. '' if
    nothing (or not known)."""
    def rounding(m: dict, processes: int) -> dict:
        versions, hardware = m.get("versions", {}), m.get("hardware", {})
        return {"torch": versions.get("torch"), "numpy": versions.get("numpy"),
                "CUDA": versions.get("cuda"), "CPU": hardware.get("cpu"),
                "GPUs": ", ".join(g["name"] for g in hardware.get("gpus", [])
                                  if str(m.get("device")).startswith("cuda")) or None,
                "processes": processes}

    if not saved or not now:
        return ""
    a, b = rounding(saved, saved_world), rounding(now, world)
    return "; ".join(f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k])


def global_batch_change(saved: dict, saved_world: int, cfg, world: int) -> str | None:
    """What a resume does to the samples per step: data.batch_size is per process, so another
    number of processes changes the global batch (and with it the LR that suits it) unless
    data.batch_size or train.grad_accum change with it. None if it stays the same."""
    was = (saved_world, saved["data"]["batch_size"], saved["train"]["grad_accum"])
    now = (world, cfg.data.batch_size, cfg.train.grad_accum)
    if was[0] * was[1] * was[2] == now[0] * now[1] * now[2]:
        return None
    layout = "{} process(es) x data.batch_size {} x train.grad_accum {}"
    return (f"a step now takes {now[0] * now[1] * now[2]} samples ({layout.format(*now)}), the "
            f"checkpoint's run took {was[0] * was[1] * was[2]} ({layout.format(*was)}); the sample "
            f"order continues where it stopped")


def _note_later_checkpoints(t, path: Path) -> None:
    """run.resume=PATH back in time in the same out_dir, or from another into one with newer
    checkpoints: those are from the run before; this one replaces each as it saves that step
    (loop/store.py::save)."""
    if t.cfg.run.resume == "auto" or not t.dist.main:
        return
    later = [d.name for d in store.step_dirs(t.ckpt_root) if d.name > f"step_{t.progress.step:08d}"]
    if later:
        print(f"note: {', '.join(later)} in {t.ckpt_root} are from before this resume; each is "
              f"replaced when this run saves its step, but until then run.resume=auto would "
              f"continue from them. To branch off an older checkpoint, give the run its own "
              f"run.out_dir (run.resume may point into another one).")


def warm_start(t, path: Path) -> None:
    """run.init_from: model weights only; optimizer, schedule and step start fresh."""
    path = resume.followed(path)
    if path.is_file():  # a model.pt: train.py's export, or one given to you
        resume.load_export(path, t.raw, t.cfg)
    else:
        resume.load_model_state(resume.verified(path, "run.init_from"), t.raw, t.cfg)
    if t.ema:  # the average starts from the warm-start weights
        t.ema.module.load_state_dict(t.raw.state_dict())
    t.dist.say(f"initialised model weights from {path}")


def save(t, step: int) -> None:
    """Write checkpoint `step` (every rank takes part), then mark best / mirror it."""
    t.log.flush()  # metrics up to this step must be on disk before the checkpoint counts
    finite = torch.stack([torch.isfinite(fsdp.local(p)).all() for p in t.model.parameters()]).all()
    if t.dist.sum_host([float(not finite)])[0]:  # FSDP: each rank sees only its shards
        print(f"warning: step {step}: weights are not all finite; no checkpoint written",
              file=sys.stderr)
        return
    if t.sharded:  # every rank's copy of each buffer the same, whichever one DCP keeps
        for module in (t.raw, *([t.ema.module] if t.ema else [])):
            fsdp.sync_buffers(module)
    midway = None
    if step == t.cfg.faults.kill_in_ckpt_at_step:
        midway = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    best = {f"step_{t.monitor.state.best_step:08d}"} if t.monitor.state.best_step else set()
    meta = {"config_sha256": config_hash(t.cfg), "world_size": t.dist.world, "resumed_from": t.origin}
    args = (t.ckpt_root, step, capture(t), t.cfg.train.keep_last, meta, best, midway)
    then = partial(_saved, t, best=next(iter(best), None))
    ema = t.ema.module if t.ema else None
    if t.saver:  # returns once the state (FSDP: and this rank's shards) is copied
        shards = partial(fsdp.staged_writer, t.model, t.optimizer, ema, t.saver.dist.cpu_group)
        t.saver.save(*args, then=then if t.dist.main else None, shards=shards if t.sharded else None)
    else:
        shards = partial(fsdp.write, fsdp.state_dict(t.model, t.optimizer, ema)) if t.sharded else None
        path = store.save(*args, dist=t.dist, shards=shards)
        if t.dist.main:
            then(path)


def _saved(t, path: Path, best: str | None) -> None:
    """After a checkpoint is complete (in the writer thread when saving asynchronously)."""
    if best and (t.ckpt_root / best).is_dir():
        atomic_write(t.ckpt_root / "best", best.encode())
    else:  # none yet, or, resumed back in time, one the run before deleted: `best` names nothing
        (t.ckpt_root / "best").unlink(missing_ok=True)
    if t.mirror:
        t.mirror.submit(path, {p.name for p in store.step_dirs(t.ckpt_root)})
