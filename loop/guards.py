"""Guards around the loop: preemption signals.

SIGTERM and SIGUSR1 (what SLURM and spot machines send before taking the machine) do not kill the
run: the handler only raises a flag; the loop finishes the current optimizer step, writes a
checkpoint, and exits with EXIT_PREEMPTED. A second signal during that save changes nothing.
DataLoader workers ignore these signals (a scheduler signals the whole process group), so the main
process shuts them down itself instead of finding them dead in the middle of the save.
"""
from __future__ import annotations

import signal
import sys

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
