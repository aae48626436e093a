"""Shared helpers for end-to-end tests: run train.py as a real subprocess, kill it, read its files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The default config, shrunk so a 40-step run takes about a second after startup.
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.seq_len=32",
        "data.batch_size=4", "train.log_every=1", "train.eval_every=10", "train.eval_batches=2",
        "train.sample_tokens=16"]


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """One data cache for the whole session, so the corpus is prepared once."""
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "train.py", f"run.out_dir={out}", *TINY, *overrides]


def run_train(out: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(out, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_and_signal(out: Path, at_step: int, *overrides: str, sig: int = signal.SIGKILL,
                   group: bool = False, repeat: int = 1) -> tuple[int, str]:
    """Start a run; once it reports `at_step`, send `sig` (`repeat` times; to the whole process
    group, as SLURM does, if `group`). Return its exit code and everything it printed."""
    proc = subprocess.Popen(train_cmd(out, *overrides), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=group)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= at_step:
            for _ in range(repeat):
                os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
            break
    seen.append(proc.stdout.read())
    proc.wait(timeout=60)
    return proc.returncode, "".join(seen)


def run_and_kill(out: Path, at_step: int, *overrides: str) -> str:
    """Start a run and SIGKILL it as soon as it reports `at_step`; return what it printed."""
    code, printed = run_and_signal(out, at_step, *overrides)
    assert code == -signal.SIGKILL, printed
    return printed


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())
