"""The non-finite policy (train.nan_policy): what a step whose loss or gradients are not finite does.

    skip      the step changes nothing (weights, optimizer, LR, EMA); the data moves on
    rollback  back to the newest valid checkpoint, passing over the bad step's samples from then on
    abort     the run ends (exit 3) naming the step and what was not finite

skip and rollback give up too (exit 3) after train.max_bad_steps bad steps in a row. Every rank sees
the same verdict: the finite check sums over ranks (loop/trainer.py).
"""
from __future__ import annotations

import sys

import torch

from loop.distributed.fsdp import local
from loop.errors import GaveUp


class NonFinite:
    def __init__(self, policy: str, max_bad: int, rank: int, world: int):
        self.policy, self.max_bad, self.rank, self.world = policy, max_bad, rank, world
        self.streak = 0  # non-finite steps in a row, with no step past them in between
        self.last_bad = 0  # the step the last of them was

    def passed(self, step: int) -> None:
        """A step was taken; past the last bad step (not a replay after a rollback) the streak ends."""
        if step >= self.last_bad:
            self.streak = 0

    def verdict(self, step: int, what: str, position: int) -> str:
        """`skip` or `rollback` for non-finite step `step` (`what`: describe()); GaveUp if the policy
        says abort, or this is one bad step too many. `position`: its samples' data position."""
        self.streak, self.last_bad = self.streak + 1, step
        if self.policy == "abort" or self.streak > self.max_bad:
            why = "train.nan_policy=abort" if self.policy == "abort" else \
                f"{self.streak} bad steps in a row (train.max_bad_steps={self.max_bad})"
            if self.policy == "rollback" and self.streak > 1:  # a replay's good steps do not count
                why += f"; the last {self.streak - 1} rollbacks did not get the run past step {step}"
            raise GaveUp(f"{what}. Gave up: {why}. Lower optim.lr, clip harder (train.clip_grad), "
                         f"or check the data at sample position {position}.")
        who = f"rank {self.rank}: " if self.world > 1 else ""  # each rank saw its own values
        print(f"warning: {who}{what}; {self.policy}", file=sys.stderr)
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
