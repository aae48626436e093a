"""Shared helpers for end-to-end tests: run train.py as a real subprocess, kill it, read its files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The default config, shrunk so a 40-step run takes about a second after startup.
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.seq_len=32",
        "data.batch_size=4", "train.log_every=1", "train.eval_every=10", "train.eval_batches=2",
        "train.sample_tokens=16", "report.plots=false"]  # plots: tests/test_report.py


@pytest.fixture(scope="module")
def one_thread():
    """In-process tests of tiny models: a second intra-op thread only adds sync cost, and on a
    shared 2-core box spinning OpenMP threads can slow them down many times over."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """One data cache for the whole session, so the corpus is prepared once."""
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


def train_cmd(out: Path, *overrides: str, nproc: int = 0, restarts: int = 0) -> list[str]:
    """python train.py ...; or, with nproc, the same under torchrun with nproc processes."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"] if nproc else [sys.executable]
    return [*launcher, "train.py", f"run.out_dir={out}", *TINY, *overrides]


# Two processes share two cores: one thread each keeps them from fighting over them.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
DIST = ["train.max_steps=20", "train.ckpt_every=5", "model.dropout=0"]  # multi-process test runs


@pytest.fixture(scope="session")
def two_proc(tmp_path_factory, cache) -> Path:
    """A 2-process DDP run of DIST: the reference the multi-process tests compare with."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    run_train(out, cache, *DIST, nproc=2)
    return out


def run_train(out: Path, *overrides: str, check: bool = True, nproc: int = 0,
              restarts: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(out, *overrides, nproc=nproc, restarts=restarts), cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV if nproc else None)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_and_signal(out: Path, at_step: int, *overrides: str, sig: int = signal.SIGKILL,
                   group: bool = False, repeat: int = 1, nproc: int = 0) -> tuple[int, str]:
    """Start a run; once it reports `at_step`, send `sig` (`repeat` times; to the whole process
    group, as SLURM does, if `group`). Return its exit code and everything it printed."""
    proc = subprocess.Popen(train_cmd(out, *overrides, nproc=nproc), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=group,
                            env=ENV if nproc else None)
    timer = watchdog(proc)  # a job that hangs before at_step fails the test, not the suite
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= at_step:
            # torchrun's workers are not in its process group: signal each process of the job.
            pids = [*descendants(proc.pid), proc.pid] if nproc else [proc.pid]
            for _ in range(repeat):
                for pid in pids:
                    os.killpg(pid, sig) if group and pid == proc.pid else os.kill(pid, sig)
            break
    seen.append(proc.stdout.read())
    proc.wait(timeout=60)
    timer.cancel()
    return proc.returncode, "".join(seen)


def watchdog(proc: subprocess.Popen, seconds: float = 240) -> threading.Timer:
    """SIGKILL the process and its descendants after `seconds` unless cancelled."""
    timer = threading.Timer(seconds, lambda: [os.kill(p, signal.SIGKILL) for p in
                                              [*descendants(proc.pid), proc.pid]])
    timer.start()
    return timer


def descendants(pid: int) -> list[int]:
    """Child processes, grandchildren first (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []
    return [d for k in kids for d in descendants(k)] + kids


def run_and_kill(out: Path, at_step: int, *overrides: str) -> str:
    """Start a run and SIGKILL it as soon as it reports `at_step`; return what it printed."""
    code, printed = run_and_signal(out, at_step, *overrides)
    assert code == -signal.SIGKILL, printed
    return printed


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())
