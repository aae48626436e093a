"""The honest loop. `Trainer(...).run()` resumes if it can, trains to train.max_steps (or an early stop
or a preemption), evaluating and checkpointing on the way, and writes summary.json.
`step()` is one optimizer step: micro-batches -> forward, backward of each -> unscale -> clip -> the
true loss over every rank -> one finite check -> step or skip -> schedule, EMA, zero_grad -> log.

Exact resume rests on three seams: the data position (`Progress.samples`, which also seeds each sample's
augmentation), every RNG stream in the checkpoint (loop/rng.py), and the LR as a pure function of the
steps taken (loop/schedule.py).
A checkpoint is `self.parts`. Lines marked `lab:` break one concern on purpose (loop/lab.py).
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.nn.utils import clip_grad_norm_, get_total_norm
from torch.profiler import record_function

from loop import probe
from loop.checkpoint import resume, store
from loop.checkpoint.saver import Saver
from loop.compiler import check_resumed_split, cuda_graphs
from loop.contract import loss_and_sums
from loop.data.feed import Feed
from loop.data.sampler import split_batch, to_device
from loop.distributed import fsdp
from loop.distributed.group import Dist
from loop.distributed.wrap import check_all_used, grad_sync, is_ddp
from loop.evaluate import Evaluator
from loop.guards.nonfinite import NonFinite, rollback, watched_buffers
from loop.guards.oom import OutOfMemory
from loop.guards.preemption import Preemption
from loop.lab import banner
from loop.monitor import Monitor
from loop.observe import metadata as run_metadata
from loop.observe import summary
from loop.observe.metrics import MetricsLog, NullLog
from loop.observe.profile import StepProfiler
from loop.observe.telemetry import Telemetry
from loop.progress import Progress
from loop.rng import RngStreams


class Trainer:
    def __init__(self, cfg, model, data, optimizer, scheduler, precision, device, dist=None, ema=None):
        """`model` as wrapped for the run (DDP, FSDP or plain); `ema`: loop.ema.EMA or None."""
        self.cfg, self.model, self.data, self.device, self.dist = cfg, model, data, device, dist or Dist()
        self.raw = model.module if is_ddp(model) else model  # DDP wraps; a model may own a .module
        self.sharded = fsdp.is_sharded(model)  # FSDP: every rank holds a shard of each weight
        self.optimizer, self.scheduler, self.precision = optimizer, scheduler, precision
        self.scaler, self.ema, self.lab_break = precision.scaler, ema, cfg.lab.break_
        tc, self.out = cfg.train, Path(cfg.run.out_dir)
        self.progress = Progress()
        self.monitor = Monitor(tc.best_metric, tc.best_mode, tc.early_stop_patience, tc.early_stop_min_delta)
        self.parts = {"model": self.raw, "optimizer": optimizer, "scheduler": scheduler, "scaler": self.scaler,
                      "ema": ema, "monitor": self.monitor, "progress": self.progress, "rng": RngStreams()}
        self.feed = Feed(data, cfg, cfg.data.pin_memory and device.type == "cuda", self.progress, self.dist)
        watch = watched_buffers(self.raw)  # those a forward can leave non-finite (BatchNorm's statistics)
        self.checkpoints = Saver(self.out / "checkpoints", tc.keep_last, self.dist, tc.async_save, watch, self.sharded)
        self.nonfinite = NonFinite(tc.nan_policy, tc.max_bad_steps, self.progress, self.dist, watch)
        self.oom = OutOfMemory(tc.oom_policy, cfg.data.batch_size, self.progress, self.dist, self.sharded,
                               model, bool(tc.global_batch), cuda_graphs(cfg, device))
        self.evaluator = Evaluator(ema.module if ema else self.raw, data, cfg, precision, device, self.dist,
                                   self.sharded, self.progress, ema.in_model_dtypes if ema else contextlib.nullcontext)
        self.log, self.metadata, self.run_facts, self.preempted = NullLog(), {}, {}, False

    def run(self) -> dict:
        cfg, tc, p = self.cfg, self.cfg.train, self.progress
        self.start()  # resumed if it can be; config.yaml, metadata.json and the log written
        preemption, profiler, ended = Preemption(), None, False
        try:  # from the log's opening on: an error anywhere closes what is open (the finally below)
            self.dist.say(summary.start_line(self.raw, self.model, self.sharded, self.device, self.precision.name,
                                             self.dist.world, cfg.data.batch_size * tc.grad_accum, self.data.seq_len))
            if tc.nan_policy == "rollback" and not store.step_dirs(self.checkpoints.root, upto=p.step):
                self.save()  # something to roll back to before the first periodic checkpoint
            self.feed.start()
            profiler = StepProfiler(self.out / "profile") if tc.profile and self.dist.main else None
            self.model.train()
            while p.step < tc.max_steps and not self.monitor.state.stop_reason:
                t0 = time.perf_counter()
                if not self.step():
                    continue  # rolled back to a checkpoint
                if profiler:
                    profiler.step()
                due_eval = (tc.eval_every and p.step % tc.eval_every == 0) or p.step == tc.max_steps
                # Evaluated, logged, and given to the monitor; a new best of train.best_metric is
                # checkpointed at this step, named by checkpoints/best.
                new_best = bool(due_eval) and self.evaluator.evaluate(self.log, self.monitor)
                preempt = preemption.agreed(self.dist)
                done = p.step == tc.max_steps or bool(self.monitor.state.stop_reason)
                if p.step % tc.log_every == 0 or done:
                    self.log.flush()
                if self.monitor.state.stop_reason and p.step < tc.max_steps:  # set by this step's evaluation
                    self.dist.say(f"stopped early at step {p.step}: {self.monitor.state.stop_reason}")
                p.train_s += time.perf_counter() - t0
                if (tc.ckpt_every and p.step % tc.ckpt_every == 0) or done or new_best or preempt:
                    self.save()
                if preempt:
                    self.preempted = True
                    break
            ended = True  # the loop ran to its end (done, early stop, preempted): finish() follows
        finally:
            try:
                if profiler:
                    profiler.close()
                self.close(ended)  # the last async checkpoint write finishes under the stop handlers
            finally:
                preemption.close(self.preempted)
        if not self.preempted and preemption.agreed(self.dist):
            self.preempted = True  # a stop signal while the last checkpoint was written: it is on disk
        return self.finish()

    def start(self) -> None:
        """Before the first step: the model checked, a checkpoint restored, the run's files written."""
        cfg, tc, p = self.cfg, self.cfg.train, self.progress
        if self.lab_break:
            self.dist.say(banner(self.lab_break))
        probe.check_model(self.evaluator, self.raw, self.oom, self.monitor.metric, tc.compile)  # before any write
        path = self.dist.on_main(lambda: resume.choose_locked(self.out, cfg.run))  # out_dir locked first
        if self.dist.main:  # before the restore, which compares it with the checkpoint's
            self.metadata = run_metadata.collect(cfg, self.device, self.precision.name, self.dist.world,
                                                 {**self.data.meta, "unit": self.data.unit}, path)
        self.run_facts = run_metadata.run_facts(cfg, self.dist.world, self.metadata)
        resume.start_from(path, self.parts, cfg, self.dist, self.metadata, self.checkpoints)  # or run.init_from
        check_resumed_split(self.oom.graphs, cfg.data.batch_size, p.micro_split)  # the checkpoint's OOM split
        if self.dist.main:  # from here on, files are written (out_dir is the run's)
            run_metadata.write(self.out, cfg, self.metadata)
            # Metrics from rank 0 (the values are global), from the resumed step on.
            self.log = MetricsLog(self.out, p.step, p.tokens, p.samples, tc.max_steps, unit=self.data.unit,
                                  telemetry=Telemetry(self.raw, self.device, self.precision.name, self.dist.world,
                                                      self.data.seq_len))
            if path:  # what a kill in its save left undone (run() closes the mirror's copies)
                self.checkpoints.repair(path, self.monitor.state.best_step)

    def close(self, ended: bool) -> None:
        """Close what the run opened, on its way out of an error too; `ended`: finish() follows."""
        self.feed.close()  # the DataLoader workers, even if an error pins them
        # Even on the way out of an error every finished step is on disk (written before its
        # console line); a console gone with it (a `tee` ended by the same Ctrl-C) must not stop that.
        with contextlib.suppress(BrokenPipeError):
            self.log.flush()
        try:
            self.checkpoints.close()  # the last checkpoint is on disk, and mirrored
        finally:
            if not ended:  # an error or Ctrl-C on its way out, which it reports, not this
                with contextlib.suppress(OSError):  # (a full disk again, closing the log)
                    self.log.close()

    def step(self) -> bool:
        """One optimizer step: train.grad_accum batches, each in micro_split micro-batches. False: rolled back."""
        tc, p = self.cfg.train, self.progress
        batches, data_ms = self.feed.draw()  # this rank's train.grad_accum loaded batches; the wait
        # Targets in the step on every rank: counted by the collate, summed on the CPU (no GPU sync).
        n_targets = int(self.dist.sum_host([sum(b["n_targets"] for b in batches)])[0])
        if not n_targets:  # every y is -100 on every rank (e.g. prompts only): nothing to learn
            return self.skip_empty(batches, data_ms)
        while True:  # out of memory: every rank retries the same samples in smaller micro-batches
            losses, pieces = [], [piece for m in batches for piece in split_batch(m, p.micro_split)]
            with self.oom.attempt() as attempt:  # catches an out-of-memory error: attempt.failed
                for i, batch in enumerate(pieces):
                    last = i == len(pieces) - 1
                    with grad_sync(self.model, last):  # DDP/FSDP reduce gradients in the last backward
                        loss = self.forward(batch)  # summed over its targets (loop/contract.py)
                        losses.append(loss.detach().float())
                        divisor = n_targets  # the step's targets over all ranks
                        if self.lab_break == "mean_loss_per_microbatch":  # lab: each micro-batch's own mean
                            divisor = batch["n_targets"] * len(pieces)
                        scaled = self.scaler.scale(loss * (self.dist.world / divisor))  # x world: DDP averages ranks
                        if last:
                            attempt.agree()  # before gradients cross ranks: did any rank run out?
                        with record_function("backward"):
                            scaled.backward()
            if not attempt.failed:
                break
            loss = scaled = None  # the failed try's graph, freed before the split hands memory back
            self.oom.split(self.optimizer, self.device)  # smaller micro-batches of the same samples, or give up
            if is_ddp(self.model):  # its reducer waits for a backward that never comes: a fresh DDP,
                self.model = None  # once the old one is collected
                self.model = self.oom.rewrap(self.device)
        micro_losses = torch.stack(losses)
        check_all_used(self.model, tc.find_unused_parameters, p.step + 1)
        with record_function("optimizer"):  # unscale ... zero_grad: one region for the profiler
            params = [q for g in self.optimizer.param_groups for q in g["params"]]
            if self.lab_break != "clip_before_unscale":  # lab: not here, but after the clip (still x the scale)
                self.scaler.unscale_(self.optimizer)  # clip and measure the true gradients, not scaled ones
            grad_norm = clip_grad_norm_(params, tc.clip_grad) if tc.clip_grad > 0 else \
                get_total_norm([q.grad for q in params if q.grad is not None])
            if self.lab_break == "clip_before_unscale":  # lab: the unscale after the clip
                self.scaler.unscale_(self.optimizer)
            grad_norm = fsdp.whole(grad_norm).to(micro_losses.device)  # FSDP: a DTensor; CPU if offloaded
            totals = self.dist.sum_(torch.stack([micro_losses.sum(), (~grad_norm.isfinite()).float()]))  # (2,)
            step_loss = totals[0] / n_targets  # the true loss: every target of every rank
            lr = self.optimizer.param_groups[0]["lr"]
            loss_ok, grad_ok = torch.stack([step_loss.isfinite(), totals[1] == 0]).tolist()  # one host read
            if taken := loss_ok and grad_ok:
                self.scaler.step(self.optimizer)
                self.scheduler.step()  # the LR advances only on steps actually taken
                if self.ema:
                    self.ema.update(self.raw)
                self.nonfinite.passed()
            elif self.scaler.is_enabled() and loss_ok and self.scaler.get_scale() > 1:
                p.overflows += 1  # fp16 gradients overflowed under a scale > 1: not taken; update() backs the scale off
            elif self.nonfinite.verdict(micro_losses, grad_norm, self.raw) == "rollback":
                rollback(self.parts, self.checkpoints, self.feed, self.log, self.cfg, self.dist, self.metadata)
                return False  # not counted: the loop goes on from the checkpoint's step
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.count(batches, n_targets, lr, data_ms, step_loss, grad_norm, skipped=not taken)
        return True

    def forward(self, batch: dict) -> torch.Tensor:
        """One micro-batch's summed loss (loop/contract.py); build.py may wrap it with faults (guards/faults.py)."""
        batch = to_device(batch, self.device, non_blocking=True)
        if self.sharded:  # FSDP shards parameters only: buffers as DDP keeps them
            self.dist.sync_buffers(self.raw)
        with self.precision.autocast(), record_function("forward"):
            return loss_and_sums(self.model(batch))[0]

    def count(self, batches: list[dict], n_targets: int, lr: float, data_ms: float, loss: torch.Tensor,
              grad_norm: torch.Tensor, skipped: bool) -> None:
        """Count the step and its data, and log it (the loss and norm stay on the device)."""
        p = self.progress
        p.advance(batches, n_targets, self.dist.world)
        ids = {"ids": self.feed.ids(batches)} if self.cfg.data.log_ids else {}  # for audits: its samples
        self.log.record({"step": p.step, "lr": lr, "tokens": p.tokens, "samples": p.samples, "skipped": skipped,
                         "data_ms": data_ms, "micro_batch": self.oom.micro_batch(), **ids}, loss, grad_norm)

    def skip_empty(self, batches: list[dict], data_ms: float) -> bool:
        """No target in the step's batches: no loss, no gradient; nothing changes but the data position."""
        p, nan = self.progress, torch.tensor(float("nan"), device=self.device)
        p.empty += 1
        self.dist.say(f"warning: step {p.step + 1}: no targets in this step's batches (every y is -100, at "
                      f"sample position {p.samples}); nothing to learn from, step skipped", file=sys.stderr)
        self.count(batches, 0, self.optimizer.param_groups[0]["lr"], data_ms, nan, nan, skipped=True)
        return True

    def save(self) -> None:
        """Checkpoint this step (every rank takes part), its metrics on disk first (not the console's)."""
        self.log.flush(console=False)
        with record_function("checkpoint"):  # a region of the profiler's breakdown
            self.checkpoints.save(self.progress.step, self.parts, self.run_facts, self.monitor.state.best_step)

    def finish(self) -> dict:
        """The end: summary.json, model.pt and the report (loop/observe/summary.py); a preempted
        run skips them and exits fast, and rerunning the same command finishes the job."""
        facts = {"precision": self.precision.name, "device": str(self.device), "lab_break": self.lab_break or None,
                 "optimal_loss": self.data.meta.get("optimal_loss"), "micro_batch": self.oom.micro_batch()}
        return summary.finish(self.out, self.preempted, self.parts, self.evaluator, self.log, self.dist,
                              self.cfg, self.metadata.get("data"), facts)
