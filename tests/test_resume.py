"""Exact resume, end to end: a run SIGKILLed at random moments and rerun with the same command ends
bit-identical (params_sha256, every per-step loss, grad norm and lr) to a run never interrupted."""
from __future__ import annotations

import errno
import os
import random
import re
import signal
import socket
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    ROOT,
    assert_wall_time_sums_the_steps,
    metrics,
    run_and_kill,
    run_and_signal,
    run_train,
    summary,
    train_cmd,
    watchdog,
)
from loop.guards.console import gone
from tools.jobs import reported_step, run_until

STEPS = ["train.max_steps=40", "train.ckpt_every=10"]
RNG = random.Random()  # a fresh draw each test run; every assertion message carries the steps


def resumed_at(stdout: str) -> int:
    m = re.search(r"resumed from \S+ at step (\d+)", stdout)
    assert m, stdout
    return int(m.group(1))


def assert_identical(ref, out, note: str) -> None:
    a, b = metrics(ref), metrics(out)
    assert [r["step"] for r in b] == list(range(1, 41)), f"{note}: each step once"
    for x, y in zip(a, b):
        assert (x["loss"], x["grad_norm"], x["lr"]) == (y["loss"], y["grad_norm"], y["lr"]), \
            f"{note}: step {x['step']} differs"
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"], note
    assert summary(out)["val_loss"] == summary(ref)["val_loss"], note
    tb = EventAccumulator(str(out / "tb"))  # one run in TensorBoard too: the killed run's steps
    tb.Reload()  # after the checkpoint purged, not shown twice
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(r["step"], r["loss"]) for r in b], note


def test_every_random_stream_is_captured_and_restored():
    # A resumed run draws on where the checkpoint's streams stood: Python's, NumPy's (the Gaussian
    # it holds back from its last pair included) and torch's, through a weights_only file.
    import io

    import numpy as np
    import torch

    from loop import rng

    rng.seed_everything(3)
    random.random(), torch.rand(3), np.random.standard_normal()  # one Gaussian of a pair held back
    buf = io.BytesIO()
    torch.save(rng.RngStreams().state_dict(), buf)
    draw = lambda: (random.random(), np.random.standard_normal(), np.random.rand(), torch.rand(3))  # noqa: E731
    want = draw()
    rng.seed_everything(4)
    assert draw()[0] != want[0]
    rng.RngStreams().load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    got = draw()
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])


def test_validation_s_own_streams_leave_every_training_stream_as_it_was():
    # Validation runs inside own_rng: a model that draws in eval mode (torch, or its own `random`
    # or NumPy) draws the same there at every evaluation, and training draws on as if it never ran.
    import numpy as np
    import torch

    from loop import rng

    draw = lambda: (random.random(), np.random.rand(), torch.rand(2).tolist())  # noqa: E731
    rng.seed_everything(5)
    want = draw()
    rng.seed_everything(5)
    with rng.own_rng(torch.device("cpu"), 9):
        inside = draw()
    with rng.own_rng(torch.device("cpu"), 9):
        assert draw() == inside
    assert draw() == want
    rng.seed_everything(6)  # training's streams elsewhere: validation draws the same all the same
    with rng.own_rng(torch.device("cpu"), 9):
        assert draw() == inside


