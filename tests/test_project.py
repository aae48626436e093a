"""The loop's promises on this project's own default run (configs/default.yaml: its data set and
model, whatever they are): it trains, a run SIGKILLed and rerun is bit-identical to one that never
stopped, a checkpoint holds every part and loads as plain tensors, and bad input is exit 2 with
nothing written. A project made by `make new-project` runs these on its own model and data; its
full proof is `make verify`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tools import jobs

os.environ["OMP_NUM_THREADS"] = "1"  # float sums split the same way in every run compared
ROOT = Path(__file__).resolve().parents[1]
SHORT = ["train.max_steps=12", "train.ckpt_every=4", "train.eval_every=4", "train.log_every=1",
         "train.device=cpu", "report.plots=false"]


def train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(jobs.train_cmd([f"run.out_dir={out}", *SHORT, *overrides]), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_a_run_sigkilled_and_rerun_is_bit_identical_to_one_that_never_stopped(tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert train(straight).returncode == 0
    code, printed = jobs.run_until(jobs.train_cmd([f"run.out_dir={cut}", *SHORT]), 9, cwd=ROOT)
    assert code == -signal.SIGKILL, printed
    again = train(cut)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from" in again.stdout, again.stdout
    assert losses(cut) == losses(straight) and len(losses(cut)) == 12
    assert summary(cut)["params_sha256"] == summary(straight)["params_sha256"]


def test_a_checkpoint_holds_every_part_as_plain_tensors(tmp_path):
    from loop.checkpoint import store

    out = tmp_path / "run"
    assert train(out, "train.max_steps=4").returncode == 0
    ckpt = out / "checkpoints" / "step_00000004"
    assert store.verify(ckpt) is None
    state = store.load(ckpt, "state.pt")  # torch.load(weights_only=True): nothing that runs code
    for part in ("model", "optimizer", "scheduler", "scaler", "ema", "monitor", "progress"):
        assert part in state, part
    assert state["progress"]["step"] == 4 and state["world_size"] == 1
    assert all(torch.is_tensor(t) for t in state["model"].values())
    assert store.load(ckpt, "rng_rank0.pt").keys() >= {"python", "numpy", "torch"}


def test_bad_input_is_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    bad = train(out, "train.max_stepz=3")
    assert bad.returncode == 2 and "train.max_stepz" in bad.stderr and "Traceback" not in bad.stderr
    assert not out.exists()
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    refused = subprocess.run([sys.executable, "train.py", "--config", str(empty), f"run.out_dir={out}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and str(empty) in refused.stderr and not out.exists()
