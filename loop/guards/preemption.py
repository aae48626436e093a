"""Preemption: a run told to stop by a signal saves a checkpoint first.

SIGTERM and SIGUSR1 (what SLURM and spot machines send before taking the machine) and SIGHUP (the
terminal closed: an ssh connection dropped) do not kill the run: the handler only raises a flag; the
loop finishes the current optimizer step, writes a checkpoint, and exits with EXIT_PREEMPTED. A
second signal during that save changes nothing. A signal the launcher ignores (`nohup`) stays ignored.
DataLoader workers ignore these signals (a scheduler signals the whole process group), so the main
process shuts them down itself instead of finding them dead in the middle of the save.
"""
from __future__ import annotations

import os
import signal
import sys

from loop.guards.console import mute_dead_console

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
        # handle (SIGUSR1, which its workers do) or of SIGKILL, and its workers would train on to
        # the end unsupervised. They stop as if preempted instead. Not plain python: `nohup python
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

    def agreed(self, dist) -> bool:
        """Whether a stop came to any rank (a collective: every rank stops at the same step)."""
        return dist.sum_host([float(self.requested())])[0] > 0

    def close(self, stopped: bool = False) -> None:
        """The handlers as they were. A torchrun worker whose run `stopped` here (its checkpoint
        written) ignores stop signals instead until it exits: torchrun sends SIGTERM to every
        worker once one exits 143, and a worker still closing would end as -15, not 143."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_IGN if stopped and self._launcher is not None else handler)
