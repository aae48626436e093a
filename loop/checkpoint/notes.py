"""What a resume says about the run it continues: what differs from the run that saved the
checkpoint (config keys, data, machine, process count, global batch), and what the resumed state
means for this run (stopped early, past train.max_steps, newer checkpoints from another run). Each
is allowed, and said as a note.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from loop.checkpoint import store
from loop.config.load import changed_keys
from loop.schedule import SCHEDULES, lr_factor


def what_changed(state: dict, cfg, world: int, metadata: dict) -> list[str]:
    """What differs from the run that wrote the checkpoint: allowed, and said. `metadata`: this
    run's (loop/observe/metadata.py; empty on ranks but 0, which say nothing)."""
    notes, changed = [], changed_keys(state["config"], cfg)
    if "run.init_from" in changed and cfg.run.init_from:  # the same command rerun has it unchanged
        changed.remove("run.init_from")
        notes.append(f"run.init_from={cfg.run.init_from} is not used: it starts a fresh run, and this "
                     f"one resumes from its checkpoint; to start from those weights, give the run a "
                     f"new run.out_dir")
    if "train.grad_accum" in changed and cfg.train.global_batch and "train.global_batch" not in changed:
        changed.remove("train.grad_accum")  # derived from the global batch, said by loop/config/runtime.py
    if changed:
        notes.append(f"config differs from the checkpoint's in: {', '.join(changed)}; this run's "
                     f"values apply from here on")
    if {"train.best_metric", "train.best_mode"} & set(changed):  # loop/monitor.py starts over
        was = state["config"]["train"]
        notes.append(f"train.best_metric/best_mode {was.get('best_metric')}/{was.get('best_mode')} -> "
                     f"{cfg.train.best_metric}/{cfg.train.best_mode}: the best checkpoint and early "
                     f"stopping start over from this step")
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
        # Another process count gives each rank other random streams: other dropout masks, and
        # losses that part by more than rounding.
        masks = ("; each rank's random streams are its own, so with another number of processes "
                 "dropout (and any random draw in the model) draws other masks from here on"
                 if state["world_size"] != world else "")
        notes.append(f"this resume is not where the checkpoint was written ({moved}): the run goes on "
                     f"from the same data position and the same weights, its sums rounded otherwise"
                     f"{masks}; bit for bit holds only on the same machine, versions and process count")
    if "train.max_steps" in changed and state["progress"]["step"] < cfg.train.max_steps \
            and (lr := reshaped(state, cfg)):  # a step is left to train at it
        notes.append(lr)
    if batch := global_batch_change(state["config"], state["world_size"], cfg, world):
        notes.append(batch)
    return notes


def reshaped(state: dict, cfg) -> str | None:
    """What a new train.max_steps does to a schedule that depends on it (warmup_cosine's horizon):
    the LR at the resumed step jumps from the one the checkpoint's run would have taken (its own
    optim.lr and schedule) to this run's. None if it stays (a schedule without a horizon)."""
    was, s = state["config"], state["scheduler"]["last_epoch"]
    saved = SimpleNamespace(**{**asdict(cfg.schedule), **was.get("schedule", {})})  # a key it lacks: this run's
    if saved.name not in SCHEDULES:  # a schedule of the copy of the loop that wrote it
        saved = cfg.schedule
    before = lr_factor(s, saved, was["train"]["max_steps"]) * was.get("optim", {}).get("lr", cfg.optim.lr)
    after = lr_factor(s, cfg.schedule, cfg.train.max_steps) * cfg.optim.lr
    was_steps = was["train"]["max_steps"]
    # This run's schedule without a horizon (step, constant; or at this step, in its warmup): a jump
    # there is optim.lr's or the schedule keys' (said with the keys that differ), not the horizon's.
    if before == after or lr_factor(s, cfg.schedule, was_steps) == lr_factor(s, cfg.schedule, cfg.train.max_steps):
        return None
    return (f"train.max_steps {was_steps} -> {cfg.train.max_steps} reshapes schedule.name={cfg.schedule.name} "
            f"over the new horizon: the learning rate at this step goes from {before:.3g} to {after:.3g}. "
            f"To go on at the rate the schedule reached instead, resume with schedule.name=constant "
            f"schedule.warmup_steps=0 optim.lr={before:.3g}")


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


def after_resume(step: int, monitor, cfg, ckpt_root: Path, source: Path) -> list[str]:
    """What the resumed state means here (`monitor`: its loop/monitor.py state; `source`: the
    checkpoint). run.resume=PATH back in time in the same out_dir, or from another into one with
    newer checkpoints: those are from the run before; this one replaces each as it saves that step
    (loop/checkpoint/store.py::save). From another out_dir, the best so far is in that one."""
    notes, stop_reason, best = [], monitor.stop_reason, f"step_{monitor.best_step:08d}"
    outside = source.parent.resolve() != ckpt_root.resolve()  # not a mirror's fetch: that keeps the best
    if monitor.best_step and outside and not (ckpt_root / best).is_dir():
        there = source.parent / best
        where = f"its checkpoint is {there}" if there.is_dir() else "its checkpoint is gone"
        notes.append(f"the best so far is step {monitor.best_step} ({monitor.best:.6g}); {where}, not in "
                     f"{ckpt_root}, whose best names this run's own once it makes a new one")
    if stop_reason and step < cfg.train.max_steps:  # at train.max_steps the run finished: nothing was early
        notes.append(f"this run stopped early ({stop_reason}), so nothing more is trained; to train "
                     f"on, rerun with a larger train.early_stop_patience, or 0")
    if step > cfg.train.max_steps:
        notes.append(f"the checkpoint is past train.max_steps={cfg.train.max_steps}, so nothing is "
                     f"trained; to stop at step {cfg.train.max_steps}, resume from an older checkpoint "
                     f"(run.resume=PATH) or start a new run.out_dir")
    later = [d.name for d in store.step_dirs(ckpt_root) if d.name > f"step_{step:08d}"]
    if later and cfg.run.resume != "auto":
        notes.append(f"{', '.join(later)} in {ckpt_root} are from before this resume; each is "
                     f"replaced when this run saves its step, but until then run.resume=auto would "
                     f"continue from them. To branch off an older checkpoint, give the run its own "
                     f"run.out_dir (run.resume may point into another one).")
    return notes
