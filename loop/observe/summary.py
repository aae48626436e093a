"""What a run says at its start (one line: parameters, device, precision, processes, global batch)
and leaves at its end: `summary.json`, the exported weights (`model.pt`) and the report (`report.md`
+ plots, loop/observe/report.py). A preempted run leaves none of the end's: its checkpoint is
written, and rerunning the same command finishes the job and writes them then.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from loop.checkpoint import store
from loop.checkpoint.atomic import atomic_write
from loop.config.load import to_dict
from loop.distributed import fsdp
from loop.observe.report import write_report


def start_line(raw: torch.nn.Module, model: torch.nn.Module, sharded: bool, device: torch.device,
               precision: str, world: int, batch: int, seq_len: int) -> str:
    """`batch`: samples per process per optimizer step (data.batch_size x train.grad_accum)."""
    n_params = sum(p.numel() for p in raw.parameters())
    frozen = sum(p.numel() for p in raw.parameters() if not p.requires_grad)  # not trained
    params = f"{n_params:,} parameters" + (f" ({frozen:,} frozen)" if frozen else "")
    layout = "fsdp" if sharded else "ddp" if raw is not model else "no process group"
    if torch.distributed.is_initialized():
        layout += f" over {torch.distributed.get_backend()}"  # nccl on CUDA, else gloo
    return (f"{params} | {device} | {precision} | {world} process(es), {layout} | global batch "
            f"{batch * world} samples of {seq_len} target(s)")


def finish(out: Path, preempted: bool, parts: dict, evaluator, log, dist, cfg, data: dict | None,
           facts: dict) -> dict:
    """The end of a run (every rank calls it): validation, if the last step had none, and the
    whole model; then, on rank 0, summary.json, model.pt and the report in `out`. `parts`: the
    checkpoint's (loop/trainer.py); `data`: what it was trained on (metadata.json's "data");
    `facts`: summary.json's precision, device, lab_break, optimal_loss and micro_batch."""
    p, monitor, ema = parts["progress"], parts["monitor"], parts["ema"]
    if preempted:
        log.close()
        dist.say(f"preempted at step {p.step}; checkpoint written to {out / 'checkpoints'}")
        return {"steps": p.step, "preempted": True}
    fresh = not (evaluator.last and evaluator.last[0] == p.step)  # no step evaluated in this start
    if fresh:
        evaluator.validate()  # every rank takes part: validation sums over ranks
    # Collectives with FSDP (gather the whole model, sample through it): every rank takes part.
    weights, sample = fsdp.full_state(parts["model"]), evaluator.sample()
    averaged = fsdp.full_state(ema.module) if ema else None
    if not dist.main:
        return {"steps": p.step, "preempted": False}
    m = monitor.state
    # Early only if it ended the run before train.max_steps: run out at the last step, it changed nothing.
    stop_reason = m.stop_reason if p.step < cfg.train.max_steps else ""
    summary = {
        "steps": p.step, "final_loss": log.last_loss, **evaluator.last[1],  # val_loss, val_...
        "params_sha256": store.params_sha256(weights), "wall_s": p.train_s,
        "tokens": p.tokens, "tokens_per_s": p.tokens / p.train_s if p.train_s else None,
        "skipped_steps": p.skipped, "overflow_steps": p.overflows, "empty_steps": p.empty,
        "best": {"metric": monitor.metric, "value": m.best, "step": m.best_step},
        "stopped_early": bool(stop_reason), "stop_reason": stop_reason or None,
        "rollbacks": p.rollbacks, "preempted": False, **facts, "sample": sample,
    }
    if averaged is not None:
        summary["ema_params_sha256"] = store.params_sha256(averaged)
    # The run's energy (over its starts) and this start's peak memory, NVML read now (not at its last tick).
    summary.update({k: v for k, v in log.readings().items() if k in ("energy_j", "cuda_max_alloc_gb")})
    if fresh and sample and "sample" not in log.kept:  # else an evaluation of this step logged it
        log.text(p.step, "sample", sample)
    log.close()
    write(out, summary, weights, averaged, to_dict(cfg), data, cfg.report)
    return summary


def write(out: Path, summary: dict, weights: dict, ema: dict | None, config: dict, data: dict | None,
          report) -> None:
    """model.pt, summary.json and the report into run directory `out`; then the run's last line.
    model.pt holds the whole model (FSDP: consolidated), its config and `data`, what it was trained
    on (tools/sample.py checks a corpus by it; metadata.json is rewritten by a later resume)."""
    export = {"model": weights, "config": config, "data": data}
    if ema is not None:
        export["ema"] = ema
    atomic_write(out / "model.pt", store.to_bytes(export))
    atomic_write(out / "summary.json", json.dumps(summary, indent=1).encode())
    try:  # the run itself is done and saved: a report that cannot be drawn must not fail it
        write_report([out], out, report.price_per_hour, report.co2_g_per_kwh, report.plots)
    except Exception as e:  # noqa: BLE001
        print(f"warning: report not written ({type(e).__name__}: {e})", file=sys.stderr)
    loss = "n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"  # None: no step taken
    evals = " | ".join(f"{k} {v:.4f}" for k, v in summary.items() if k.startswith("val_"))  # val_loss, ...
    print(f"done: {summary['steps']} steps | loss {loss} | {evals} | params {summary['params_sha256'][:16]} | {out}")
