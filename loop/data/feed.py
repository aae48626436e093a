"""The training batches of a run, from its data position on: what the step draws.

A DataLoader over the resumable order (loop/data/sampler.py) starts at `Progress.samples`, the
global samples that optimizer steps took; `draw` hands out the next step's micro-batches, passing
over windows a rollback marked as never to be trained on (loop/trainer.py::rollback).
"""
from __future__ import annotations

from loop.data.bundle import Data
from loop.data.sampler import close_loader, train_loader
from loop.guards.preemption import worker_ignores_stop_signals
from loop.progress import Progress


class Feed:
    def __init__(self, data: Data, cfg, pin_memory: bool, progress: Progress, rank: int, world: int):
        """`cfg`: the run's config (data.*, run.seed, train.grad_accum, lab.break)."""
        self.data, self.cfg, self.pin_memory, self.progress, self.rank, self.world = \
            data, cfg, pin_memory, progress, rank, world
        self.batches = None  # an iterator of this rank's batches

    def start(self) -> None:
        """A fresh loader from the data position on (at the start, and after a rollback)."""
        self.close()
        d, p = self.cfg.data, self.progress
        start = 0 if self.cfg.lab.break_ == "no_sampler_state" else p.samples  # lab: from the top
        self.batches = iter(train_loader(self.data.train, d.batch_size, self.cfg.run.seed, start, d.num_workers,
                                         d.prefetch_factor, self.pin_memory, worker_ignores_stop_signals,
                                         self.rank, self.world))

    def draw(self) -> list[dict]:
        """The next optimizer step's train.grad_accum batches."""
        p, k = self.progress, self.cfg.train.grad_accum
        while p.samples in p.skip_windows:
            p.samples += sum(len(next(self.batches)["idx"]) for _ in range(k)) * self.world
        return [next(self.batches) for _ in range(k)]

    def close(self) -> None:
        """Stop the loader's worker processes now (loop/data/sampler.py::close_loader)."""
        close_loader(self.batches)
        self.batches = None
