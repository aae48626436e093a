"""The honest loop. `Trainer(...).run()` resumes if it can, trains to `train.max_steps` (or until
early stopping or a preemption signal), and writes `summary.json`. The optimizer step (`_step`)
reads top to bottom:

    lr (set by LambdaLR) -> micro-batches (forward, backward) -> unscale -> clip -> finite check
    -> step -> EMA -> zero_grad -> log;   then eval and checkpoint.

Exact resume rests on three seams: the data position (global samples consumed by optimizer
steps, `Progress.samples`), every RNG stream captured in the checkpoint (`loop.rng`), and the LR
as a pure function of the optimizer step (`loop.schedule`).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from loop import evaluate
from loop.checkpoint import resume, runlock, store
from loop.checkpoint.async_save import AsyncSaver
from loop.checkpoint.atomic import atomic_write
from loop.checkpoint.state import Progress, restore, save, warm_start
from loop.config.load import save as save_config
from loop.config.schema import Config
from loop.data.sampler import close_loader, train_loader, val_batches
from loop.distributed import fsdp
from loop.distributed.group import Dist
from loop.distributed.wrap import check_all_used
from loop.ema import update as update_ema
from loop.forward_backward import forward_backward
from loop.guards.nonfinite import describe_non_finite, on_non_finite, skip_empty_step
from loop.guards.oom import recover_from_oom
from loop.guards.preemption import Preemption, worker_ignores_stop_signals
from loop.lab import banner
from loop.monitor import Monitor
from loop.observe.metadata import collect as collect_metadata
from loop.observe.metrics import MetricsLog, NullLog
from loop.observe.profile import StepProfiler
from loop.observe.summary import close_sinks, finish
from loop.observe.telemetry import Telemetry


class Trainer:
    def __init__(self, cfg: Config, model, data, optimizer, scheduler, precision, device, dist=None,
                 ema=None):
        self.cfg, self.model, self.data, self.device = cfg, model, data, device
        self.dist = dist or Dist()
        self.raw = getattr(model, "module", model)  # unwrapped (DDP keeps it as .module)
        self.sharded = fsdp.is_sharded(model)  # FSDP: every rank holds a shard of each weight
        self.optimizer, self.scheduler, self.precision = optimizer, scheduler, precision
        self.scaler, self.out = precision.scaler, Path(cfg.run.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.progress = Progress()
        tc = cfg.train
        self.monitor = Monitor(tc.best_metric, tc.best_mode, tc.early_stop_patience, tc.early_stop_min_delta)
        if cfg.ema.enabled != (ema is not None):
            raise ValueError("pass the AveragedModel (loop.ema.build_ema) exactly when ema.enabled")
        self.ema = ema  # built before wrapping (loop/build.py)
        self.val = val_batches(data.val, cfg.data.batch_size, tc.eval_batches, cfg.run.seed,
                               self.dist.rank, self.dist.world)
        self.last_eval: tuple[int, dict[str, float]] | None = None  # (step, val_loss, val_...)
        self.log: MetricsLog | None = None
        self.mirror, self.origin = None, None  # origin: where run.resume=PATH began (resume.origin)
        self.telemetry: Telemetry | None = None  # rank 0 only
        self.metadata: dict = {}  # rank 0 only; also goes into every checkpoint
        self.preempted = False
        self.saver = AsyncSaver(self.dist.for_thread()) if cfg.train.async_save else None
        self.bad_streak = 0  # non-finite steps in a row, with no step past them in between
        self.last_bad = 0  # the step the last of them was
        self.fired: set[str] = set()  # injected faults already fired in this process
        self.lab = cfg.lab.break_  # a lab switch breaking one concern on purpose (loop/lab.py)

    def run(self) -> dict:
        cfg, tc = self.cfg, self.cfg.train
        if self.lab:
            self.dist.say(banner(self.lab))
        evaluate.check_model_output(self)
        path = self.dist.on_main(self._lock_then_choose)
        if self.dist.main:  # before restore, which compares it with the checkpoint's
            self.metadata = collect_metadata(cfg, self.device, self.precision.name, self.dist.world,
                                             self.data.meta, path)
        if path:
            restore(self, path)
        elif cfg.run.init_from:
            warm_start(self, Path(cfg.run.init_from))
        if cfg.run.mirror:  # built before any write: a bad URL is bad input (on every rank)
            self.dist.on_main(self._open_mirror)
        self.dist.on_main(self._make_out_dir)
        if self.dist.main:  # from here on, files are written
            save_config(cfg, self.out / "config.yaml")
            atomic_write(self.out / "metadata.json", json.dumps(self.metadata, indent=1).encode())
        self.open_log()
        n_params = sum(p.numel() for p in self.raw.parameters())
        frozen = sum(p.numel() for p in self.raw.parameters() if not p.requires_grad)  # not trained
        params = f"{n_params:,} parameters" + (f" ({frozen:,} frozen)" if frozen else "")
        layout = "fsdp" if self.sharded else "ddp" if self.raw is not self.model else "no process group"
        if torch.distributed.is_initialized():
            layout += f" over {torch.distributed.get_backend()}"  # nccl on CUDA, else gloo
        global_batch = cfg.data.batch_size * tc.grad_accum * self.dist.world
        self.batches, profiler, preemption, ended = None, None, Preemption(), False
        try:  # from the log's opening on: an error anywhere closes what is open (the finally below)
            self.dist.say(f"{params} | {self.device} | {self.precision.name} | {self.dist.world} "
                          f"process(es), {layout} | global batch {global_batch} samples of "
                          f"{self.data.seq_len} target(s)")
            if cfg.train.nan_policy == "rollback" and not store.step_dirs(self.ckpt_root):
                save(self, 0)  # something to roll back to before the first periodic checkpoint
            self.batches = self._batches()
            profiler = StepProfiler(self.out / "profile") if tc.profile and self.dist.main else None
            self.model.train()
            while self.progress.step < tc.max_steps and not self.monitor.state.stop_reason:
                t0 = time.perf_counter()
                if not self._step():
                    continue  # rolled back to a checkpoint
                if profiler:
                    profiler.step()
                stop = self.dist.sum_host([float(preemption.requested())])[0] > 0  # all agree
                step, best = self.progress.step, False
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.max_steps:  # and the end's:
                    best = evaluate.evaluate(self, step)  # logged, and a best like any other
                done = step == tc.max_steps or bool(self.monitor.state.stop_reason)
                if step % tc.log_every == 0 or done:
                    self.log.flush()
                self.progress.train_s += time.perf_counter() - t0
                if (tc.ckpt_every and step % tc.ckpt_every == 0) or done or best or stop:
                    save(self, step)
                if stop:
                    self.preempted = True
                    break
            ended = True  # the loop ran to its end (done, early stop, preempted): finish() follows
        finally:
            preemption.close()
            if profiler:
                profiler.close()
            close_loader(self.batches)  # the DataLoader workers, even if an error pins them
            self.batches = None
            # Even on the way out of an error every finished step is on disk (written before its console
            # line); a console gone with it (a `tee` ended by the same Ctrl-C) must not stop that.
            with contextlib.suppress(BrokenPipeError):
                self.log.flush()
            try:
                if self.saver:
                    self.saver.close()  # the last checkpoint is on disk before anything else
            finally:
                if not ended:  # an error or Ctrl-C on its way out, which it reports, not this
                    with contextlib.suppress(OSError):  # (a full disk again, closing the log)
                        close_sinks(self)
        return finish(self)

    def _lock_then_choose(self) -> Path | None:
        """The checkpoint to resume from, the out_dir locked first (loop/checkpoint/runlock.py): a second run
        stops before reading one the first may write. A fetch from the mirror makes a new one."""
        runlock.hold(self.out)
        return resume.choose(self.cfg.run.resume, self.ckpt_root, self.cfg.run.mirror, self._make_out_dir)

    def _make_out_dir(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        runlock.hold(self.out, sign=True)  # a fresh out_dir is locked as soon as it exists

    def _open_mirror(self) -> None:
        from loop.checkpoint.mirror import Mirror

        self.mirror = Mirror(self.cfg.run.mirror)  # rank 0 only: it alone writes checkpoints

    def open_log(self) -> None:
        """Metrics from rank 0 (the values are global); from the resume point on."""
        p = self.progress
        if not self.dist.main:
            self.log = NullLog()
            return
        if self.telemetry is None:
            self.telemetry = Telemetry(self.raw, self.cfg.model, self.data.seq_len, self.device,
                                       self.precision.name, self.dist.world)
        self.log = MetricsLog(self.out, p.step, p.tokens, p.samples, self.cfg.train.max_steps,
                              telemetry=self.telemetry.read, mfu=self.telemetry.mfu)

    def _batches(self):
        d = self.cfg.data
        start = 0 if self.lab == "no_sampler_state" else self.progress.samples  # lab: from the top
        return iter(train_loader(self.data.train, d.batch_size, self.cfg.run.seed, start,
                                 d.num_workers, d.prefetch_factor, d.pin_memory and self.device.type == "cuda",
                                 worker_ignores_stop_signals, self.dist.rank, self.dist.world))

    def _draw(self) -> list[dict]:
        """The next optimizer step's batches, passing over windows a rollback marked as bad."""
        p, k = self.progress, self.cfg.train.grad_accum
        while p.samples in p.skip_windows:
            p.samples += sum(len(next(self.batches)["idx"]) for _ in range(k)) * self.dist.world
        return [next(self.batches) for _ in range(k)]

    def _step(self) -> bool:
        """One optimizer step over train.grad_accum batches. False if it rolled back instead."""
        tc, p = self.cfg.train, self.progress
        t = time.perf_counter()
        with record_function("data"):
            micro = self._draw()
        data_ms = 1000 * (time.perf_counter() - t)  # waiting for the DataLoader
        # Targets in the whole step, all ranks: counted on the CPU by the collate, summed over ranks
        # by a CPU collective, so the GPU stream is never waited on.
        n_targets = int(self.dist.sum_host([sum(b["n_targets"] for b in micro)])[0])
        if not n_targets:  # every y is -100 on every rank (e.g. a prompt-only sample): no loss
            skip_empty_step(self, micro, data_ms)
            return True
        while (losses := forward_backward(self, micro, n_targets)) is None:
            recover_from_oom(self)  # every rank retries the same batches in smaller pieces
        check_all_used(self.model, tc.find_unused_parameters, p.step + 1)
        with record_function("optimizer"):  # unscale ... zero_grad: one region for the profiler
            lab_clip_first = self.lab == "clip_before_unscale"  # lab: the wrong order, on purpose
            if not lab_clip_first:
                self.scaler.unscale_(self.optimizer)  # clip and measure the true gradients, not scaled ones
            params = [q for g in self.optimizer.param_groups for q in g["params"]]
            if tc.clip_grad > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.clip_grad)
            else:
                grad_norm = torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None])
            if lab_clip_first:
                self.scaler.unscale_(self.optimizer)
            grad_norm = fsdp.whole(grad_norm).to(losses.device)  # FSDP: a DTensor; CPU if offloaded
            totals = self.dist.sum_(torch.stack([losses.sum(), (~grad_norm.isfinite()).float()]))  # (2,)
            step_loss = totals[0] / n_targets  # the true loss: all targets of all ranks
            lr = self.optimizer.param_groups[0]["lr"]
            loss_ok, grad_ok = torch.stack([step_loss.isfinite(), totals[1] == 0]).tolist()  # one read
            if loss_ok and grad_ok:
                self.scaler.step(self.optimizer)
                self.scheduler.step()  # the LR advances only on steps actually taken
                if self.ema:
                    update_ema(self.ema, self.raw, self.cfg.ema)
                if p.step + 1 >= self.last_bad:  # past the bad step, not a replay after a rollback
                    self.bad_streak = 0
            elif self.scaler.is_enabled() and loss_ok:
                p.overflows += 1  # fp16 gradients overflowed: the scaler skips the step, backs off
            elif not on_non_finite(self, describe_non_finite(p.step + 1, losses, grad_norm, self.raw)):
                return False
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self._advance(micro, n_targets, lr, not (loss_ok and grad_ok), data_ms, step_loss, grad_norm)
        return True

    def _advance(self, micro: list[dict], n_targets: int, lr: float, skipped: bool, data_ms: float,
                 step_loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Count the step and its data, and log it."""
        p = self.progress
        p.step += 1
        p.samples += sum(len(b["idx"]) for b in micro) * self.dist.world
        p.tokens += n_targets
        fields = {"step": p.step, "lr": lr, "tokens": p.tokens, "samples": p.samples,
                  "skipped": skipped, "data_ms": data_ms,
                  "micro_batch": -(-self.cfg.data.batch_size // p.micro_split)}
        if self.cfg.data.log_ids:  # for audits: the global ids of this step's samples, in order
            ranks = self.dist.gather_to_main([b["idx"].tolist() for b in micro])  # rank 0 only
            fields["ids"] = ranks and [i for m in range(len(micro)) for r in ranks for i in r[m]]
        self.log.record(fields, step_loss, grad_norm)
