"""How long does a checkpoint stop training? Synchronous `store.save` vs `AsyncSaver.save`.

    python -m bench.ckpt_stall [--reps N] [--config configs/default.yaml] [section.key=value ...]
    python -m bench.ckpt_stall model.n_embd=512 model.n_layer=8     # a bigger model

Builds the model, optimizer and scheduler as train.py does, takes two real optimizer steps (so the
optimizer state exists), then times, interleaved, the training thread's stall: (a) the whole
synchronous save; (b) AsyncSaver.save until it returns (the CPU snapshot). The background write is
waited for outside the timed region; its save-to-done time is shown for reference. Then (c) what
the write costs training beside it: an async save followed by training steps until the write is
done (at least one), against the same number of steps with no write in flight, so the async
checkpoint's whole cost is its stall plus that slowdown. Medians go to the table and, with device
and command line, to bench/results/ckpt_stall.jsonl. A benchmark, not a test: figures depend on
the machine, its disk and the load beside it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, append_result, check_results, command, device_label, sync_device
from data import DATASETS
from loop import build, determinism
from loop.checkpoint import state, store
from loop.checkpoint.async_save import AsyncSaver
from loop.config.arguments import at_least
from loop.config.load import DEFAULT_CONFIG, config_hash, load_config, to_dict
from loop.device import pick_device
from loop.distributed.group import Dist
from loop.observe.metrics import NullLog
from loop.trainer import Trainer
from model import MODELS


def build_trainer(config: str, overrides: list[str]) -> Trainer:
    """train.py's wiring, then two real optimizer steps so AdamW's moments are in the state."""
    cfg = load_config(config, overrides, DATASETS, MODELS)
    if cfg.run.deterministic:
        determinism.enable()
    t = build.build_trainer(cfg, Dist(), pick_device(cfg.train.device), DATASETS, MODELS)
    t.log = NullLog()
    t.feed.start()
    for _ in range(2):
        t.step()
    return t


def capture(t: Trainer) -> dict[str, object]:
    """The checkpoint's files as a run writes them (loop/checkpoint/state.py)."""
    run = {"config": to_dict(t.cfg), "config_sha256": config_hash(t.cfg), "world_size": 1, "metadata": {}}
    return state.files(t.parts, 0, False, run)


def timed_steps(t: Trainer, n: int = 0, while_busy: AsyncSaver | None = None) -> tuple[int, float]:
    """Train `n` optimizer steps, or (with `while_busy`) steps until its write is done, at least one;
    return how many and their seconds."""
    done, t0 = 0, time.perf_counter()
    while done < n or (while_busy is not None and (done == 0 or while_busy.busy)):
        t.step()
        done += 1
    sync_device(t.device)
    return done, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=at_least(1), default=5, help="timed saves of each kind (default: %(default)s)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML preset (default: %(default)s)")
    p.add_argument("--results", type=Path, default=RESULTS / "ckpt_stall.jsonl")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layer=8")
    args = p.parse_args(argv)
    t = build_trainer(args.config, args.overrides)
    check_results(args.results)
    meta = {"config_sha256": config_hash(t.cfg), "world_size": 1}
    Path("runs").mkdir(exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="bench-ckpt-stall-", dir="runs"))  # the disk real runs use
    saver = AsyncSaver()
    times: dict[str, list[float]] = {"sync": [], "async": [], "async_done": [], "beside_write": [],
                                     "without_write": []}
    overlap: list[int] = []
    try:
        for rep in range(args.reps + 1):  # rep 0 warms up (allocator, page cache) and is not kept
            step = rep + 1
            # Interleaved, the order alternating, so drift in the machine hits every kind alike.
            for kind in ("sync", "async", "train") if rep % 2 else ("train", "async", "sync"):
                if kind == "train":  # (c): steps beside the write, then as many without one
                    saver.save(out / "train", step, capture(t), 1, meta)
                    n, beside = timed_steps(t, while_busy=saver)
                    saver.wait()
                    _, without = timed_steps(t, n)
                    if rep:
                        times["beside_write"].append(beside / n)
                        times["without_write"].append(without / n)
                        overlap.append(n)
                    continue
                sync_device(t.device)
                t0 = time.perf_counter()
                if kind == "sync":
                    store.save(out / "sync", step, capture(t), 1, meta)
                    stall = time.perf_counter() - t0
                else:
                    saver.save(out / "async", step, capture(t), 1, meta)
                    stall = time.perf_counter() - t0
                    saver.wait()  # outside the stall: training would be running here
                    if rep:
                        times["async_done"].append(time.perf_counter() - t0)
                if rep:
                    times[kind].append(stall)
        saver.close()
        size = sum(f.stat().st_size for f in (out / "sync" / f"step_{args.reps + 1:08d}").iterdir())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    device = device_label(t.device)
    n_params = sum(q.numel() for q in t.model.parameters())
    print(f"checkpoint {size / 1e6:.1f} MB | {n_params:,} parameters | {device} | torch {torch.__version__} "
          f"| {os.cpu_count()} CPUs | medians of {args.reps} saves each, interleaved")
    print(f"{'training thread blocked by':<38}{'median ms':>10}{'min':>9}{'max':>9}")
    rows = [("sync   store.save", "sync"), ("async  AsyncSaver.save (snapshot)", "async"),
            ("async  save -> write done (not a stall)", "async_done")]
    for label, k in rows:
        print(f"{label:<38}{med[k]:>10.1f}{min(times[k]) * 1e3:>9.1f}{max(times[k]) * 1e3:>9.1f}")
    print(f"stall ratio sync / async: {med['sync'] / med['async']:.1f}x")
    # What the background write takes from the steps beside it, per checkpoint: the async save's
    # whole cost is its stall plus this.
    slowdown = (med["beside_write"] - med["without_write"]) * statistics.median(overlap)
    print(f"training beside the async write: {med['beside_write']:.1f} ms/step vs "
          f"{med['without_write']:.1f} without, over {statistics.median(overlap):g} step(s) (median): "
          f"{slowdown:+.1f} ms per checkpoint; async total {med['async'] + slowdown:.1f} ms vs "
          f"sync {med['sync']:.1f} ms")
    append_result(args.results, "bench.ckpt_stall", argv, {
        "device": device, "reps": args.reps, "n_params": n_params, "ckpt_mb": round(size / 1e6, 2),
        "median_ms": {k: round(v, 2) for k, v in med.items()},
        "ratio_sync_over_async": round(med["sync"] / med["async"], 2),
        "steps_beside_write": statistics.median(overlap), "slowdown_ms": round(slowdown, 2),
        "async_total_ms": round(med["async"] + slowdown, 2)})
    return 0


if __name__ == "__main__":
    command(main)
