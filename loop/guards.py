"""Guards around the loop: preemption signals, out-of-memory, non-finite values.

SIGTERM and SIGUSR1 (what SLURM and spot machines send before taking the machine) do not kill the
run: the handler only raises a flag; the loop finishes the current optimizer step, writes a
checkpoint, and exits with EXIT_PREEMPTED. A second signal during that save changes nothing.
DataLoader workers ignore these signals (a scheduler signals the whole process group), so the main
process shuts them down itself instead of finding them dead in the middle of the save.
"""
from __future__ import annotations

import os
import signal
import sys

import torch

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a shell reports for a terminated job
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def worker_ignores_stop_signals(_worker_id: int) -> None:
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class Preemption:
    def __init__(self):
        self.signal: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        if self.signal is None:
            self.signal = signum
            print(f"received {signal.Signals(signum).name}: finishing this step, then saving a "
                  f"checkpoint and exiting with {EXIT_PREEMPTED}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


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


# ---------------------------------------------------------------------------- non-finite values
def describe_non_finite(step: int, micro_losses: torch.Tensor, grad_norm: torch.Tensor,
                        model: torch.nn.Module) -> str:
    """Which values were not finite at `step` (read only on this failure path)."""
    bad_micro = [i for i, ok in enumerate(torch.isfinite(micro_losses).tolist()) if not ok]
    bad_grads = [n for n, p in model.named_parameters()
                 if p.grad is not None and not torch.isfinite(p.grad).all()]
    parts = [f"loss of micro-batch {', '.join(map(str, bad_micro))}" if bad_micro else "",
             f"grad norm ({grad_norm.item()})" if not torch.isfinite(grad_norm) else "",
             f"gradients of {', '.join(bad_grads[:5])}{' ...' if len(bad_grads) > 5 else ''}"
             if bad_grads else ""]
    return f"step {step}: non-finite " + "; ".join(p for p in parts if p)