def test_streams_of_a_device_this_machine_lacks_are_passed_over():
    # A checkpoint written on a Mac (its MPS stream saved) resumed on a Linux box: a RuntimeError
    # traceback from torch.mps; one from a GPU node on a CPU-only machine. The CPU streams load as ever.
    import torch

    from loop import rng

    lacks = {name: torch.zeros(16, dtype=torch.uint8) for name, here in
             (("cuda", torch.cuda.is_available()), ("mps", torch.backends.mps.is_available())) if not here}
    if not lacks:
        pytest.skip("this machine has both devices whose streams the test fakes")
    state = rng.RngStreams().state_dict()
    want = torch.rand(3)
    rng.RngStreams().load_state_dict({**state, **lacks})
    assert torch.equal(torch.rand(3), want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_train(out, cache, *STEPS)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_kill_at_random_step_then_rerun(tmp_path, cache, reference, workers):
    # The reference ran with num_workers=0: the data order must not depend on the worker count.
    kill = RNG.randint(12, 38)
    out = tmp_path / "run"
    run_and_kill(out, kill, cache, *STEPS, f"data.num_workers={workers}")
    assert not (out / "summary.json").exists()
    rerun = run_train(out, cache, *STEPS, f"data.num_workers={workers}")
    assert 10 <= resumed_at(rerun.stdout) <= kill
    assert_identical(reference, out, f"num_workers={workers}, killed at step {kill}")
    assert_wall_time_sums_the_steps(summary(out), metrics(out))  # before and after the kill


@pytest.mark.slow
def test_a_dataset_that_augments_resumes_bit_for_bit_whatever_the_workers(tmp_path, cache):
    # Random augmentation in a user's Dataset (conftest.augment: torch, random and NumPy draws).
    # DataLoader workers' streams restart at every iterator start, so drawn from those, a resumed
    # run with num_workers=2 would mask other tokens than the uninterrupted one; each sample's draws
    # are seeded from its position instead (loop/data/seeded.py). The reference fetches in-process
    # (num_workers=0).
    def cmd(out, workers):
        c = train_cmd(out, cache, *STEPS, "data.name=text_augmented", f"data.num_workers={workers}")
        c[1] = str(ROOT / "tests" / "more_models.py")  # train.py with the test dataset registered
        return c

    ref, out, kill = tmp_path / "ref", tmp_path / "run", RNG.randint(12, 38)
    subprocess.run(cmd(ref, 0), cwd=ROOT, check=True, capture_output=True, timeout=300)
    code, printed = run_until(cmd(out, 2), kill, signal.SIGKILL, cwd=ROOT)
    assert code == -signal.SIGKILL, printed
    rerun = subprocess.run(cmd(out, 2), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert 10 <= resumed_at(rerun.stdout) <= kill
    assert_identical(ref, out, f"augmented, num_workers=2, killed at step {kill}")


@pytest.mark.slow
def test_async_save_kill_then_rerun(tmp_path, cache, reference):
    # Checkpoints written by a background thread: a kill lands before, during or after a write.
    kill = RNG.randint(12, 38)
    out = tmp_path / "run"
    run_and_kill(out, kill, cache, *STEPS, "train.async_save=true")
    run_train(out, cache, *STEPS, "train.async_save=true")
    assert_identical(reference, out, f"async_save, killed at step {kill}")


@pytest.mark.slow
def test_ctrl_c_exits_130_without_a_traceback_then_rerun(tmp_path, cache, reference):
    # Ctrl-C signals the whole foreground process group: DataLoader workers too. An async write in
    # flight is finished first (its thread is not a daemon), so the checkpoints stay whole.
    stop = RNG.randint(12, 38)
    out = tmp_path / "run"
    args = [cache, *STEPS, "data.num_workers=2", "train.async_save=true"]
    code, printed = run_and_signal(out, stop, *args, sig=signal.SIGINT, group=True)
    assert code == 130, printed
    assert "interrupted: " in printed and "Traceback" not in printed, printed
    assert "rerun the same command to continue from the newest" in printed, printed
    rerun = run_train(out, *args)
    assert 10 <= resumed_at(rerun.stdout) <= stop
    assert_identical(reference, out, f"Ctrl-C at step {stop}")


@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_says_a_rerun_starts_over(tmp_path, cache):
    # Not "the checkpoints are whole; rerun ... to continue from the newest": there is none.
    code, printed = run_and_signal(tmp_path / "run", 3, cache, "train.max_steps=200",
                                   "train.ckpt_every=100", sig=signal.SIGINT)
    assert code == 130 and not (tmp_path / "run" / "checkpoints").exists(), printed
    assert ("interrupted: no checkpoint was written yet, so rerunning the same command starts "
            "over") in printed, printed


def test_a_stop_before_the_config_is_read_does_not_guess_from_the_working_directory(tmp_path, monkeypatch):
    # No out_dir known: the general advice, not "starts over" because ./checkpoints is empty (the
    # run's own run.out_dir may hold checkpoints the rerun continues from).
    from loop.checkpoint.resume import after_a_stop

    monkeypatch.chdir(tmp_path)
    assert after_a_stop(None).startswith("the steps since the newest checkpoint are lost")
    assert after_a_stop(str(tmp_path)).startswith("no checkpoint was written yet")


def test_a_console_is_gone_when_its_pipe_or_socket_has_no_reader():
    # Linux reports a pipe without a reader as POLLERR and a socket whose peer closed as POLLHUP
    # (seen): a console through a socket (a process manager's) is gone too, not only a pipe.
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        assert not gone(w) and not gone(a.fileno())
        os.close(r)
        b.close()
        assert gone(w) and gone(a.fileno())
    finally:
        os.close(w)
        a.close()


def test_an_io_error_on_a_console_still_there_is_raised_not_muted():
    # Only a console that is gone (a hung-up terminal) is muted on EIO; an I/O error while it is
    # there is the caller's to see.
    from loop.guards.console import HangupProof

    class Failing:
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError) as e:
        HangupProof(Failing()).write("x")
    assert e.value.errno == errno.EIO


@pytest.mark.slow
def test_a_console_whose_reader_goes_away_ends_the_run_with_141_then_rerun(tmp_path, cache, reference):
    # `python train.py | head`: the console's reader goes away mid-run. The run stops at its next
    # console line as a shell's SIGPIPE would stop it (141), with a line on stderr, not a
    # BrokenPipeError traceback (exit 1), and the rerun continues it exactly.
    stop = RNG.randint(12, 38)
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(out, cache, *STEPS), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    timer = watchdog(proc)
    for line in proc.stdout:
        if (reported_step(line) or 0) >= stop:
            break
    proc.stdout.close()
    stderr = proc.stderr.read()
    code = proc.wait()
    timer.cancel()
    assert code == 141, stderr
    assert "stopped: the console's reader went away; the steps since" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    rerun = run_train(out, cache, *STEPS)
    assert 10 <= resumed_at(rerun.stdout) <= stop
    assert_identical(reference, out, f"console gone after step {stop}")


@pytest.mark.slow
@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_run_started_with_its_console_closed_trains(tmp_path, cache, closed):
    # Started with fd 1 or 2 closed (`>&-`, some daemons and cron setups), Python's sys.stdout or
    # sys.stderr is None and prints go nowhere: the run trains (0), and bad input is still 2.
    # Wrapping None for the hung-up terminal's sake (loop/guards/console.py) would make both exit
    # 120.
    fd = {"stdout": 1, "stderr": 2}[closed]
    out = tmp_path / "run"
    code = subprocess.run(train_cmd(out, cache, "train.max_steps=4"), cwd=ROOT,
                          preexec_fn=lambda: os.close(fd), timeout=300).returncode
    assert code == 0 and (out / "summary.json").is_file()
    bad = subprocess.run(train_cmd(tmp_path / "bad", cache, "train.nope=1"), cwd=ROOT,
                         preexec_fn=lambda: os.close(fd), timeout=300).returncode
    assert bad == 2 and not (tmp_path / "bad").exists()


# A wrapper around train.main: before step AT+1, the file descriptors FDS become a pipe without a
# reader, then THEN happens (Ctrl-C's KeyboardInterrupt, or a warning printed to stderr), in that
# order every time.
CONSOLE_GONE = """
import os, sys
import train
from loop.trainer import Trainer
step = Trainer.step
def gone(self):
    if self.progress.step == int(os.environ["AT"]):
        r, w = os.pipe()
        os.close(r)
        for fd in map(int, os.environ["FDS"].split()):
            os.dup2(w, fd)
        if os.environ["THEN"] == "ctrl-c":
            raise KeyboardInterrupt
        print("a warning", file=sys.stderr, flush=True)
    return step(self)
Trainer.step = gone
sys.exit(train.main(sys.argv[1:]))
"""


def console_gone(out, *args: str, at: int, fds: str, then: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CONSOLE_GONE, *train_cmd(out, *args)[2:]]
    env = {**os.environ, "AT": str(at), "FDS": fds, "THEN": then}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_ctrl_c_that_also_ends_a_tee_exits_130(tmp_path, cache, reference):
    # `python train.py 2>&1 | tee log`, then Ctrl-C: tee is gone first, and on the way out the run
    # prints the steps it has not logged yet (21-25: log_every is past the run's end) to a console
    # nobody reads. That BrokenPipeError must not replace the KeyboardInterrupt: that would be exit
    # 1 (after a traceback nobody can read) where a Ctrl-C is 130, and the checkpoint writer's close
    # skipped.
    out = tmp_path / "run"
    args = [cache, *STEPS, "train.log_every=1000", "train.async_save=true"]
    proc = console_gone(out, *args, at=25, fds="1 2", then="ctrl-c")
    assert proc.returncode == 130, proc.stdout + proc.stderr
    rerun = run_train(out, *args)
    assert resumed_at(rerun.stdout) == 20
    assert_identical(reference, out, "Ctrl-C with the console gone")


def test_a_stderr_whose_reader_goes_away_ends_the_run_with_141(tmp_path, cache):
    # `python train.py 2> >(tee err.log)`, the tee gone, then a warning; stdout still read: the
    # console is gone all the same (not a BrokenPipeError re-raised as a bug, its traceback
    # written to the dead stderr, exit 1), and the stdout it still has says nothing more of the run.
    out = tmp_path / "run"
    proc = console_gone(out, cache, "train.max_steps=8", at=3, fds="2", then="warn")
    assert proc.returncode == 141, proc.stdout + proc.stderr
    assert "done:" not in proc.stdout and proc.stderr == "", proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_kills_in_one_run(tmp_path, cache, reference):
    first, second = RNG.randint(11, 22), RNG.randint(25, 38)
    out = tmp_path / "run"
    run_and_kill(out, first, cache, *STEPS)
    run_and_kill(out, second, cache, *STEPS)
    run_train(out, cache, *STEPS)
    assert_identical(reference, out, f"killed at steps {first} and {second}")


@pytest.mark.slow
def test_kill_during_checkpoint_write(tmp_path, cache, reference):
    out = tmp_path / "run"
    proc = run_train(out, cache, *STEPS, "faults.kill_in_ckpt_at_step=20", check=False)
    assert proc.returncode == -9, proc.stderr
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000010"]
    assert (ckpts / "latest").read_text() == "step_00000010"
    assert list(ckpts.glob(".tmp-step_00000020*")), "the half-written temp dir is left behind"
    rerun = run_train(out, cache, *STEPS)
    assert resumed_at(rerun.stdout) == 10
    assert not list(ckpts.glob(".tmp-*")), "stale temp dirs are cleaned up"
    assert_identical(reference, out, "killed inside the step-20 checkpoint write")


@pytest.mark.slow
def test_kills_at_random_moments_with_a_checkpoint_every_step(tmp_path, cache, reference):
    # With a checkpoint after every step, a kill often lands inside a write.
    out = tmp_path / "run"
    kills = sorted(RNG.sample(range(5, 39), 3))
    for k in kills:
        run_and_kill(out, k, cache, "train.max_steps=40", "train.ckpt_every=1")
    run_train(out, cache, "train.max_steps=40", "train.ckpt_every=1")
    assert_identical(reference, out, f"ckpt_every=1, killed at steps {kills}")


@pytest.mark.slow
def test_grad_accum_4(tmp_path, cache):
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, cache, *STEPS, "train.grad_accum=4")
    kill = RNG.randint(12, 38)
    run_and_kill(out, kill, cache, *STEPS, "train.grad_accum=4")
    run_train(out, cache, *STEPS, "train.grad_accum=4")
    assert_identical(ref, out, f"grad_accum=4, killed at step {kill}")


