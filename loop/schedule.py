"""Learning-rate schedules as pure functions of the optimizer step, driven by `LambdaLR`.

Each schedule maps step s (0-based count of optimizer steps *taken*; skipped steps do not count)
to a factor of `optim.lr`. Warmup is linear and starts above zero: factor (s+1)/warmup.
Because the LR is a function of the step alone, resuming restores it exactly.
"""
from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from loop.errors import BadInput


def warmup_cosine(s: int, cfg, max_steps: int) -> float:
    progress = min(1.0, (s - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def cosine_restarts(s: int, cfg, max_steps: int) -> float:
    t, period = s - cfg.warmup_steps, cfg.restart_period
    if cfg.restart_mult == 1:  # equal cycles in one step; the loop below would take s/period turns
        t %= period
    while t >= period:  # SGDR: cycles of period, period*mult, period*mult^2, ...
        t, period = t - period, period * cfg.restart_mult
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t / period))


def inverse_sqrt(s: int, cfg, max_steps: int) -> float:
    return math.sqrt(max(1, cfg.warmup_steps) / (s + 1))


def step_decay(s: int, cfg, max_steps: int) -> float:
    return cfg.gamma ** ((s - cfg.warmup_steps) // cfg.step_size)


def constant(s: int, cfg, max_steps: int) -> float:
    return 1.0


# Each schedule's factor from step schedule.warmup_steps on; lr_factor puts the warmup before it.
SCHEDULES = {"warmup_cosine": warmup_cosine, "cosine_restarts": cosine_restarts,
             "inverse_sqrt": inverse_sqrt, "step": step_decay, "constant": constant}


def lr_factor(s: int, cfg, max_steps: int) -> float:
    """The factor of optim.lr at step s: the linear warmup, then schedule.name's curve."""
    w = cfg.warmup_steps
    return (s + 1) / w if s < w else SCHEDULES[cfg.name](s, cfg, max_steps)


class Schedule(LambdaLR):
    """LambdaLR, resumed the way a config reads: the step count from the checkpoint, the schedule
    (schedule.*, train.max_steps) and its base, optim.lr, from this run's config. Loaded after the
    optimizer (loop/optim.py::AdamW), it sets the lr of the resumed step, as its `step` would have."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]  # this run's optim.lr
        for g, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            g["lr"] = base * factor(self.last_epoch)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, max_steps: int) -> Schedule:
    if cfg.name not in SCHEDULES:
        raise BadInput(f"config key schedule.name: expected one of {', '.join(SCHEDULES)}; "
                       f"got {cfg.name!r}.")
    return Schedule(optimizer, partial(lr_factor, cfg=cfg, max_steps=max_steps))
