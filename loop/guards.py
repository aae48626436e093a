"""Guards around the loop: preemption signals, out-of-memory recovery, the non-finite policy, steps
without a single target.

SIGTERM and SIGUSR1 (what SLURM and spot machines send before taking the machine) and SIGHUP (the
terminal closed: an ssh session dropped) do not kill the run: the handler only raises a flag; the
loop finishes the current optimizer step, writes a checkpoint, and exits with EXIT_PREEMPTED. A
second signal during that save changes nothing. A signal the launcher ignores (`nohup`) stays ignored.
DataLoader workers ignore these signals (a scheduler signals the whole process group), so the main
process shuts them down itself instead of finding them dead in the middle of the save.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
from contextlib import contextmanager

import torch

from loop import checkpoint
from loop.distributed import ddp, is_ddp
from loop.errors import GaveUp, mute_dead_console
from loop.fsdp import local
from loop.state import restore
from model.gpt import GPT

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a shell reports for a terminated job
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def worker_ignores_stop_signals(_worker_id: int) -> None:
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class Preemption:
    def __init__(self):
        self.reason: str | None = None
        # A worker started by torchrun (RANK set) whose torchrun is gone has nobody left to stop
        # it, restart it or read its exit code: torchrun dies at once of a signal it does not
        # handle (SIGUSR1, which its workers do) or of SIGKILL, and its workers trained on to the
        # end unsupervised. They stop as if preempted instead. Not plain python: `nohup python
        # train.py &` outlives its shell on purpose.
        self._launcher = os.getppid() if "RANK" in os.environ else None
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                          if signal.getsignal(s) is not signal.SIG_IGN}

    def _stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            print(f"{reason}: finishing this step, then saving a checkpoint and exiting with "
                  f"{EXIT_PREEMPTED}", file=sys.stderr, flush=True)

    def _handle(self, signum: int, _frame) -> None:
        if signum == signal.SIGHUP:  # a closed terminal: every write to it fails (EIO) from now on
            mute_dead_console()
        self._stop(f"received {signal.Signals(signum).name}")

    def requested(self) -> bool:
        """A stop signal came, or (under torchrun) the launcher is gone; checked once a step."""
        if self._launcher is not None and os.getppid() != self._launcher:
            self._stop(f"torchrun (pid {self._launcher}) is gone")
        return self.reason is not None

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def fire_once(fired: set[str], fault: str, due: bool) -> bool:
    """An injected fault fires the first time its step is reached in a process (a rollback
    replays steps, and must not meet the same fault again)."""
    if due and fault not in fired:
        fired.add(fault)
        return True
    return False


# ---------------------------------------------------------------------------- out of memory
def configure_allocator() -> str:
    """Turn on expandable segments (less fragmentation, so fewer OOMs after a batch-size change)
    in both spellings of the allocator variable, keeping whatever else the user set. Must run
    before CUDA initialises; returns the setting in effect."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        current = os.environ.get(var, "")
        if "expandable_segments" not in current:
            os.environ[var] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return os.environ["PYTORCH_ALLOC_CONF"]


def injected_oom(*_) -> None:
    """faults.oom_at_step, raised from a hook: as a forward ends (its activations allocated, where
    a real out-of-memory error would find them) or as a backward starts."""
    raise torch.OutOfMemoryError("injected by faults.oom_at_step")


@contextmanager
def forward_oom(module: torch.nn.Module, due: bool):
    """Around a forward: if `due`, `module`'s forward raises `injected_oom` as it ends."""
    handle = module.register_forward_hook(injected_oom) if due else None
    try:
        yield
    finally:
        if handle:
            handle.remove()


def oom_in_collectives(t, where: str) -> None:
    """Out of memory while collectives over the ranks were under way: the other ranks are waiting
    in (or have gone past) a collective this one will never join, and DDP's reducer cannot resume
    a reduction left halfway. No retry can put that right, so this rank gives up (exit 3) and
    torchrun stops the others; rerunning resumes from the newest checkpoint."""
    p, b = t.progress, t.cfg.data.batch_size
    raise GaveUp(f"rank {t.dist.rank}: step {p.step + 1}: out of memory {where} (micro-batch "
                 f"{-(-b // p.micro_split)}). Collectives over the ranks were under way, so it cannot "
                 f"be retried in place. Rerun with a smaller data.batch_size and a larger "
                 f"train.grad_accum (the same global batch)"
                 f"{', or model.activation_checkpointing=true' if isinstance(t.raw, GPT) else ''}.")


def recover_from_oom(t) -> None:
    """train.oom_policy: halve the micro-batch (the same batches are retried), or give up."""
    p, b = t.progress, t.cfg.data.batch_size
    size = -(-b // p.micro_split)
    t.optimizer.zero_grad(set_to_none=True)
    if t.device.type == "cuda":
        torch.cuda.empty_cache()
    if t.cfg.train.oom_policy == "abort" or size <= 1:
        raise GaveUp(f"step {p.step + 1}: out of memory at micro-batch {size} "
                     f"(train.oom_policy={t.cfg.train.oom_policy}); use a smaller "
                     f"data.batch_size or model, or activation checkpointing.")
    p.micro_split *= 2
    if is_ddp(t.model):
        # A rank that finished the last micro-batch's forward has set DDP's reducer to reduce in
        # the next backward, which would now be a retried micro-batch's (and a lone process may
        # have run out of memory halfway through that reduction): a fresh DDP starts clean (every
        # rank is here; the weights are unchanged, the optimizer holds the same tensors).
        t.model = None
        gc.collect()  # the old reducer and its hooks on the parameters go first, even in a cycle
        t.model = ddp(t.raw, t.device, t.cfg.train.find_unused_parameters)
    t.dist.say(f"step {p.step + 1}: out of memory; micro-batch {size} -> {-(-b // p.micro_split)}, "
               f"accumulation x{p.micro_split} (same global batch), retrying", file=sys.stderr)


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
    restore(t, t.dist.on_main(lambda: checkpoint.newest_valid(t.ckpt_root)))
    p = t.progress
    p.rollbacks, p.skip_windows, p.micro_split = carry
    t.log.close()
    t.open_log()  # drops the records after the checkpoint, as a resume does
    t.batches = t._batches()
    t.dist.say(f"rolled back to step {p.step}; the samples at position {bad} will be passed over",
               file=sys.stderr)
