"""The non-finite policy (train.nan_policy): a step whose loss or gradients are not finite is
skipped, rolled back to the newest checkpoint, or ends the run; and steps without a single target.
"""
from __future__ import annotations

import sys

import torch

from loop.checkpoint import store
from loop.checkpoint.state import restore
from loop.distributed.fsdp import local
from loop.errors import GaveUp


# ---------------------------------------------------------------------------- non-finite values
def describe_non_finite(step: int, micro_losses: torch.Tensor, grad_norm: torch.Tensor,
                        model: torch.nn.Module) -> str:
    """Which values were not finite at `step` (read only on this failure path)."""
    bad_micro = [i for i, ok in enumerate(torch.isfinite(micro_losses).tolist()) if not ok]
    bad_grads = [n for n, p in model.named_parameters()  # FSDP: this rank's shards
                 if p.grad is not None and not torch.isfinite(local(p.grad)).all()]
    parts = [f"loss of micro-batch {', '.join(map(str, bad_micro))}" if bad_micro else "",
             f"grad norm ({grad_norm.item()})" if not torch.isfinite(grad_norm) else "",
             f"gradients of {', '.join(bad_grads[:5])}{' ...' if len(bad_grads) > 5 else ''}"
             if bad_grads else ""]
    return f"step {step}: non-finite " + "; ".join(p for p in parts if p)


def skip_empty_step(t, micro: list[dict], data_ms: float) -> None:
    """A step whose batches hold no target: its loss is 0/0 and it has no gradient, so nothing
    changes (weights, optimizer, LR, EMA), as for a skipped step; the data moves on."""
    p = t.progress
    p.empty += 1
    t.dist.say(f"warning: step {p.step + 1}: no targets in this step's batches (every y is -100, "
               f"at sample position {p.samples}); nothing to learn from, step skipped", file=sys.stderr)
    nan = torch.tensor(float("nan"), device=t.device)
    t._advance(micro, 0, t.optimizer.param_groups[0]["lr"], True, data_ms, nan, nan)


def on_non_finite(t, what: str) -> bool:
    """Apply train.nan_policy to a non-finite step. True: record the step as skipped."""
    tc, p = t.cfg.train, t.progress
    t.bad_streak, t.last_bad = t.bad_streak + 1, p.step + 1
    if tc.nan_policy == "abort" or t.bad_streak > tc.max_bad_steps:
        why = "train.nan_policy=abort" if tc.nan_policy == "abort" else \
            f"{t.bad_streak} bad steps in a row (train.max_bad_steps={tc.max_bad_steps})"
        if tc.nan_policy == "rollback" and t.bad_streak > 1:  # a replay's good steps do not count
            why += f"; the last {t.bad_streak - 1} rollbacks did not get the run past step {t.last_bad}"
        raise GaveUp(f"{what}. Gave up: {why}. Lower optim.lr, clip harder (train.clip_grad), "
                     f"or check the data at sample position {p.samples}.")
    who = f"rank {t.dist.rank}: " if t.dist.world > 1 else ""  # each rank saw its own values
    print(f"warning: {who}{what}; {tc.nan_policy}", file=sys.stderr)
    if tc.nan_policy == "skip":
        p.skipped += 1
        return True
    rollback(t)
    return False


def rollback(t) -> None:
    """Back to the newest valid checkpoint; the bad step's data window is never trained on."""
    bad, p = t.progress.samples, t.progress
    carry = (p.rollbacks + 1, sorted(set(p.skip_windows) | {bad}), p.micro_split)
    t.optimizer.zero_grad(set_to_none=True)
    t.scaler.update()  # consume this step's inf checks before the scaler state is replaced
    t.batches = None
    if t.saver:
        t.saver.wait()  # the newest checkpoint may still be being written
    restore(t, t.dist.on_main(lambda: store.newest_valid(t.ckpt_root)))
    p = t.progress
    p.rollbacks, p.skip_windows, p.micro_split = carry
    t.log.close()
    t.open_log()  # drops the records after the checkpoint, as a resume does
    t.batches = t._batches()
    t.dist.say(f"rolled back to step {p.step}; the samples at position {bad} will be passed over",
               file=sys.stderr)

