"""Step metrics to three sinks: console (every log interval), `metrics.jsonl` (every optimizer
step), and TensorBoard scalars under `tb/`.

Per-step loss and grad norm stay on the device until `flush()`, which reads them all in one host
transfer, so logging adds no sync per step. `metrics.jsonl` keeps losses at full float precision
(Python's repr round-trips). On resume, records after the checkpoint's step are dropped (they will
be produced again) and TensorBoard purges its events after that step, so both show one run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from loop.atomic import atomic_write


def truncate_jsonl(path: Path, last_step: int) -> list[dict]:
    """Keep records with step <= last_step (atomic rewrite); return them."""
    if not path.exists():
        return []
    keep = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= last_step]
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in keep).encode())
    return keep


class MetricsLog:
    def __init__(self, out_dir: Path, start_step: int, start_tokens: int, max_steps: int,
                 tensorboard: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.path, self.max_steps = out_dir / "metrics.jsonl", max_steps
        kept = truncate_jsonl(self.path, start_step)
        self.last_loss = kept[-1]["loss"] if kept else None
        self.file = open(self.path, "a")
        self.tb = SummaryWriter(out_dir / "tb", purge_step=start_step + 1) if tensorboard else None
        self.pending: list[tuple[dict, torch.Tensor]] = []  # (host fields, device [loss, gnorm])
        self.mark = (time.perf_counter(), start_step, start_tokens)  # (time, step, tokens) at last flush

    def record(self, fields: dict, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append((fields, torch.stack([loss.float(), grad_norm.float()])))

    def scalar(self, step: int, name: str, value: float) -> None:
        """A value known on the host now (e.g. val loss): merged into that step's record."""
        for fields, _ in reversed(self.pending):
            if fields["step"] == step:
                fields[name] = value
        if self.tb:
            self.tb.add_scalar(name.replace("_", "/", 1), value, step)

    def text(self, step: int, name: str, value: str) -> None:
        if self.tb:
            self.tb.add_text(name, value, step)

    def flush(self) -> None:
        if not self.pending:
            return
        values = torch.stack([v for _, v in self.pending]).tolist()  # the one host read
        for (fields, _), (loss, gnorm) in zip(self.pending, values):
            rec = {**fields, "loss": loss, "grad_norm": gnorm}
            self.file.write(json.dumps(rec) + "\n")
            if self.tb:
                for k in ("loss", "lr", "grad_norm"):
                    self.tb.add_scalar(f"train/{k}", rec[k], rec["step"])
        self.file.flush()
        self._console(rec)
        self.last_loss, self.pending = rec["loss"], []

    def _console(self, rec: dict) -> None:
        now, (t0, s0, tok0) = time.perf_counter(), self.mark
        steps, tokens, dt = rec["step"] - s0, rec["tokens"] - tok0, max(now - t0, 1e-9)
        self.mark = (now, rec["step"], rec["tokens"])
        eta = (self.max_steps - rec["step"]) * dt / max(steps, 1)
        if self.tb:
            self.tb.add_scalar("train/tokens_per_s", tokens / dt, rec["step"])
        print(f"step {rec['step']:>6}/{self.max_steps} ({100 * rec['step'] / max(self.max_steps, 1):3.0f}%)"
              f" | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f}"
              f" | {tokens / dt:,.0f} tok/s | {1000 * dt / max(steps, 1):.1f} ms/step"
              f" | ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}", flush=True)

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self.tb:
            self.tb.close()


class NullLog:
    """What ranks other than 0 log: nothing (rank 0 logs the global values)."""
    last_loss = None

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args) -> None:
        pass

    scalar = text = flush = close = record
