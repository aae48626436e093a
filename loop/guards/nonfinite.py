"""The non-finite policy (train.nan_policy): what a step whose loss or gradients are not finite does
(under fp16, gradients that overflow with a finite loss at a scale above 1 are the GradScaler's
way to find its scale: the step is not taken and the scale backs off, counted apart as overflows).

    skip      the step changes nothing (weights, optimizer, LR, EMA); the data moves on. Buffers its
              forward updated (BatchNorm's running statistics) keep the update: a skip cannot undo
              one left not finite, so the run gives up naming it (rollback restores them)
    rollback  back to the newest valid checkpoint, passing over the bad step's samples from then on
    abort     the run ends (exit 3) naming the step and what was not finite

skip and rollback give up too (exit 3) at more than train.max_bad_steps bad steps in a row. Every
rank sees the same verdict: the finite check sums over ranks (loop/trainer.py).
"""
from __future__ import annotations

import sys

import torch

from loop.checkpoint import state, store
from loop.distributed.fsdp import local
from loop.distributed.group import Dist
from loop.errors import GaveUp
from loop.progress import Progress


def watched_buffers(model: torch.nn.Module) -> set[str]:
    """The floating-point buffers a checkpoint holds that are finite as the model is built: those a
    forward can leave non-finite (BatchNorm's running statistics). Not a mask of -inf by design, nor
    a non-persistent buffer, which no checkpoint holds and no rollback restores."""
    saved = model.state_dict().keys()
    return {n for n, b in model.named_buffers()
            if n in saved and b.is_floating_point() and torch.isfinite(local(b)).all()}


class NonFinite:
    def __init__(self, policy: str, max_bad: int, progress: Progress, dist: Dist, watched: set[str] = frozenset()):
        # The row of bad steps is counted in `progress` (bad_streak, last_bad): in the checkpoint,
        # so a resumed run gives up where the uninterrupted one does. `watched`: watched_buffers().
        self.policy, self.max_bad, self.progress, self.dist = policy, max_bad, progress, dist
        self.watched = watched

    def passed(self) -> None:
        """The step is taken; from the last bad step on (its replay after a rollback included, not
        the replays before it) the streak ends."""
        if self.progress.step + 1 >= self.progress.last_bad:
            self.progress.bad_streak = 0

    def verdict(self, micro_losses: torch.Tensor, grad_norm: torch.Tensor, model: torch.nn.Module) -> str:
        """`skip` (counted as skipped) or `rollback` for this non-finite step, or GaveUp if the
        policy says abort, this is one bad step too many, or a skip would keep a buffer its forward
        made non-finite."""
        p = self.progress
        step, position = p.step + 1, p.samples
        what = describe(step, micro_losses, grad_norm, model)
        p.bad_streak, p.last_bad = p.bad_streak + 1, step
        streak = p.bad_streak
        if self.policy == "skip":  # what the forward did to a buffer (BatchNorm's statistics) stays
            stained = [n for n, b in model.named_buffers() if n in self.watched and not torch.isfinite(local(b)).all()]
            if self.dist.sum_host([float(bool(stained))])[0]:  # every rank agrees
                raise GaveUp(f"{what}; its forward left the buffers {', '.join(stained[:5]) or '(on another rank)'} "
                             f"not finite, which a skip cannot undo. Gave up: rerun with train.nan_policy=rollback "
                             f"(it restores them from the newest checkpoint), or lower optim.lr.")
        if self.policy == "abort" or streak > self.max_bad:
            why = "train.nan_policy=abort" if self.policy == "abort" else \
                f"{streak} bad steps in a row (train.max_bad_steps={self.max_bad})"
            if self.policy == "rollback" and streak > 1:  # a replay's good steps do not count
                why += f"; the last {streak - 1} rollbacks did not get the run past step {step}"
            raise GaveUp(f"{what}. Gave up: {why}. Lower optim.lr, clip harder (train.clip_grad), "
                         f"or check the data at sample position {position}.")
        who = f"rank {self.dist.rank}: " if self.dist.world > 1 else ""  # each rank saw its own values
        print(f"warning: {who}{what}; {self.policy}", file=sys.stderr)
        if self.policy == "skip":
            self.progress.skipped += 1
        return self.policy


def describe(step: int, micro_losses: torch.Tensor, grad_norm: torch.Tensor, model: torch.nn.Module) -> str:
    """Which values were not finite at `step` (read only on this failure path)."""
    bad_micro = [i for i, ok in enumerate(torch.isfinite(micro_losses).tolist()) if not ok]
    bad_grads = [n for n, p in model.named_parameters()  # FSDP: this rank's shards
                 if p.grad is not None and not torch.isfinite(local(p.grad)).all()]
    parts = [f"loss of micro-batch {', '.join(map(str, bad_micro))}" if bad_micro else "",
             f"grad norm ({grad_norm.item()})" if not torch.isfinite(grad_norm) else "",
             f"gradients of {', '.join(bad_grads[:5])}{' ...' if len(bad_grads) > 5 else ''}"
             if bad_grads else ""]
    return f"step {step}: non-finite " + "; ".join(p for p in parts if p)


def rollback(parts: dict, checkpoints, feed, log, cfg, dist, metadata: dict) -> None:
    """Back to the newest valid checkpoint (every rank): `parts` restored, the metrics after it
    dropped (as at a resume), the data read from its position on, passing over the bad step's
    window from now on."""
    log.flush()  # the steps before the bad one first: on the console before "resumed from"
    p = parts["progress"]
    bad = p.samples
    p.pass_over(feed.width())  # the bad step's global samples
    carry = (p.rollbacks + 1, p.skip_windows, p.bad_streak, p.last_bad)
    parts["optimizer"].zero_grad(set_to_none=True)
    parts["scaler"].update()  # consume this step's inf checks before the scaler state is replaced
    checkpoints.wait()  # the newest checkpoint may still be being written
    # Not past this step: a run resumed back in time has the newer checkpoints of the run before.
    path = dist.on_main(lambda: store.newest_valid(checkpoints.root, upto=p.step))
    checkpoints.origin = state.restore(path, parts, cfg, dist, metadata, split=p.micro_split)
    p.rollbacks, p.skip_windows, p.bad_streak, p.last_bad = carry
    log.rewind(p.step, p.tokens, p.samples)
    feed.start()
    dist.say(f"rolled back to step {p.step}; the samples at position {bad} will be passed over",
             file=sys.stderr)
