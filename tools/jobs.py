"""Run train.py as a real job (plain `python` or `torchrun`), to the end or until it reports a
step and then gets a signal. Used by make verify (tools/audit_runs.py) and the tests' end-to-end
proofs (tests/conftest.py), so both kill and resume runs the same way a user's shell would.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# The last line of what run_until returns where the job ran past its timeout: its SIGKILL is then
# the watchdog's, not the signal asked for.
TIMED_OUT = "jobs: the job ran past its timeout and was killed\n"


def train_cmd(args: list[str], nproc: int = 0, restarts: int = 0) -> list[str]:
    """python train.py ARGS; or, with nproc, the same under torchrun with nproc processes."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"] if nproc else [sys.executable]
    return [*launcher, str(ROOT / "train.py"), *args]


def reported_step(line: str) -> int | None:
    """The step of a console progress line ('step     12/40 ...'), else None."""
    if not line.startswith("step"):
        return None
    try:
        return int(line.split()[1].split("/")[0])
    except (IndexError, ValueError):
        return None


def run_until(cmd: list[str], at_step: int, sig: int = signal.SIGKILL, group: bool = False,
              repeat: int = 1, tree: bool = False, cwd: Path | None = None, env: dict | None = None,
              timeout: float = 240, ready: Callable[[], bool] | None = None) -> tuple[int, str]:
    """Start a job; once it reports `at_step` (or a later step where `ready()` first holds, if
    given), send `sig` (`repeat` times; to the whole process group, as SLURM does, if `group`; to
    every process of a torchrun job if `tree`). Return its exit code and everything it printed. A
    job that hangs is killed after `timeout` seconds, and what it printed then ends with TIMED_OUT."""
    # A shell without job control starts background jobs with SIGINT ignored, and children inherit
    # that: a job sent SIGINT (Ctrl-C) must get Python's default handler back to notice it.
    reset = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sig == signal.SIGINT else None
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=group, env=env, preexec_fn=reset)
    timer = watchdog(proc, timeout)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            step = reported_step(line)
            if step is not None and step >= at_step and (ready is None or ready()):
                # torchrun's workers are not in its process group: signal each process of the job.
                pids = [*descendants(proc.pid), proc.pid] if tree else [proc.pid]
                for _ in range(repeat):
                    for pid in pids:
                        try:
                            os.killpg(pid, sig) if group and pid == proc.pid else os.kill(pid, sig)
                        except ProcessLookupError:  # a worker that ended since it was listed
                            pass
                break
        seen.append(proc.stdout.read())
        proc.wait(timeout=60)
    except BaseException:  # Ctrl-C, or a job that will not end: it goes too (a `kill -INT` reaches
        kill_tree(proc)  # the caller only)
        raise
    finally:
        timer.cancel()  # else its thread keeps the interpreter up to `timeout` seconds
    return proc.returncode, "".join([*seen, TIMED_OUT] if timer.fired else seen)


def watchdog(proc: subprocess.Popen, seconds: float) -> threading.Timer:
    """SIGKILL the process and its descendants after `seconds` unless cancelled; `.fired` says whether
    it did."""
    def fire() -> None:
        timer.fired = proc.poll() is None  # not a job that ended on its own just now
        kill_tree(proc)

    timer = threading.Timer(seconds, fire)
    timer.fired = False
    timer.start()
    return timer


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process and its descendants (torchrun's workers are not in its process group),
    the descendants first: once their parent is gone they can no longer be found."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Child processes, grandchildren first (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []
    return [d for k in kids for d in descendants(k)] + kids
