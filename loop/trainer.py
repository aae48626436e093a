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

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data.sampler import train_loader, val_batches
from loop import checkpoint, resume, rng
from loop.atomic import atomic_write
from loop.config import Config, changed_keys, config_hash, save as save_config, to_dict
from loop.evaluate import text_sample, val_loss
from loop.ema import build_ema, ema_state, load_ema_state
from loop.guards import Preemption, worker_ignores_stop_signals
from loop.metadata import collect as collect_metadata
from loop.metrics import MetricsLog
from loop.monitor import Monitor


@dataclass
class Progress:
    step: int = 0  # optimizer steps done, skipped ones included
    samples: int = 0  # training samples consumed by those steps: the data position
    tokens: int = 0  # target tokens in those samples
    skipped: int = 0  # steps dropped because the loss or gradients were not finite
    overflows: int = 0  # fp16 steps skipped by the GradScaler (scale backed off)
    train_s: float = 0.0  # wall time spent training, over every session


class Trainer:
    def __init__(self, cfg: Config, model, data, optimizer, scheduler, precision, device):
        self.cfg, self.model, self.data, self.device = cfg, model, data, device
        self.optimizer, self.scheduler, self.precision = optimizer, scheduler, precision
        self.scaler = precision.scaler
        self.out = Path(cfg.run.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.progress = Progress()
        tc = cfg.train
        self.monitor = Monitor(tc.best_metric, tc.best_mode, tc.early_stop_patience, tc.early_stop_min_delta)
        self.ema = build_ema(model, cfg.ema)
        self.val = val_batches(data.val, cfg.data.batch_size, tc.eval_batches, cfg.run.seed)
        self.last_eval: tuple[int, float] | None = None
        self.log: MetricsLog | None = None
        self.mirror = None
        self.preempted = False

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, object]:
        """Checkpoint files: shared state (rank 0) and this rank's RNG streams."""
        return {
            "state.pt": {
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "ema": ema_state(self.ema) if self.ema else None,
                "monitor": self.monitor.state_dict(), "progress": asdict(self.progress),
                "config": to_dict(self.cfg), "config_sha256": config_hash(self.cfg), "world_size": 1,
            },
            "rng_rank0.pt": rng.capture(),
        }

    def load(self, path: Path) -> None:
        state = resume.load_model_state(path, self.model)
        changed = changed_keys(state["config"], self.cfg)
        if changed:
            print(f"note: config differs from the checkpoint's in: {', '.join(changed)}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when fp16 is off
            self.scaler.load_state_dict(state["scaler"])
        if self.ema and state["ema"]:
            load_ema_state(self.ema, state["ema"])
        self.monitor.load_state_dict(state["monitor"])
        self.progress = Progress(**state["progress"])
        rng.restore(checkpoint.load(path, "rng_rank0.pt"))  # last: nothing above draws from it
        print(f"resumed from {path} at step {self.progress.step}")

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        cfg, tc = self.cfg, self.cfg.train
        path = resume.choose(cfg.run.resume, self.ckpt_root, cfg.run.mirror)
        if path:
            self.load(path)
        elif cfg.run.init_from:
            resume.load_model_state(resume.verified(Path(cfg.run.init_from), "run.init_from"), self.model)
            if self.ema:  # the average starts from the warm-start weights
                self.ema.module.load_state_dict(self.model.state_dict())
            print(f"initialised model weights from {cfg.run.init_from}")
        if cfg.run.mirror:  # built before any write: a bad URL is bad input
            from loop.mirror import Mirror

            self.mirror = Mirror(cfg.run.mirror)
        self.out.mkdir(parents=True, exist_ok=True)  # from here on, files are written
        save_config(cfg, self.out / "config.yaml")
        meta = collect_metadata(config_hash(cfg), self.device, self.precision.name, 1)
        meta["resumed_from"] = str(path) if path else None
        atomic_write(self.out / "metadata.json", json.dumps(meta, indent=1).encode())
        self.log = MetricsLog(self.out, self.progress.step, self.progress.tokens, tc.max_steps)
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"{n_params:,} parameters | {self.device} | {self.precision.name} | global batch "
              f"{cfg.data.batch_size * tc.grad_accum} x {self.data.seq_len} tokens")
        loader = train_loader(self.data.train, cfg.data.batch_size, cfg.run.seed, self.progress.samples,
                              cfg.data.num_workers, cfg.data.prefetch_factor,
                              cfg.data.pin_memory and self.device.type == "cuda",
                              worker_init_fn=worker_ignores_stop_signals)
        batches, preemption = iter(loader), Preemption()
        try:
            self.model.train()
            while self.progress.step < tc.max_steps and not self.monitor.state.stop_reason:
                t0 = time.perf_counter()
                self._step(batches)
                step, best = self.progress.step, False
                if tc.eval_every and step % tc.eval_every == 0:
                    best = self._evaluate(step)
                done = step == tc.max_steps or bool(self.monitor.state.stop_reason)
                if step % tc.log_every == 0 or done:
                    self.log.flush()
                self.progress.train_s += time.perf_counter() - t0
                if (tc.ckpt_every and step % tc.ckpt_every == 0) or done or best or preemption.signal:
                    self._save(step)
                if preemption.signal:
                    self.preempted = True
                    break
        finally:
            preemption.close()
            del batches  # shuts the DataLoader workers down
        return self._finish()

    def _step(self, batches) -> None:
        """One optimizer step over train.grad_accum micro-batches."""
        tc, p = self.cfg.train, self.progress
        micro = [next(batches) for _ in range(tc.grad_accum)]
        n_targets = sum(b["n_targets"] for b in micro)  # counted on the CPU by the collate
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            batch = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                     for k, v in batch.items()}
            with self.precision.autocast():
                loss = self.model(batch)  # summed over this micro-batch's targets
            if i == 0 and p.step + 1 == self.cfg.faults.nan_at_step:
                loss = loss * float("nan")
            # Divide by the whole step's target count: the gradients then equal one big batch's.
            self.scaler.scale(loss / n_targets).backward()
            loss_sum += loss.detach().float()
        self.scaler.unscale_(self.optimizer)  # clip and measure the true gradients, not scaled ones
        params = [q for g in self.optimizer.param_groups for q in g["params"]]
        if tc.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.clip_grad)
        else:
            grad_norm = torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None])
        step_loss = loss_sum / n_targets
        lr = self.optimizer.param_groups[0]["lr"]
        finite = bool(torch.isfinite(step_loss) & torch.isfinite(grad_norm))  # the one read per step
        if finite:
            self.scaler.step(self.optimizer)
            self.scheduler.step()  # the LR advances only on steps actually taken
            if self.ema:
                self.ema.update_parameters(self.model)
        elif self.scaler.is_enabled():
            p.overflows += 1
        else:
            p.skipped += 1
        self.scaler.update()  # on overflow: backs the loss scale off
        self.optimizer.zero_grad(set_to_none=True)
        p.step += 1
        p.samples += sum(len(b["idx"]) for b in micro)
        p.tokens += n_targets
        self.log.record({"step": p.step, "lr": lr, "tokens": p.tokens, "skipped": not finite},
                        step_loss, grad_norm)

    def _val_loss(self) -> float:
        return val_loss(self.ema.module if self.ema else self.model, self.val, self.precision, self.device)

    def _evaluate(self, step: int) -> bool:
        """Validation loss into the metrics; True if it is the best so far."""
        val = self._val_loss()
        self.log.scalar(step, "val_loss", val)
        self.last_eval = (step, val)
        return self.monitor.update(step, val)

    def _save(self, step: int) -> None:
        self.log.flush()  # metrics up to this step must be on disk before the checkpoint counts
        if not torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all():
            print(f"warning: step {step}: weights are not all finite; no checkpoint written",
                  file=sys.stderr)
            return
        midway = None
        if step == self.cfg.faults.kill_in_ckpt_at_step:
            midway = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        best = {f"step_{self.monitor.state.best_step:08d}"} if self.monitor.state.best_step else set()
        meta = {"config_sha256": config_hash(self.cfg), "world_size": 1}
        path = checkpoint.save(self.ckpt_root, step, self.state(), self.cfg.train.keep_last, meta,
                               best, midway)
        if best:
            atomic_write(self.ckpt_root / "best", best.pop().encode())
        if self.mirror:
            self.mirror.submit(path, {p.name for p in checkpoint.step_dirs(self.ckpt_root)})

    def _finish(self) -> dict:
        p, m = self.progress, self.monitor.state
        if self.preempted:  # exit fast: the checkpoint is written, the rerun finishes the job
            self.log.close()
            if self.mirror:
                self.mirror.close()
            print(f"preempted at step {p.step}; checkpoint written to {self.ckpt_root}")
            return {"steps": p.step, "preempted": True}
        val = self.last_eval[1] if self.last_eval and self.last_eval[0] == p.step else self._val_loss()
        summary = {
            "steps": p.step, "final_loss": self.log.last_loss, "val_loss": val,
            "params_sha256": checkpoint.params_sha256(self.model), "wall_s": p.train_s,
            "tokens": p.tokens, "tokens_per_s": p.tokens / p.train_s if p.train_s else None,
            "skipped_steps": p.skipped, "overflow_steps": p.overflows,
            "best": {"metric": self.monitor.metric, "value": m.best, "step": m.best_step},
            "stopped_early": bool(m.stop_reason), "stop_reason": m.stop_reason or None,
            "preempted": False, "precision": self.precision.name, "device": str(self.device),
            "optimal_loss": self.data.meta.get("optimal_loss"),
            "sample": text_sample(self.ema.module if self.ema else self.model,
                                  self.val[0]["x"][:1, :8].to(self.device),  # (1, 8) prompt
                                  self.cfg.train.sample_tokens, self.cfg.run.seed, self.data.decode),
        }
        if self.ema:
            summary["ema_params_sha256"] = checkpoint.params_sha256(self.ema.module)
        self.log.text(p.step, "sample", summary["sample"] or "")
        self.log.close()
        if self.mirror:
            self.mirror.close()
        export = {"model": self.model.state_dict(), "config": to_dict(self.cfg)}
        if self.ema:
            export["ema"] = self.ema.module.state_dict()
        atomic_write(self.out / "model.pt", checkpoint.to_bytes(export))
        atomic_write(self.out / "summary.json", json.dumps(summary, indent=1).encode())
        print(f"done: {p.step} steps | loss "
              f"{summary['final_loss']} | val {val:.4f} | params {summary['params_sha256'][:16]} | {self.out}")
        return summary
