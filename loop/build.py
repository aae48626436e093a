"""The parts of a run, wired in the order train.py needs them: seed, data, model, EMA copy,
wrapping, optimizer, schedule, precision -> a `Trainer`. Shared by train.py, make verify's
in-process audits (tools/audit_grads.py) and the benchmarks, so each builds exactly what a real
run trains.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from data import build_data
from loop.config.load import flat, to_dict
from loop.device import use_tf32
from loop.distributed import fsdp
from loop.distributed.group import Dist
from loop.distributed.wrap import wrap
from loop.ema import EMA
from loop.guards import faults
from loop.errors import BadInput
from loop.optim import build_optimizer
from loop.precision import Precision, check_weights
from loop.rng import rank_seed, seed_everything
from loop.schedule import build_scheduler
from loop.trainer import Trainer
from model import build_model
from model.gpt import GPT


def build_trainer(cfg, dist: Dist, device: torch.device) -> Trainer:
    check_same_config(cfg, dist)
    check_with_world(cfg, dist)
    # The builders draw the same numbers on every rank: the same data (a random split stays one
    # split) and the same initial weights.
    seed_everything(cfg.run.seed)
    data = build_data(cfg.data)
    use_tf32(device, cfg.train.tf32)
    precision = Precision(cfg.train.precision, device)
    # In host memory: `wrap` moves it to the device. Under FSDP with several processes only rank 0
    # makes weights, the others shapes (meta device) that `wrap` fills with their shards of rank 0's
    # weights; the EMA copy is shapes only on every rank, filled the same way.
    deferred = fsdp.deferred(cfg, dist.world)
    with torch.device("meta") if deferred and not dist.main else nullcontext():
        model = build_model(cfg.model, data)
    check_weights(model, precision, cfg.train.precision)
    if cfg.train.compile:
        model.compile()  # in place: state_dict keys, hence checkpoints, stay those of the model
        dist.say("model compiled in place (torch.compile); the first steps include compilation")
    # Before wrapping: an FSDP module cannot be deep-copied.
    ema = EMA(model, cfg.ema.decay, cfg.ema.warmup, shapes_only=deferred) if cfg.ema.enabled else None
    for note in idle_settings(cfg, precision, model):
        dist.say(f"note: {note}")
    model = wrap(model, device, cfg, precision.dtype, ema)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.train.max_steps)
    # Each rank's own streams (dropout, augmentation) start here, whatever the builders drew: FSDP's
    # meta-device ranks draw nothing, so they would otherwise differ from DDP's.
    seed_everything(rank_seed(cfg.run.seed, dist.rank))
    trainer = Trainer(cfg, model, data, optimizer, scheduler, precision, device, dist, ema)
    # Deliberate faults, if configured, from outside the step (loop/guards/faults.py).
    trainer.forward = faults.around_forward(trainer.forward, cfg.faults, trainer.progress, dist.rank)
    trainer.checkpoints.midway = faults.kill_midway(cfg.faults.kill_in_ckpt_at_step)
    return trainer


def idle_settings(cfg, precision: Precision, model=None) -> list[str]:
    """Settings that cannot act in this run: said, not refused (a later run may extend
    train.max_steps, or evaluate more often)."""
    t, notes = cfg.train, []
    if cfg.model.activation_checkpointing and model is not None and not isinstance(model, GPT):
        notes.append(f"model.activation_checkpointing=true is the GPT's (model/gpt.py): "
                     f"model.name={cfg.model.name} does what its builder does with it, maybe nothing")
    if t.early_stop_patience and not t.eval_every:
        notes.append("train.early_stop_patience has no effect with train.eval_every=0: it counts "
                     "evaluations, and this run evaluates once, at its end")
    elif t.early_stop_patience >= (n := -(-t.max_steps // t.eval_every) if t.eval_every else 0) > 0:
        notes.append(f"train.early_stop_patience={t.early_stop_patience} cannot stop this run: it "
                     f"evaluates {n} time(s) (train.eval_every={t.eval_every} of train.max_steps="
                     f"{t.max_steps}), and stopping takes {t.early_stop_patience} after the first")
    if (w := cfg.schedule.warmup_steps) > t.max_steps > 0:
        notes.append(f"schedule.warmup_steps={w} is longer than train.max_steps={t.max_steps}: the "
                     f"learning rate never reaches optim.lr (the run ends at {t.max_steps / w:.0%} of it)")
    if t.fsdp_mixed_precision and (precision.dtype is None or t.strategy != "fsdp"):
        notes.append(f"train.fsdp_mixed_precision=true has no effect with train.strategy="
                     f"{t.strategy} and {precision.name} precision: it needs fsdp and bf16 or fp16")
    for key in ("nan_at_step", "oom_at_step", "kill_in_ckpt_at_step"):
        step = getattr(cfg.faults, key)
        if step == 0 or step > t.max_steps:  # steps count from 1
            notes.append(f"faults.{key}={step} will not fire: this run's steps are 1 to "
                         f"train.max_steps={t.max_steps}")
    k = cfg.faults.kill_in_ckpt_at_step
    if 0 < k < t.max_steps and not (t.ckpt_every and k % t.ckpt_every == 0):  # loop/trainer.py saves
        best = " its evaluation is a new best or" if t.eval_every and k % t.eval_every == 0 else ""
        which = (f"is neither a multiple of train.ckpt_every={t.ckpt_every} nor the last step"
                 if t.ckpt_every else "is not the last step (train.ckpt_every=0: at the end only)")
        notes.append(f"faults.kill_in_ckpt_at_step={k} may not fire: step {k} {which}, so it writes "
                     f"a checkpoint only if{best} the run stops there (early stopping, a preemption "
                     f"signal)")
    return notes


def check_same_config(cfg, dist: Dist) -> None:
    """One config on every process: each node reads its own files, overrides and .env, and a
    train.max_steps apart hung the run at its end, an optim.lr apart trained replicas that parted
    without a word. Every rank raises, so none waits for the others in a collective."""
    if dist.world == 1:
        return
    main, mine = flat(dist.from_main(to_dict(cfg))), flat(to_dict(cfg))
    differ = sorted(k for k in main.keys() | mine.keys() if main.get(k) != mine.get(k))
    if n := int(dist.sum_host([float(bool(differ))])[0]):
        here = (f"rank {dist.rank} has {', '.join(f'{k}={mine.get(k)}' for k in differ)} where rank 0 "
                f"has {', '.join(f'{k}={main.get(k)}' for k in differ)}" if differ else
                f"{n} process(es) have another one than rank 0 (their messages name the keys)")
        raise BadInput(f"the config differs between processes: {here}; expected the same config on "
                       f"every process (the same config file, overrides and .env on every node).")


def check_with_world(cfg, dist: Dist) -> None:
    """Keys whose range is the run's ranks. A fault aimed at a rank the run does not have never
    fires, and a fire drill that passes because nothing happened proves nothing."""
    for key in ("nan_rank", "oom_rank"):
        rank = getattr(cfg.faults, key)
        if rank >= dist.world:
            raise BadInput(f"config key faults.{key}: rank {rank}, but this run has {dist.world} "
                           f"process(es); expected -1 (every rank) or a rank below {dist.world}.")
