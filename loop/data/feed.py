"""The training batches of a run, from its data position on: what the step draws.

A DataLoader over the resumable order (loop/data/sampler.py) starts at `Progress.samples`, the
global samples that optimizer steps took; `draw` hands out the next step's batches, passing
over windows a rollback marked as never to be trained on (loop/guards/nonfinite.py::rollback).
"""
from __future__ import annotations

import time

from torch.profiler import record_function

from loop.data.bundle import Data
from loop.data.sampler import close_loader, train_loader
from loop.distributed.group import Dist
from loop.guards.preemption import worker_ignores_stop_signals
from loop.progress import Progress


class Feed:
    def __init__(self, data: Data, cfg, pin_memory: bool, progress: Progress, dist: Dist):
        """`cfg`: the run's config (data.*, run.seed, train.grad_accum, lab.break)."""
        self.data, self.cfg, self.pin_memory, self.progress, self.dist = data, cfg, pin_memory, progress, dist
        self.batches = None  # an iterator of this rank's batches

    def start(self) -> None:
        """A fresh loader from the data position on (at the start, and after a rollback)."""
        self.close()
        d, p = self.cfg.data, self.progress
        start = 0 if self.cfg.lab.break_ == "no_sampler_state" else p.samples  # lab: from the top
        self.batches = iter(train_loader(self.data.train, d.batch_size, self.cfg.run.seed, start, d.num_workers,
                                         d.prefetch_factor, self.pin_memory, worker_ignores_stop_signals,
                                         self.dist.rank, self.dist.world))

    def draw(self) -> tuple[list[dict], float]:
        """The next optimizer step's train.grad_accum batches, and the ms spent waiting for them. At
        a window a rollback marked to pass over, it first moves the data position past it."""
        p, grad_accum, t0 = self.progress, self.cfg.train.grad_accum, time.perf_counter()
        with record_function("data"):  # the profiler's row for it
            if (past := p.past_windows(self.width())) != p.samples:
                p.samples = past  # the samples between are passed over: a fresh loader from there
                self.start()
            batches = [next(self.batches) for _ in range(grad_accum)]
        return batches, 1000 * (time.perf_counter() - t0)

    def width(self) -> int:
        """The global samples a step takes: data.batch_size x train.grad_accum x processes."""
        return self.cfg.data.batch_size * self.cfg.train.grad_accum * self.dist.world

    def ids(self, batches: list[dict]) -> list[int] | None:
        """The global ids of a step's samples in the order they were trained on, on rank 0 (data.log_ids,
        for audits: make verify's data check); a collective."""
        ranks = self.dist.gather_to_main([b["idx"].tolist() for b in batches])  # None off rank 0
        return ranks and [i for m in range(len(batches)) for r in ranks for i in r[m]]

    def close(self) -> None:
        """Stop the loader's worker processes now (loop/data/sampler.py::close_loader)."""
        close_loader(self.batches)
        self.batches = None
