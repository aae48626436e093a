"""One run per run directory (loop/checkpoint/runlock.py): a second train.py on an out_dir in use exits 2
naming the holder and changes nothing; the lock goes with its process, even a SIGKILLed one."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from conftest import ROOT, run_train, summary, train_here

HOLD = "import sys; from pathlib import Path; from loop.checkpoint import runlock; " \
       "runlock.hold(Path(sys.argv[1]), sign=True); print('held', flush=True); sys.stdin.read()"


def snapshot(out) -> dict:
    return {p.relative_to(out): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2])
def test_a_second_run_on_an_out_dir_in_use_exits_2_and_changes_nothing(tmp_path, cache, nproc):
    out = tmp_path / "run"
    run_train(out, cache, "train.max_steps=4", "train.ckpt_every=2")
    # Another process holds the directory, as a first run still training would.
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == "held\n"
    before = snapshot(out)
    second = run_train(out, cache, "train.max_steps=8", "train.ckpt_every=2", check=False, nproc=nproc)
    said = f"error: run.out_dir {out}: another run is using it (pid {holder.pid} on "
    assert said in second.stderr, second.stderr
    if nproc:  # torchrun ends with 1 when a worker fails, names its exit code, and stops the rest
        assert second.returncode == 1 and "exitcode  : 2 " in second.stderr, second.stderr
    else:
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert "resumed from" not in second.stdout
    assert snapshot(out) == before
    # Killed, the holder leaves no stale lock: the same command now resumes and finishes.
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    third = run_train(out, cache, "train.max_steps=8", "train.ckpt_every=2", nproc=nproc)
    assert "resumed from" in third.stdout and summary(out)["steps"] == 8


@pytest.mark.slow
def test_a_directory_no_run_made_that_holds_a_file_a_run_writes_is_refused(tmp_path, cache):
    # run.out_dir=. in a project, or a home directory: refused, or the run would overwrite the
    # user's model.pt.
    from loop.checkpoint.runlock import RUN_FILES

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.pt").write_text("my own weights")
    (mine / "notes.txt").write_text("mine too")
    before = snapshot(mine)
    proc = run_train(mine, cache, "train.max_steps=2", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.endswith(
        f"error: run.out_dir {mine} holds model.pt, which a run writes, and no run made it (no .lock, "
        f"nor a metadata.json a run wrote): a run would overwrite them. Expected a new or empty directory, or a "
        f"run's; give another run.out_dir, or move them.\n"), proc.stderr
    assert snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["model.pt", "notes.txt"]
    # A directory holding only other files (a scheduler's log written before the run) is fine,
    # and what a run writes there, profile and plots included, is what RUN_FILES lists.
    (mine / "model.pt").unlink()
    run_train(mine, cache, "train.max_steps=8", "train.profile=true", "report.plots=true")
    made = {p.name for p in mine.iterdir()} - {"notes.txt", ".lock"}
    assert made <= set(RUN_FILES) and {"model.pt", "profile", "lr.png", "tb"} <= made, made


@pytest.mark.parametrize("mark, is_a_runs", [
    (".lock", True), ("metadata.json", True),
    ("a user's metadata.json", False),  # taken as a mark, their model.pt would be overwritten
])
def test_a_directory_with_a_run_s_mark_is_a_runs(tmp_path, mark, is_a_runs):
    # A run killed between its .lock and its metadata.json (config.yaml comes between them), or a
    # run directory copied without its .lock: either mark says a run made it, and its files are
    # that run's to write again. A metadata.json of the user's own is no such mark.
    import json

    from loop.checkpoint import runlock
    from loop.errors import BadInput

    (tmp_path / "config.yaml").write_text("")
    if mark == ".lock":
        (tmp_path / ".lock").write_text("")
    else:
        meta = {"code_sha256": "ab12"} if mark == "metadata.json" else {"mine": 1}
        (tmp_path / "metadata.json").write_text(json.dumps(meta))
    if is_a_runs:
        runlock.refuse_foreign(tmp_path)
    else:
        with pytest.raises(BadInput, match="holds config.yaml, metadata.json, which a run writes"):
            runlock.refuse_foreign(tmp_path)


def test_a_run_in_this_process_leaves_the_directory_free_when_it_ends(tmp_path, cache):
    # A notebook that has called train.py's main must not keep the lock until it closes, or the
    # command line's resume of that run exits 2, "another run is using it (pid ...)".
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=3")
    bad = train_here(out, cache, "train.max_steps=4", "model.n_embd=64", check=False)  # refused after locking
    assert bad.returncode == 2, bad.stderr
    run_train(out, cache, "train.max_steps=5")
    assert summary(out)["steps"] == 5


def test_a_filesystem_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import errno

    from loop.checkpoint import runlock

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(runlock.fcntl, "lockf", no_locks)
    runlock.hold(tmp_path, sign=True)
    assert capsys.readouterr().out == (f"note: cannot lock {tmp_path.resolve() / '.lock'} (No locks "
                                       f"available): a second run on this run.out_dir would not be "
                                       f"noticed\n")
    assert (tmp_path / ".lock").read_text() == ""  # nothing signed without a lock


def test_the_lock_names_its_holder_only_once_the_run_writes(tmp_path):
    # Locked, a run may still find bad input (exit 2, nothing changed in the directory); once it
    # writes, the lock names it in full, however long the name of the holder before it.
    import os
    import socket

    from loop.checkpoint import runlock

    (tmp_path / ".lock").write_text("pid 4194303 on the-previous-holders-rather-long-host-name")
    runlock.hold(tmp_path)
    assert (tmp_path / ".lock").read_text() == "pid 4194303 on the-previous-holders-rather-long-host-name"
    runlock.hold(tmp_path, sign=True)
    assert (tmp_path / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}"


def test_a_run_inside_what_another_run_writes_is_refused(tmp_path, cache):
    # A run in another run's checkpoint directory is refused: it would train and end well, and when
    # the other run goes on, its pruning would delete that step directory and the run inside it.
    outer = tmp_path / "outer"
    train_here(outer, cache, "train.max_steps=2", "train.ckpt_every=1", "train.keep_last=1")
    step = outer / "checkpoints" / "step_00000002"
    before = snapshot(outer)
    for inner in (step / "mine", outer / "tb" / "mine", outer / "checkpoints"):
        bad = train_here(inner, cache, "train.max_steps=1", check=False)
        assert bad.returncode == 2 and bad.stderr.endswith(
            f"error: run.out_dir {inner} is inside {outer / inner.relative_to(outer).parts[0]}, which "
            f"the run in {outer} writes and prunes; expected a directory outside what a run writes. "
            f"Give another run.out_dir.\n"), bad.stderr
    assert snapshot(outer) == before and not (step / "mine").exists()
    # Beside the run's own files, or in another directory of the user's there, is fine.
    train_here(outer / "ablation", cache, "train.max_steps=1")
    assert summary(outer / "ablation")["steps"] == 1


def test_bad_input_leaves_no_lock_in_a_directory_it_wrote_nothing_in(tmp_path, cache):
    # The .lock of a run refused after locking (a run.resume that is not there) must not stay: it
    # would mark the user's directory as a run's, and a model.pt they put there next would be
    # overwritten by the next run.
    mine = tmp_path / "mine"
    mine.mkdir()
    bad = train_here(mine, cache, f"run.resume={tmp_path / 'missing'}", check=False)
    assert bad.returncode == 2 and not list(mine.iterdir()), bad.stderr
    (mine / "model.pt").write_text("my own weights")
    again = train_here(mine, cache, "train.max_steps=1", check=False)
    assert again.returncode == 2 and "holds model.pt, which a run writes" in again.stderr
    assert (mine / "model.pt").read_text() == "my own weights"
    # A run's own directory keeps its .lock: the mark that it is a run's.
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=1")
    assert train_here(out, cache, f"run.resume={tmp_path / 'missing'}", check=False).returncode == 2
    assert (out / ".lock").exists()


def test_an_out_dir_the_file_system_will_not_make_is_bad_input(tmp_path, monkeypatch):
    # /proc takes no new directory even where its permission bits let root write: the check
    # before the run passes, and mkdir is where it fails.
    import errno
    from pathlib import Path

    from loop.checkpoint import runlock
    from loop.errors import BadInput

    with pytest.raises(BadInput, match=r"^config key run.out_dir=/proc/honest_loop_x: cannot make"):
        runlock.claim(Path("/proc/honest_loop_x"))
    # A full disk stays a full disk: exit 3 naming the room wanted (train.py), not bad input.
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(OSError) as e:
        runlock.claim(tmp_path / "run")
    assert e.value.errno == errno.ENOSPC and not isinstance(e.value, BadInput)


def test_a_lock_that_is_a_symbolic_link_is_refused_and_nothing_outside_is_written(tmp_path):
    # The run wrote its name into the file the link named (or made it, for a dangling link), and on
    # the bad-input path deleted the link.
    from loop.checkpoint import runlock
    from loop.errors import BadInput

    (tmp_path / "victim").write_text("precious")
    for target in (tmp_path / "victim", tmp_path / "made_by_run"):
        out = tmp_path / f"run_{target.name}"
        out.mkdir()
        (out / ".lock").symlink_to(target)
        with pytest.raises(BadInput, match=r"\.lock is a symbolic link"):
            runlock.hold(out, sign=True)
        runlock.release()
        assert (out / ".lock").is_symlink()
    assert (tmp_path / "victim").read_text() == "precious" and not (tmp_path / "made_by_run").exists()