@pytest.mark.slow
def test_resume_across_epoch_boundary(tmp_path, cache):
    # 2,600 characters -> 73 training windows of 33 tokens: an epoch is ~9 steps of 8 samples, so
    # the run crosses four epoch boundaries and checkpoints fall mid-epoch.
    rnd = random.Random(0)
    words = ["loop", "step", "grad", "seed", "epoch", "batch", "scale", "resume"]
    text = " ".join(rnd.choice(words) for _ in range(600))[:2600]
    (tmp_path / "tiny.txt").write_text(text)
    data = [cache, f"data.path={tmp_path / 'tiny.txt'}"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, *data, *STEPS)
    kill = RNG.randint(21, 38)
    run_and_kill(out, kill, *data, *STEPS)
    rerun = run_train(out, *data, *STEPS)
    assert resumed_at(rerun.stdout) in (20, 30)
    assert_identical(ref, out, f"epoch boundaries, killed at step {kill}")
    assert summary(ref)["tokens"] == 40 * 8 * 32  # 40 steps x 8 samples x 32 targets


@pytest.mark.slow
def test_finished_run_rerun_is_a_no_op(tmp_path, cache, reference):
    out = tmp_path / "run"
    run_train(out, cache, *STEPS)
    before = summary(out)
    rerun = run_train(out, cache, *STEPS)
    assert resumed_at(rerun.stdout) == 40 and "note:" not in rerun.stdout, rerun.stdout  # nothing changed
    assert summary(out)["params_sha256"] == before["params_sha256"] == summary(reference)["params_sha256"]
    assert len(metrics(out)) == 40
    fewer = run_train(out, cache, "train.max_steps=30", "train.ckpt_every=10")  # not silently 40
    assert ("note: the checkpoint is past train.max_steps=30, so nothing is trained; to stop at "
            "step 30, resume from an older checkpoint") in fewer.stdout


