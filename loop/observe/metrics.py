"""Step metrics to three sinks: console (every log interval), `metrics.jsonl` (every optimizer
step), and TensorBoard scalars under `tb/`.

Every step's record has step, loss, lr, grad_norm, tokens, samples, skipped (its update was not
applied: a non-finite or fp16-overflowed step, or one with no targets), data_ms (time the loop
waited for data), micro_batch (smaller after an out-of-memory split), ids with data.log_ids and,
on CUDA, gpu_ms (the step's time on the GPU's timeline, from CUDA events recorded at each step's
end and read at the flush, so no extra sync). The last record of each log
interval adds the interval's tokens_per_s, samples_per_s, ms_per_step, data_wait_pct, MFU where the
device's peak is known, and the host telemetry (CUDA memory, NVML readings). Rank 0 logs for all
ranks: loss, grad_norm and the counts are global; timings, memory and NVML readings are rank 0's.

Per-step loss and grad norm stay on the device until `flush()`, which reads them all in one host
transfer, so logging adds no sync per step. `metrics.jsonl` keeps losses at full float precision
(Python's repr round-trips). On resume, records after the checkpoint's step are dropped (they will
be produced again) and TensorBoard purges its events after that step, so both show one run.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch

from loop.checkpoint.atomic import naming
from loop.observe import jsonl
from loop.observe.report import hms


class MetricsLog:
    def __init__(self, out_dir: Path, start_step: int, start_tokens: int, start_samples: int,
                 max_steps: int, tensorboard: bool = True, telemetry=None, unit: str = "tokens"):
        """`telemetry`: loop/observe/telemetry.py's readings and MFU, closed with the log; `unit`:
        what the console calls a target (loop/data/bundle.py::Data.unit)."""
        self.out_dir, self.path, self.max_steps = out_dir, out_dir / "metrics.jsonl", max_steps
        self.tensorboard, self.telemetry, self.unit = tensorboard, telemetry, unit
        self.last_event = None  # CUDA event at the end of the last logged step
        self._open(start_step, start_tokens, start_samples)
        # NVML counts energy from this start of train.py on; the earlier starts' is the newest
        # reading the log keeps (a checkpoint flushes the log: its step's record ends an interval),
        # so energy_j is the run's.
        self.energy_before = (jsonl.last_with(self.path, "energy_j") or {}).get("energy_j", 0.0)

    def _open(self, step: int, tokens: int, samples: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        last = jsonl.truncate(self.path, step)
        self.kept = last or {}  # the resumed step's record: what it logged (a sample) is not logged twice
        loss = last.get("loss") if last else None  # a record edited by hand may lack it
        self.last_loss = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
        self.file = open(self.path, "a")
        self.tb = SummaryWriter(self.out_dir / "tb", purge_step=step + 1) if self.tensorboard else None
        if self.tb:
            _quiet_tensorboard_thread()
        self.pending: list[tuple[dict, torch.Tensor]] = []  # (host fields, device [loss, gnorm])
        self.mark = (time.perf_counter(), step, tokens, samples)  # at the last flush

    def rewind(self, step: int, tokens: int, samples: int) -> None:
        """Back to `step` (a rollback): the records after it go, as at a resume."""
        self._close_files()
        self._open(step, tokens, samples)

    def readings(self, now: bool = True) -> dict:
        """The telemetry's readings (`now`, at the run's end: NVML read first, not its last tick),
        energy_j the run's over every start of train.py (gpu<i>/energy_j: this start's)."""
        out = self.telemetry.read(now=now) if self.telemetry else {}
        if "energy_j" in out:
            out["energy_j"] += self.energy_before
        return out

    def record(self, fields: dict, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if loss.is_cuda:  # mark the end of this step on the GPU's own timeline: no sync
            fields["_event"] = torch.cuda.Event(enable_timing=True)
            # On the loss's device: record() alone takes the current device's stream, cuda:0's
            # under train.device=cuda:1, where no step runs.
            fields["_event"].record(torch.cuda.current_stream(loss.device))
        self.pending.append((fields, torch.stack([loss.float(), grad_norm.float()])))

    def scalar(self, step: int, name: str, value: float) -> None:
        """A value known on the host now (e.g. val loss): merged into that step's record."""
        self._merge(step, name, value)
        if self.tb:
            with naming(self.tb.log_dir):
                self.tb.add_scalar(name.replace("_", "/", 1), value, step)

    def text(self, step: int, name: str, value: str) -> None:
        """A text (e.g. a model sample): into that step's record and TensorBoard's text tab."""
        self._merge(step, name, value)
        if self.tb:
            with naming(self.tb.log_dir):
                self.tb.add_text(name, value, step)

    def _merge(self, step: int, name: str, value) -> None:
        for fields, _ in reversed(self.pending):
            if fields["step"] == step:
                fields[name] = value

    def flush(self, console: bool = True) -> None:
        """The pending records to disk and TensorBoard, their interval's rates on the last; the
        console's step line unless `console` is false (a checkpoint's flush between log steps)."""
        if not self.pending:
            return
        # Taken off first: if a write below fails (a full disk), the flush on the way out must not
        # write them again after the part already written.
        pending, self.pending = self.pending, []
        values = torch.stack([v for _, v in pending]).tolist()  # the one host read
        recs = [{**f, "loss": loss, "grad_norm": g} for (f, _), (loss, g) in zip(pending, values)]
        for rec in recs:  # GPU time per step, between step-end events (complete after the read above)
            event = rec.pop("_event", None)
            if event is not None and self.last_event is not None:
                rec["gpu_ms"] = self.last_event.elapsed_time(event)
            self.last_event = event or self.last_event
        recs[-1].update(self._interval(recs))  # rates over the interval, on its last step
        with naming(self.path):
            self.file.write("".join(json.dumps(rec) + "\n" for rec in recs))
            self.file.flush()
        for rec in recs if self.tb else []:
            with naming(self.tb.log_dir):
                for k, v in rec.items():  # val_ metrics are under val/ already (`scalar`)
                    if k != "step" and not k.startswith("val_") and isinstance(v, (int, float)) \
                            and not isinstance(v, bool):
                        self.tb.add_scalar(f"train/{k}", v, rec["step"])
        if console:
            self._console(recs[-1])
        for rec in recs:  # the validation metrics of every evaluation in the interval
            if evals := [f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("val_")]:
                print(f"eval {rec['step']:>6}/{self.max_steps} | {' | '.join(evals)}", flush=True)
        self.last_loss = recs[-1]["loss"]

    def _interval(self, recs: list[dict]) -> dict:
        now, (t0, s0, tok0, smp0) = time.perf_counter(), self.mark
        last = recs[-1]
        self.mark = (now, last["step"], last["tokens"], last["samples"])
        dt, steps = max(now - t0, 1e-9), max(last["step"] - s0, 1)
        out = {"tokens_per_s": (last["tokens"] - tok0) / dt, "samples_per_s": (last["samples"] - smp0) / dt,
               "ms_per_step": 1000 * dt / steps,
               "data_wait_pct": 100 * sum(r["data_ms"] for r in recs) / (1000 * dt)}
        if self.telemetry is None:
            return out
        if (m := self.telemetry.mfu(out["samples_per_s"])) is not None:
            out["mfu"] = m
        return {**out, **self.readings(now=False)}

    def _console(self, rec: dict) -> None:
        eta = (self.max_steps - rec["step"]) * rec["ms_per_step"] / 1000
        extra = f" | MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else ""
        extra += f" | mem {rec['cuda_max_alloc_gb']:.1f} GB" if "cuda_max_alloc_gb" in rec else ""
        print(f"step {rec['step']:>6}/{self.max_steps} ({100 * rec['step'] / max(self.max_steps, 1):3.0f}%)"
              f" | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f}"
              f" | {rec['tokens_per_s']:,.0f} {'tok' if self.unit == 'tokens' else self.unit}/s"
              f" | {rec['ms_per_step']:.1f} ms/step"
              f" | data {rec['data_wait_pct']:.1f}%{extra}"
              f" | ETA {hms(eta)}", flush=True)  # not strftime: its %H wraps at a day

    def close(self) -> None:
        """Everything on disk, and the file, TensorBoard's writer thread and the telemetry's closed
        (a run called again in the same process, as from a notebook, leaves no thread behind)."""
        try:
            self._close_files()
        finally:
            if self.telemetry:
                self.telemetry.close()

    def _close_files(self) -> None:
        self.flush()
        self.file.close()
        if self.tb:
            with naming(self.tb.log_dir):
                self.tb.close()


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes its event file on a thread of its own. A write the disk refuses there
    would print that thread's traceback in the middle of train.py's one-line exit 3 for the same
    error; the thread keeps the error, and the next TensorBoard call here raises it again (naming
    the directory), so that traceback is left out. Every other thread's is printed."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__module__ != "tensorboard.summary.writer.event_file_writer":
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


class NullLog:
    """What ranks other than 0 log: nothing (rank 0 logs the global values)."""
    last_loss, kept = None, {}

    def record(self, *args, **kwargs) -> None:
        pass

    scalar = text = flush = close = rewind = record

    def readings(self, now: bool = True) -> dict:
        return {}
