"""The end of a run: `summary.json`, the exported weights (`model.pt`), the text sample, and the
report (`report.md` + plots, loop/observe/report.py).

A preempted run skips all of it and exits fast: its checkpoint is written, and rerunning the same
command finishes the job and writes these then.
"""
from __future__ import annotations

import json
import sys

from loop import evaluate
from loop.checkpoint import store
from loop.checkpoint.atomic import atomic_write
from loop.config.load import to_dict
from loop.distributed import fsdp
from loop.observe.report import write_report


def close_sinks(t) -> None:
    """Close what rank 0 writes besides checkpoints, at the end of a run and on the way out of an
    error or Ctrl-C: the mirror first (it waits for its queued copies, so the newest checkpoint is
    mirrored before a run that gave up exits), the GPU sampler's thread, then the metrics file and
    TensorBoard's writer thread (a run called again in the same process, as from a notebook, leaves
    no thread behind)."""
    if t.mirror:
        t.mirror.close()
    if t.telemetry:
        t.telemetry.close()
    t.log.close()


def finish(t) -> dict:  # t: loop.trainer.Trainer
    p, m = t.progress, t.monitor.state
    if not t.preempted and not (t.last_eval and t.last_eval[0] == p.step):
        evaluate.validate(t)  # every rank takes part: validation all-reduces over ranks
    # Collectives with FSDP (gather the whole model, sample through it): every rank takes part.
    weights, sample = ({}, None) if t.preempted else (fsdp.full_state(t.raw), evaluate.sample(t))
    ema = fsdp.full_state(t.ema.module) if t.ema and not t.preempted else None
    if not t.dist.main:
        return {"steps": p.step, "preempted": t.preempted}
    if t.preempted:  # exit fast: the checkpoint is written, the rerun finishes the job
        close_sinks(t)
        print(f"preempted at step {p.step}; checkpoint written to {t.ckpt_root}")
        return {"steps": p.step, "preempted": True}
    val = t.last_eval[1]["val_loss"]
    summary = {
        "steps": p.step, "final_loss": t.log.last_loss, **t.last_eval[1],  # val_loss, val_...
        "params_sha256": store.params_sha256(weights), "wall_s": p.train_s,
        "tokens": p.tokens, "tokens_per_s": p.tokens / p.train_s if p.train_s else None,
        "skipped_steps": p.skipped, "overflow_steps": p.overflows, "empty_steps": p.empty,
        "best": {"metric": t.monitor.metric, "value": m.best, "step": m.best_step},
        "stopped_early": bool(m.stop_reason), "stop_reason": m.stop_reason or None,
        "rollbacks": p.rollbacks, "micro_batch": -(-t.cfg.data.batch_size // p.micro_split),
        "preempted": False, "precision": t.precision.name, "device": str(t.device),
        "optimal_loss": t.data.meta.get("optimal_loss"),
        "sample": sample, "lab_break": t.lab or None,
    }
    if ema is not None:
        summary["ema_params_sha256"] = store.params_sha256(ema)
    summary.update({k: v for k, v in t.telemetry.read(now=True).items()  # this session's energy and peak memory
                    if k in ("energy_j", "cuda_max_alloc_gb")})
    t.log.text(p.step, "sample", summary["sample"] or "")
    close_sinks(t)
    # FSDP: the consolidated model. "data": what it was trained on (tools.sample checks a corpus
    # by it; metadata.json beside it is rewritten by a later resume, on other data maybe).
    export = {"model": weights, "config": to_dict(t.cfg), "data": t.metadata.get("data")}
    if ema is not None:
        export["ema"] = ema
    atomic_write(t.out / "model.pt", store.to_bytes(export))
    atomic_write(t.out / "summary.json", json.dumps(summary, indent=1).encode())
    try:  # the run itself is done and saved: a report that cannot be drawn must not fail it
        r = t.cfg.report
        write_report([t.out], t.out, r.price_per_hour, r.co2_g_per_kwh, r.plots)
    except Exception as e:  # noqa: BLE001
        print(f"warning: report not written ({type(e).__name__}: {e})", file=sys.stderr)
    loss = "n/a" if summary["final_loss"] is None else summary["final_loss"]  # no step taken
    print(f"done: {p.step} steps | loss {loss} | val {val:.4f} | "
          f"params {summary['params_sha256'][:16]} | {t.out}")
    return summary