@pytest.mark.slow
def test_a_command_naming_run_resume_reruns_from_what_it_saved_since(tmp_path, cache, reference):
    # Branching off another directory's step 20 into a run.out_dir with newer checkpoints of its
    # own says so; and the same command rerun after a kill (or a preemption, a torchrun restart, a
    # SLURM requeue) goes on from its own newest, not back to step 20 every time.
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    start = reference / "checkpoints" / "step_00000020"
    command = [*STEPS, f"run.resume={start}"]
    killed = run_train(out, cache, *command, "faults.kill_in_ckpt_at_step=40", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpts = out / "checkpoints"
    assert f"note: step_00000030, step_00000040 in {ckpts} are from before this resume" in killed.stdout
    rerun = run_train(out, cache, *command)
    assert (f"note: run.resume={start}: continuing from {ckpts / 'step_00000030'}, which this run "
            f"saved after starting there (to start from {start} again, give a new run.out_dir)") in rerun.stdout
    assert resumed_at(rerun.stdout) == 30
    assert summary(out)["params_sha256"] == summary(reference)["params_sha256"]
    assert [r["step"] for r in metrics(out)] == list(range(1, 41))


@pytest.mark.slow
def test_a_command_naming_the_best_checkpoint_reruns_from_what_it_saved_since(tmp_path, cache):
    # run.resume=.../checkpoints/best: the pointer moves to a checkpoint this run saves (step 20
    # here), and a rerun of the same command goes on from its newest (25), not back to the best.
    first = ["train.max_steps=10", "train.ckpt_every=5", "train.eval_every=10"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    for d in (ref, out):
        run_train(d, cache, *first)
    command = ["train.max_steps=30", "train.ckpt_every=5", "train.eval_every=10"]
    run_train(ref, cache, *command, f"run.resume={ref / 'checkpoints' / 'best'}")
    best = out / "checkpoints" / "best"
    killed = run_train(out, cache, *command, f"run.resume={best}", "faults.kill_in_ckpt_at_step=30", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert best.read_text().strip() == "step_00000020"
    rerun = run_train(out, cache, *command, f"run.resume={best}")
    assert f"continuing from {out / 'checkpoints' / 'step_00000025'}" in rerun.stdout, rerun.stdout
    assert resumed_at(rerun.stdout) == 25
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]
    assert [r["step"] for r in metrics(out)] == list(range(1, 31))


def test_a_command_naming_run_resume_continues_from_the_newest_whole_checkpoint_it_saved_after_the_start(tmp_path):
    # run.resume=.../best: the run saved steps 15 and 20 after starting at 10, best moved to 20,
    # then step 30 was damaged. A rerun takes 20: never 30 (it does not verify), never 15 (older
    # than the checkpoint best names now).
    import hashlib
    import json

    from loop.checkpoint.resume import continued

    root = tmp_path / "checkpoints"
    best = root / "best"

    def checkpoint(step: int, resumed_from: str | None, whole: bool = True) -> None:
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "state.pt").write_bytes(b"state")
        digest = hashlib.sha256(b"state" if whole else b"other").hexdigest()
        (d / "manifest.json").write_text(json.dumps({"step": step, "resumed_from": resumed_from,
                                                     "files": {"state.pt": {"size": 5, "sha256": digest}}}))

    start = str(best.resolve())
    checkpoint(10, None)
    for step in (15, 20):
        checkpoint(step, start)
    checkpoint(30, start, whole=False)
    said = []
    assert continued(root, best, root / "step_00000010", said.append) == root / "step_00000020"
    assert len(said) == 1 and f"continuing from {root / 'step_00000020'}" in said[0]
    assert continued(root, best, root / "step_00000020", said.append) is None  # best names the newest


def test_a_resume_from_another_run_directory_says_where_the_best_so_far_is(tmp_path):
    # Its best checkpoint stays in the other directory: this run's checkpoints/ has no best to name
    # until it makes one, while summary.json and report.md name the best so far by its step.
    from conftest import load_config
    from loop.checkpoint.notes import after_resume
    from loop.checkpoint.resume import checkpoints_near
    from loop.config.load import DEFAULT_CONFIG
    from loop.monitor import MonitorState

    src, here = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    for step in (5, 10):
        (src / f"step_{step:08d}").mkdir(parents=True)
    (src / "best").write_text("step_00000005")
    cfg = load_config(DEFAULT_CONFIG, [f"run.out_dir={tmp_path / 'b'}", f"run.resume={src / 'step_00000010'}"])
    state = MonitorState(best=4.25, best_step=5)
    notes = after_resume(10, state, cfg, here, src / "step_00000010")
    assert notes == [f"the best so far is step 5 (4.25); its checkpoint is {src / 'step_00000005'}, not in "
                     f"{here}, whose best names this run's own once it makes a new one"]
    assert after_resume(10, state, cfg, src, src / "step_00000010") == []  # in its own directory
    # A pointer named where it is gone (run.init_from=.../checkpoints/best): the message lists the
    # checkpoints beside it.
    assert checkpoints_near(src / "gone") == f" {src} holds checkpoints: the newest is {src / 'step_00000010'}; " \
                                             f"the best: {src / 'step_00000005'}."
    # A checkpoint refused (damaged) is not named as the one to take instead, as newest or best.
    assert checkpoints_near(src / "step_00000010") == f" {src} holds checkpoints: the newest is " \
                                                      f"{src / 'step_00000005'}; the best: {src / 'step_00000005'}."
    (src / "best").write_text("step_00000010")
    assert checkpoints_near(src / "step_00000010") == f" {src} holds checkpoints: the newest is {src / 'step_00000005'}."
    # Fetched from the mirror into this run's checkpoints/ (the source is in it): its best stays in
    # the mirror, which keeps it; nothing to say. Newer checkpoints than the one resumed are said for
    # run.resume=PATH only: under auto they are ones that do not verify, and auto passed them over.
    (here / "step_00000010").mkdir(parents=True)
    assert after_resume(10, state, cfg, here, here / "step_00000010") == []
    auto = load_config(DEFAULT_CONFIG, [f"run.out_dir={tmp_path / 'a'}"])
    assert after_resume(5, MonitorState(), auto, src, src / "step_00000005") == []
    assert after_resume(5, MonitorState(), cfg, src, src / "step_00000005")[0].startswith(
        f"step_00000010 in {src} are from before this resume")


def test_what_a_resume_says_differs_names_the_keys_and_the_process_count_s_masks():
    from conftest import load_config
    from loop.checkpoint.notes import what_changed
    from loop.config.load import DEFAULT_CONFIG, to_dict

    def state(*overrides: str, world: int = 1, metadata: dict | None = None) -> dict:
        return {"config": to_dict(load_config(DEFAULT_CONFIG, list(overrides))), "metadata": metadata or {},
                "world_size": world, "progress": {"step": 10}, "scheduler": {"last_epoch": 10}}

    now = load_config(DEFAULT_CONFIG, [])
    differs = "config differs from the checkpoint's in: {}; this run's values apply from here on"
    # A warm start resumed without run.init_from: a changed key, not "run.init_from= is not used".
    assert what_changed(state("run.init_from=/x/step_00000010"), now, 1, {}) == [differs.format("run.init_from")]
    # train.grad_accum follows train.global_batch: left out of the keys only where that is unchanged.
    g16 = ["train.global_batch=16", "data.batch_size=4"]
    assert what_changed(state(*g16, "train.grad_accum=4"), load_config(DEFAULT_CONFIG, [*g16, "train.grad_accum=2"]),
                        2, {}) == []
    notes = what_changed(state(*g16, "train.grad_accum=4"),
                         load_config(DEFAULT_CONFIG, ["train.global_batch=32", "data.batch_size=4",
                                                      "train.grad_accum=8"]),
                         1, {})
    assert notes[0] == differs.format("train.global_batch, train.grad_accum"), notes
    # Another machine: rounding differs; other dropout masks only with another process count.
    here = {"versions": {"torch": "2.13.0", "numpy": "2.4.6", "cuda": None}, "hardware": {"cpu": "Xeon", "gpus": []}}
    there = {**here, "hardware": {"cpu": "EPYC", "gpus": []}}
    masks = "draws other masks from here on"
    same = what_changed(state(metadata=here), now, 1, there)
    assert len(same) == 1 and "(CPU Xeon -> EPYC)" in same[0] and masks not in same[0], same
    more = what_changed(state("data.batch_size=8", world=2, metadata=here), now, 1, here)
    assert "(processes 2 -> 1)" in more[1] and masks in more[1], more


@pytest.mark.slow
def test_a_changed_optimizer_setting_applies_from_the_resumed_step(tmp_path, cache, reference):
    # Going back to step 30 with another optim.lr or weight_decay: the config wins, as for a
    # changed schedule, and only the moments and step counts come from the checkpoint
    # (load_state_dict alone would restore each group's settings). And the step-40 checkpoint of
    # the earlier run is replaced, after a note: kept, a later run.resume=auto would continue the
    # old run.
    import shutil

    import torch

    from loop.checkpoint import store

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    start = out / "checkpoints" / "step_00000030"
    rerun = run_train(out, cache, *STEPS, f"run.resume={start}", "optim.lr=4e-3", "optim.weight_decay=0.25")
    assert "note: config differs from the checkpoint's in: optim.lr, optim.weight_decay" in rerun.stdout
    assert f"note: step_00000040 in {out / 'checkpoints'} are from before this resume" in rerun.stdout
    a, b = metrics(reference), metrics(out)
    assert [r["lr"] for r in b[:30]] == [r["lr"] for r in a[:30]]
    # 4e-3 is twice the default optim.lr: the same schedule factor times it, exactly twice the lr.
    assert [r["lr"] for r in b[30:]] == [2 * r["lr"] for r in a[30:]]
    assert b[30]["loss"] == a[30]["loss"] and b[31]["loss"] != a[31]["loss"], "step 31 is taken with it"
    saved = torch.load(out / "checkpoints" / "step_00000040" / "state.pt", weights_only=True)
    assert [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.25, 0.0]
    assert saved["scheduler"]["base_lrs"] == [4e-3, 4e-3]
    assert store.params_sha256(saved["model"]) == summary(out)["params_sha256"] != \
        summary(reference)["params_sha256"], "step 40 holds this run's weights"


@pytest.mark.slow
def test_a_resume_that_changes_the_global_batch_says_so(tmp_path, cache, reference):
    # data.batch_size is per process: with another process count (8 GPUs, then 4) or another
    # batch size the samples per step change, and the LR that suits them; the console says so at
    # the resume, not only "global batch N" at the start. The ids still continue where they stopped.
    import shutil

    from conftest import load_config
    from loop.checkpoint.notes import global_batch_change
    from loop.config.load import DEFAULT_CONFIG, to_dict

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    start = out / "checkpoints" / "step_00000030"
    rerun = run_train(out, cache, *STEPS, f"run.resume={start}", "data.batch_size=2", "data.log_ids=true")
    assert ("note: a step now takes 4 samples (1 process(es) x data.batch_size 2 x train.grad_accum "
            "2), the checkpoint's run took 8 (1 process(es) x data.batch_size 4 x train.grad_accum 2); "
            "the sample order continues where it stopped") in rerun.stdout, rerun.stdout
    assert metrics(out)[30]["samples"] == 30 * 8 + 4
    def cfg(batch, accum):
        return load_config(DEFAULT_CONFIG, [f"data.batch_size={batch}", f"train.grad_accum={accum}"])

    saved = to_dict(cfg(4, 2))
    assert global_batch_change(saved, 1, cfg(2, 4), 1) is None  # 8 either way: nothing to say
    assert global_batch_change(saved, 2, cfg(4, 2), 1).startswith(
        "a step now takes 8 samples (1 process(es) x data.batch_size 4 x train.grad_accum 2), the "
        "checkpoint's run took 16 (2 process(es) x data.batch_size 4 x train.grad_accum 2)")


def test_a_resume_on_another_machine_versions_or_process_count_says_exactness_is_off():
    # Bit for bit is promised on one machine with the same versions and process count; a job
    # requeued onto another node type, or an upgraded torch, is told so, not left to go on as if
    # nothing changed.
    from loop.checkpoint.notes import platform_change

    here = {"versions": {"torch": "2.13.0", "numpy": "2.4.6", "cuda": None},
            "hardware": {"cpu": "Xeon", "gpus": []}, "host_sha256": "a"}
    assert platform_change(here, 1, {**here, "host_sha256": "b"}, 1) == ""  # a twin machine
    there = {"versions": {"torch": "2.11.0", "numpy": "2.4.6", "cuda": "13.0"}, "device": "cuda:0",
             "hardware": {"cpu": "EPYC", "gpus": [{"name": "NVIDIA H100", "memory_gb": 85.0}]}}
    assert platform_change(here, 2, there, 1) == \
        "torch 2.13.0 -> 2.11.0; CUDA None -> 13.0; CPU Xeon -> EPYC; GPUs None -> NVIDIA H100; processes 2 -> 1"
    on_cpu = {**there, "versions": here["versions"], "hardware": {**there["hardware"], "cpu": "Xeon"},
              "device": "cpu"}
    assert platform_change(here, 1, on_cpu, 1) == ""  # GPUs beside a run on the CPU do not count
    assert platform_change({}, 1, there, 1) == ""  # a checkpoint without metadata: nothing known


def test_a_resume_that_trains_nothing_says_nothing_of_the_rate_it_would_train_at(tmp_path, cache):
    # Resumed at step 4 with train.max_steps=4 (the horizon was 12): nothing is trained, so no
    # step takes the reshaped rate a note would name.
    from conftest import train_here

    out, args = tmp_path / "run", (cache, "model.n_layer=1", "schedule.warmup_steps=2", "train.ckpt_every=4")
    train_here(out, *args, "train.max_steps=12", "train.keep_last=5")
    again = train_here(out, *args, "train.max_steps=4", f"run.resume={out / 'checkpoints' / 'step_00000004'}")
    assert "resumed from" in again.stdout and "reshapes" not in again.stdout, again.stdout


def test_a_longer_horizon_says_what_it_does_to_the_learning_rate_and_how_to_go_on_instead():
    # Raising train.max_steps on a finished run stretches the cosine: the LR jumps (from 2.44e-4 at
    # step 30 to 1.74e-3 at step 31, say). The note gives both rates and how to go on at the one
    # reached, not the key alone.
    from conftest import load_config
    from loop.checkpoint.notes import reshaped
    from loop.config.load import DEFAULT_CONFIG, to_dict
    from loop.schedule import lr_factor

    was = to_dict(load_config(DEFAULT_CONFIG, ["train.max_steps=30"]))
    state = {"config": was, "scheduler": {"last_epoch": 30}}
    cfg = load_config(DEFAULT_CONFIG, ["train.max_steps=60"])
    before = lr_factor(30, cfg.schedule, 30) * cfg.optim.lr
    after = lr_factor(30, cfg.schedule, 60) * cfg.optim.lr
    note = reshaped(state, cfg)
    assert note.startswith(f"train.max_steps 30 -> 60 reshapes schedule.name=warmup_cosine over the new "
                           f"horizon: the learning rate at this step goes from {before:.3g} to {after:.3g}")
    assert note.endswith(f"schedule.name=constant schedule.warmup_steps=0 optim.lr={before:.3g}")
    # With optim.lr and the schedule changed too, the rate reached is still the checkpoint's run's.
    cfg = load_config(DEFAULT_CONFIG, ["train.max_steps=60", "optim.lr=0.02", "schedule.min_lr_ratio=0.5"])
    other = reshaped(state, cfg)
    assert f"goes from {before:.3g} to {lr_factor(30, cfg.schedule, 60) * 0.02:.3g}" in other, other
    assert other.endswith(f"optim.lr={before:.3g}") and before != lr_factor(30, cfg.schedule, 30) * 0.02
    # A checkpoint whose config lacks a schedule key (another copy of the loop wrote it) takes this
    # run's for it.
    del was["schedule"]["min_lr_ratio"]
    assert f"goes from {before:.3g} to" in reshaped(state, load_config(DEFAULT_CONFIG, ["train.max_steps=60"]))
    cfg = load_config(DEFAULT_CONFIG, ["train.max_steps=60", "schedule.name=constant"])
    assert reshaped({"config": to_dict(cfg), "scheduler": {"last_epoch": 30}}, cfg) is None
    # A schedule without a horizon, resumed past its warmup with another optim.lr: the jump is not
    # the horizon's; warmup_cosine's, the same way, is.
    for name, says in (("step", False), ("warmup_cosine", True)):
        keys = [f"schedule.name={name}", "schedule.warmup_steps=2"]
        saved = to_dict(load_config(DEFAULT_CONFIG, ["train.max_steps=12", *keys]))
        cfg = load_config(DEFAULT_CONFIG, ["train.max_steps=24", *keys, "optim.lr=0.01"])
        note = reshaped({"config": saved, "scheduler": {"last_epoch": 10}}, cfg)
        assert (note is not None) == says, (name, note)
    # The jump of another schedule.name, or of a warmup that now covers the step, is not the horizon's.
    saved = to_dict(load_config(DEFAULT_CONFIG, ["train.max_steps=12", "schedule.warmup_steps=2"]))
    for keys in (["schedule.name=cosine_restarts", "schedule.restart_period=3"], ["schedule.warmup_steps=8"]):
        cfg = load_config(DEFAULT_CONFIG, ["train.max_steps=20", *keys])
        assert reshaped({"config": saved, "scheduler": {"last_epoch": 4}}, cfg) is None, keys
    # Going on as the note says: the constant rate is the rate the schedule reached.
    on = load_config(DEFAULT_CONFIG, ["train.max_steps=60", "schedule.name=constant", "schedule.warmup_steps=0",
                                      f"optim.lr={before:.3g}"])
    assert f"{on.optim.lr:.3g}" == f"{before:.3g}"


def test_an_fp16_run_resumes_with_the_loss_scale_it_saved(tmp_path, cache):
    # The GradScaler's scale is part of the state: a resume that started it over (2**16) would
    # scale the next steps' losses otherwise than the run that never stopped. Started at 2**20,
    # this model overflows at step 1 on the CPU and the scale halves.
    import torch

    from conftest import TINY, build_trainer, load_config
    from loop.checkpoint import store
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    out = tmp_path / "run"
    args = [*TINY, cache, f"run.out_dir={out}", "train.precision=fp16", "train.max_steps=2", "train.eval_every=0"]
    t = build_trainer(load_config(DEFAULT_CONFIG, args), Dist(), torch.device("cpu"))
    t.scaler = t.precision.scaler = t.parts["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    t.run()
    saved = store.load(out / "checkpoints" / "step_00000002", "state.pt")["scaler"]
    assert saved["scale"] == 2.0 ** 19

    again = build_trainer(load_config(DEFAULT_CONFIG, args), Dist(), torch.device("cpu"))
    again.run()  # resumed at its last step: nothing more to train
    assert again.parts["scaler"].state_dict() == saved
