"""Deliberate faults (`faults.*`) for tests and fire drills, installed from outside the loop: the
step never mentions them. loop/build.py wraps the trainer's forward and hooks its checkpoint saver
when a fault is configured:

    faults.nan_at_step=N           the first forward of step N returns a NaN loss
    faults.oom_at_step=N           ... runs out of memory as it ends (its activations allocated,
                                   where a real out-of-memory error finds them) or, with
                                   faults.oom_in=backward, as its backward starts
    faults.nan_rank / oom_rank     on that rank only (-1: every rank)
    faults.kill_in_ckpt_at_step=N  SIGKILL this process midway through step N's checkpoint

Each fires once in a process, and a NaN not at a step the run has found bad already (`Progress.
last_bad`, in the checkpoint): a rollback's replay of the step goes without it, as does a rerun
resumed from a checkpoint written between the rollback and the step.
"""
from __future__ import annotations

import os
import signal
from typing import Callable

import torch

from loop.progress import Progress


def raise_oom(*_) -> None:
    raise torch.OutOfMemoryError("injected by faults.oom_at_step")


def around_forward(forward: Callable[[dict], torch.Tensor], cfg, progress: Progress,
                   rank: int) -> Callable[[dict], torch.Tensor]:
    """`forward` (a micro-batch -> its summed loss) with this rank's NaN and out-of-memory faults."""
    due = {name: step for name, step, who in (("nan", cfg.nan_at_step, cfg.nan_rank),
                                              ("oom", cfg.oom_at_step, cfg.oom_rank))
           if step > 0 and who in (-1, rank)}
    if not due:
        return forward

    def faulty(batch: dict) -> torch.Tensor:
        loss = forward(batch)
        step = progress.step + 1
        if due.get("oom") == step:
            del due["oom"]
            if cfg.oom_in == "forward":
                raise_oom()
            loss.register_hook(raise_oom)  # called as backward reaches the loss: its start
        if due.get("nan") == step and progress.last_bad < step:
            del due["nan"]
            loss = loss * float("nan")
        return loss

    return faulty


def kill_midway(at_step: int) -> Callable[[int], None] | None:
    """What a checkpoint saver calls after writing step N's first file (loop/checkpoint/saver.py)."""
    if at_step <= 0:
        return None

    def kill(step: int) -> None:
        if step == at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    return kill
