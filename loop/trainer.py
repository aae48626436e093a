"""The honest loop. `Trainer(...).run()` resumes if it can, trains to `train.max_steps`, and writes
`summary.json`. The optimizer step (`_step`) reads top to bottom:

    lr (set by LambdaLR) -> micro-batches (forward, backward) -> unscale -> clip -> finite check
    -> step -> zero_grad -> log;   then eval and checkpoint.

Exact resume rests on three seams: the data position (global samples consumed by optimizer
steps, `Progress.samples`), every RNG stream captured in the checkpoint (`loop.rng`), and the LR
as a pure function of the optimizer step (`loop.schedule`).
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loop import checkpoint, rng
from loop.atomic import atomic_write
from loop.config import Config, config_hash, save as save_config, to_dict
from loop.errors import BadInput
from loop.metadata import collect as collect_metadata
from loop.metrics import MetricsLog
from data.sampler import train_loader, val_batches


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
        self.log: MetricsLog | None = None
        self.val = val_batches(data.val, cfg.data.batch_size, cfg.train.eval_batches, cfg.run.seed)
        self.last_eval: tuple[int, float] | None = None

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, object]:
        """Checkpoint files: shared state (rank 0) and this rank's RNG streams."""
        return {
            "state.pt": {
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "progress": asdict(self.progress), "config": to_dict(self.cfg),
                "config_sha256": config_hash(self.cfg), "world_size": 1,
            },
            "rng_rank0.pt": rng.capture(),
        }

    def resume(self) -> Path | None:
        """Pick the checkpoint per `run.resume` and load it. Runs before anything is written."""
        how = self.cfg.run.resume
        if how == "never":
            if checkpoint.step_dirs(self.ckpt_root):
                raise BadInput(f"run.resume=never, but {self.ckpt_root} already holds checkpoints "
                               f"that a fresh run would overwrite; use a new run.out_dir.")
            return None
        path = checkpoint.newest_valid(self.ckpt_root) if how == "auto" else Path(how)
        if path is None:
            return None
        reason = checkpoint.verify(path)
        if reason:
            raise BadInput(f"run.resume={how}: checkpoint {path} is not valid ({reason}).")
        state = checkpoint.load(path, "state.pt")
        bad = checkpoint.shape_mismatches(self.model, state["model"])
        if bad:
            raise BadInput(f"checkpoint {path} does not fit the configured model:\n  "
                           + "\n  ".join(bad) + "\nUse the config it was trained with.")
        changed = [k for k, v in _flat(state["config"]).items() if _flat(to_dict(self.cfg)).get(k) != v]
        if changed:
            print(f"note: config differs from the checkpoint's in: {', '.join(changed)}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when fp16 is off
            self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        rng.restore(checkpoint.load(path, "rng_rank0.pt"))  # last: nothing above draws from it
        print(f"resumed from {path} at step {self.progress.step}")
        return path

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        resumed = self.resume()
        cfg, tc = self.cfg, self.cfg.train
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml")
        meta = collect_metadata(config_hash(cfg), self.device, self.precision.name, 1)
        atomic_write(self.out / "metadata.json", json.dumps({**meta, "resumed_from": str(resumed)
                                                             if resumed else None}, indent=1).encode())
        self.log = MetricsLog(self.out, self.progress.step, self.progress.tokens, tc.max_steps)
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"{n_params:,} parameters | {self.device} | {self.precision.name} | global batch "
              f"{cfg.data.batch_size * tc.grad_accum} x {self.data.seq_len} tokens")
        loader = train_loader(self.data.train, cfg.data.batch_size, cfg.run.seed, self.progress.samples,
                              cfg.data.num_workers, cfg.data.prefetch_factor,
                              cfg.data.pin_memory and self.device.type == "cuda")
        batches = iter(loader)
        self.model.train()
        while self.progress.step < tc.max_steps:
            t0 = time.perf_counter()
            self._step(batches)
            step = self.progress.step
            if tc.eval_every and step % tc.eval_every == 0:
                self._evaluate(step)
            if step % tc.log_every == 0 or step == tc.max_steps:
                self.log.flush()
            self.progress.train_s += time.perf_counter() - t0
            if (tc.ckpt_every and step % tc.ckpt_every == 0) or step == tc.max_steps:
                self._save(step)
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

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for batch in self.val:
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with self.precision.autocast():
                total += self.model(batch).float()
            count += batch["n_targets"]
        self.model.train()
        val = (total / count).item()
        self.log.scalar(step, "val_loss", val)
        self.last_eval = (step, val)
        return val

    def _save(self, step: int) -> None:
        self.log.flush()  # metrics up to this step must be on disk before the checkpoint counts
        midway = None
        if step == self.cfg.faults.kill_in_ckpt_at_step:
            midway = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        checkpoint.save(self.ckpt_root, step, self.state(), self.cfg.train.keep_last, midway)

    def _finish(self) -> dict:
        p = self.progress
        val = self.last_eval[1] if self.last_eval and self.last_eval[0] == p.step else self._evaluate(p.step)
        summary = {
            "steps": p.step, "final_loss": self.log.last_loss, "val_loss": val,
            "params_sha256": checkpoint.params_sha256(self.model), "wall_s": p.train_s,
            "tokens": p.tokens, "tokens_per_s": p.tokens / p.train_s if p.train_s else None,
            "skipped_steps": p.skipped, "overflow_steps": p.overflows,
            "precision": self.precision.name, "device": str(self.device),
            "optimal_loss": self.data.meta.get("optimal_loss"), "sample": self._sample(),
        }
        self.log.text(p.step, "sample", summary["sample"] or "")
        self.log.close()
        atomic_write(self.out / "summary.json", json.dumps(summary, indent=1).encode())
        print(f"done: {p.step} steps | loss {summary['final_loss']} | val {val:.4f} | "
              f"params {summary['params_sha256'][:16]} | {self.out}")
        return summary

    def _sample(self) -> str | None:
        """A short text sample, drawn with its own generator so no training stream moves."""
        if not hasattr(self.model, "generate") or self.cfg.train.sample_tokens == 0:
            return None
        g = torch.Generator(self.device).manual_seed(self.cfg.run.seed)
        prompt = self.val[0]["x"][:1, :8].to(self.device)  # (1, 8)
        self.model.eval()
        ids = self.model.generate(prompt, self.cfg.train.sample_tokens, g)[0].tolist()
        self.model.train()
        return self.data.decode(ids)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
