"""Checkpoint features end to end: preemption by SIGTERM/SIGUSR1, EMA restored exactly, early
stopping at the right evaluation, best-checkpoint retention, resume from a mirror, warm start,
and no checkpoint of non-finite weights."""
from __future__ import annotations

import json
import re
import shutil
import signal

import pytest
import torch

from conftest import ROOT, TINY, metrics, run_and_kill, run_and_signal, run_train, summary, train_here
from data.text import TextOptions, build_text
from loop.checkpoint import store
from loop.errors import GaveUp
from loop.guards.preemption import EXIT_PREEMPTED

STEPS = ["train.max_steps=40", "train.ckpt_every=10"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_train(out, cache, *STEPS)
    return out


def same_run(ref, out) -> None:
    assert [r["step"] for r in metrics(out)] == list(range(1, 41))
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("sig, repeat", [(signal.SIGTERM, 1), (signal.SIGUSR1, 1), (signal.SIGTERM, 3)])
def test_preemption_saves_exits_143_and_resumes_exactly(tmp_path, cache, reference, sig, repeat):
    # Signalled like SLURM does it: the whole process group, DataLoader workers included.
    # repeat=3: more signals arrive while the checkpoint is being written; nothing breaks.
    out = tmp_path / "run"
    code, printed = run_and_signal(out, 17, cache, *STEPS, "data.num_workers=2", sig=sig,
                                   group=True, repeat=repeat)
    assert code == EXIT_PREEMPTED, printed
    step = int(re.search(r"preempted at step (\d+)", printed).group(1))
    assert 17 <= step < 40, printed
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    assert store.verify(ckpt) is None  # a checkpoint at the step it stopped on
    assert not (out / "summary.json").exists()
    rerun = run_train(out, cache, *STEPS, "data.num_workers=2")
    assert f"resumed from {ckpt} at step {step}" in rerun.stdout
    same_run(reference, out)


def test_a_signal_during_evaluation_stops_the_run_at_that_step(tmp_path, cache, monkeypatch):
    # The run finishes the current optimizer step: a stop signal that comes while the step's
    # evaluation runs stops it there, not after one more step of the scheduler's grace period.
    import os

    from loop.evaluate import Evaluator

    evaluate = Evaluator.evaluate

    def signalled(self, *args):
        if self.progress.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's own handler takes it (train.main here)
        return evaluate(self, *args)

    monkeypatch.setattr(Evaluator, "evaluate", signalled)
    r = train_here(tmp_path / "run", cache, "train.max_steps=12", "train.eval_every=4", check=False)
    assert r.returncode == EXIT_PREEMPTED and "preempted at step 4" in r.stdout, r.stdout + r.stderr
    assert [m["step"] for m in metrics(tmp_path / "run")][-1] == 4


def test_a_signal_during_the_last_checkpoint_ends_the_run_with_143(tmp_path, cache, monkeypatch):
    # The run says "saving a checkpoint and exiting with 143": going on to write its end (sample,
    # model.pt, report) and exit 0, a job its scheduler is stopping would use its grace period and
    # report success. The checkpoint is on disk; the rerun writes the end.
    import os

    from loop.checkpoint.saver import Saver

    save = Saver.save

    def signalled(self, step, *args):
        save(self, step, *args)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # as the write ends: the loop has no step left to check

    monkeypatch.setattr(Saver, "save", signalled)
    out = tmp_path / "run"
    r = train_here(out, cache, "train.max_steps=4", check=False)
    assert r.returncode == EXIT_PREEMPTED and "preempted at step 4" in r.stdout, r.stdout + r.stderr
    assert not (out / "summary.json").exists() and store.verify(out / "checkpoints" / "step_00000004") is None
    monkeypatch.setattr(Saver, "save", save)
    assert train_here(out, cache, "train.max_steps=4").returncode == 0 and summary(out)["steps"] == 4


@pytest.mark.slow
def test_a_second_signal_during_the_last_async_write_changes_nothing(tmp_path, cache):
    # The stop handlers stay until the last checkpoint is on disk: with train.async_save its write
    # is still going when the loop ends (Saver.close waits for it), and a second SIGTERM there (a
    # container runtime's, a user's repeated kill) would end the run with no checkpoint at all.
    import subprocess
    import sys
    import time

    from conftest import train_cmd, watchdog

    out = tmp_path / "run"
    # tests/slow_save.py: train.py whose every checkpoint write takes a second longer
    cmd = [sys.executable, str(ROOT / "tests" / "slow_save.py"),
           *train_cmd(out, cache, "train.max_steps=200", "train.ckpt_every=1000", "train.async_save=true")[2:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer, seen = watchdog(proc), []
    for line in proc.stdout:
        seen.append(line)
        if re.match(r"step +3/", line):
            proc.send_signal(signal.SIGTERM)
            break
    time.sleep(0.5)  # the step finished, its checkpoint's one-second write under way
    proc.send_signal(signal.SIGTERM)
    seen.append(proc.stdout.read())
    proc.wait(timeout=60)
    timer.cancel()
    printed = "".join(seen)
    assert proc.returncode == EXIT_PREEMPTED, printed
    step = int(re.search(r"preempted at step (\d+)", printed).group(1))
    assert store.verify(out / "checkpoints" / f"step_{step:08d}") is None


@pytest.mark.slow
def test_a_closed_terminal_saves_and_exits_143(tmp_path, cache):
    # An ssh connection that drops closes the run's terminal and sends SIGHUP. Ending the run at
    # once on it would lose every step since the newest checkpoint: the run saves and exits 143
    # instead. From then on each write to the console fails (EIO), so the run also stops writing
    # there. Under nohup SIGHUP stays ignored. The stop itself is SIGTERM's, whose resume is exact
    # (above). 1000 steps: the run must still be training when the SIGHUP comes (40 can end first
    # under make test's load).
    import os
    import pty
    import subprocess
    import time

    from conftest import train_cmd, watchdog

    out = tmp_path / "run"
    master, slave = pty.openpty()
    # SIGHUP's default action for the run even where the tests were started under nohup, whose
    # SIG_IGN the run inherits and keeps (the next test): there it would train on to its end,
    # exit 0.
    proc = subprocess.Popen(train_cmd(out, cache, *STEPS, "train.max_steps=1000"), cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    os.close(slave)
    timer, seen = watchdog(proc), b""
    while not re.search(rb"step +17/", seen):
        seen += os.read(master, 4096)
    os.close(master)  # the terminal is gone: from now on each write to it fails (EIO)
    # As after a real hangup, the run writes to the dead terminal before SIGHUP is handled: wait for
    # two more steps' records (and console lines), which must not end the run with exit 1.
    while proc.poll() is None and b'"step": 19,' not in (out / "metrics.jsonl").read_bytes():
        time.sleep(0.001)
    proc.send_signal(signal.SIGHUP)
    code = proc.wait()
    timer.cancel()
    assert code == EXIT_PREEMPTED, seen.decode(errors="replace")
    step = store.step_dirs(out / "checkpoints")[-1]
    assert 19 <= int(step.name[5:]) < 1000 and store.verify(step) is None


def test_a_stop_signal_the_launcher_ignores_stays_ignored():
    from loop.guards.preemption import Preemption

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a process
    try:
        preemption = Preemption()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == preemption._handle
        preemption.close()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.slow
def test_ema_differs_from_raw_and_is_restored_exactly(tmp_path, cache):
    args = [cache, *STEPS, "ema.enabled=true", "ema.decay=0.9"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, *args)
    run_and_kill(out, 23, *args)
    run_train(out, *args)
    a, b = summary(ref), summary(out)
    assert a["ema_params_sha256"] != a["params_sha256"]
    assert b["ema_params_sha256"] == a["ema_params_sha256"]
    assert b["val_loss"] == a["val_loss"]  # validation uses the EMA weights
    exported = torch.load(out / "model.pt", weights_only=True)
    assert set(exported) == {"model", "ema", "config", "data"}
    assert not all(torch.equal(exported["ema"][k], exported["model"][k]) for k in exported["model"])


@pytest.mark.slow
def test_an_ema_turned_on_at_a_resume_starts_from_the_resumed_weights(tmp_path, cache, reference):
    # Not from the fresh model's random weights, which until its first update (or at once, in a
    # run resumed at its last step) validation and the export would read.
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    run_train(out, cache, *STEPS, "ema.enabled=true")  # at its last step already: nothing to train
    s, ref = summary(out), summary(reference)
    assert s["ema_params_sha256"] == s["params_sha256"] == ref["params_sha256"]
    assert s["val_loss"] == ref["val_loss"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_average_of_16_bit_weights_is_kept_in_float32_and_moves(dtype):
    # Kept in bf16, the default decay 0.999 rounds to 1.0: the average would stay the first weights,
    # validation through it would never improve, and early stopping would stop a run that learns.
    from loop.ema import EMA

    m = torch.nn.Linear(8, 8).to(dtype)
    ema = EMA(m, decay=0.999, warmup=1)  # warmup 1: d = 0.999 from the first average on
    assert ema.module.weight.dtype == torch.float32 and m.weight.dtype == dtype
    w0 = m.weight.float()
    ema.update(m)  # the first update copies the weights
    with torch.no_grad():
        m.weight.add_(1)
    w1 = m.weight.float()
    for _ in range(100):
        ema.update(m)
    # 100 updates from w0 towards w1: w1 + (w0 - w1) * 0.999**100, up to float32 sums and each
    # (1 - d) * w1 term rounded to 16 bits (an error under 1e-5 here); the bf16 average moved 0.
    torch.testing.assert_close(ema.module.weight, w1 + (w0 - w1) * 0.999 ** 100, rtol=0, atol=1e-4)


def test_the_ema_of_a_model_whose_forward_casts_to_its_16_bit_weights_validates(tmp_path, cache, monkeypatch):
    # A model fine-tuned in bf16 whose forward casts to it (`x.to(torch.bfloat16)` before a bf16
    # layer): the float32 average would meet a bf16 input, a dtype mismatch at the first evaluation
    # with ema.enabled. Validation rounds the average to the model's dtypes; it stays float32.
    from conftest import gpt_then
    from model import MODELS

    class ToBf16(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.bfloat16)

    def in_bf16(m):
        m.drop = torch.nn.Sequential(ToBf16(), m.drop)
        return m.to(torch.bfloat16)

    monkeypatch.setitem(MODELS, "gpt_cast_bf16", gpt_then(in_bf16))
    out = tmp_path / "run"
    train_here(out, cache, "model.name=gpt_cast_bf16", "train.max_steps=4", "train.eval_every=2",
               "ema.enabled=true", "ema.decay=0.9")
    assert [r["step"] for r in metrics(out) if "val_loss" in r] == [2, 4]
    exported = torch.load(out / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in exported["ema"].values() if v.is_floating_point())
    assert exported["model"]["wte.weight"].dtype == torch.bfloat16


def test_the_ema_rounds_to_each_weight_s_own_dtype_inside_and_is_float32_after_even_an_error(monkeypatch):
    # Each weight in the dtype the model built it in (fp16 as fp16, not as bf16: a forward's
    # x.half() would meet bf16), the float32 average back after, also when the forward raised (an
    # average left in 16 bits would then round every later update away). Under FSDP the shards stay.
    from loop import ema as ema_module
    from loop.ema import EMA

    m = torch.nn.Sequential(torch.nn.Linear(4, 4).half(), torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(4, 4))
    ema = EMA(m, decay=0.9, warmup=1)
    average = [w.clone() for w in ema.module.parameters()]
    assert {w.dtype for w in average} == {torch.float32}
    with ema.in_model_dtypes():
        assert [w.dtype for w in ema.module.parameters()] == [w.dtype for w in m.parameters()]
    with pytest.raises(RuntimeError, match="in the forward"), ema.in_model_dtypes():
        raise RuntimeError("in the forward")
    assert all(torch.equal(w, a) and w.dtype == torch.float32 for w, a in zip(ema.module.parameters(), average))
    monkeypatch.setattr(ema_module.fsdp, "is_sharded", lambda module: True)
    with ema.in_model_dtypes():
        assert {w.dtype for w in ema.module.parameters()} == {torch.float32}


def test_an_ema_of_a_model_with_a_buffer_in_no_state_dict_resumes_bit_for_bit(tmp_path, cache, monkeypatch):
    # A buffer registered with persistent=False (a cache, RoPE's frequencies) is in no checkpoint:
    # a resumed run's EMA copy holds the model's. An average of it drifts from that by rounding,
    # and an uninterrupted run's validation losses would part from a resumed one's.
    from conftest import gpt_then
    from loop.ema import EMA
    from model import MODELS

    class Scale(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.register_buffer("s", 1 + 0.5 * torch.randn(n), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.s

    def scaled(m):
        m.drop = torch.nn.Sequential(Scale(m.wte.weight.shape[1]), m.drop)
        return m

    net = torch.nn.Linear(4, 4)
    net.register_buffer("s", torch.randn(1000), persistent=False)
    ema = EMA(net, decay=0.999, warmup=10)
    for _ in range(50):
        ema.update(net)
    assert torch.equal(ema.module.s, net.s)  # what a resume's copy holds
    monkeypatch.setitem(MODELS, "gpt_scaled", gpt_then(scaled))
    args = [cache, "model.name=gpt_scaled", "train.max_steps=40", "train.eval_every=5", "train.ckpt_every=20",
            "train.keep_last=9", "ema.enabled=true", "ema.decay=0.9"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    train_here(ref, *args)
    shutil.copytree(ref, out)
    train_here(out, *args, f"run.resume={out / 'checkpoints' / 'step_00000020'}")  # steps 21-40 again
    vals = [[(r["step"], r["val_loss"]) for r in metrics(run) if "val_loss" in r] for run in (ref, out)]
    assert len(vals[0]) == 8 and vals[1] == vals[0]


def test_the_ema_averages_the_weights_each_step_ends_with_and_is_what_validates(tmp_path, cache):
    # The trainer's average against the formula applied to the weights recorded after every step
    # (float64 here, float32 there: 1e-6). Only this test catches an average updated before the
    # optimizer step, a step behind; or one of the wrong weights, or with a wrong warmup.
    from conftest import build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist
    from loop.evaluate import val_metrics

    cfg = load_config(DEFAULT_CONFIG, [*TINY, f"run.out_dir={tmp_path / 'run'}", cache, "train.max_steps=12",
                                       "train.eval_every=0", "train.ckpt_every=0", "ema.enabled=true",
                                       "ema.decay=0.9", "ema.warmup=3"])
    trainer = build_trainer(cfg, Dist(), torch.device("cpu"))
    step, seen = trainer.step, []

    def recorded() -> bool:
        taken = step()
        seen.append({k: v.detach().double().clone() for k, v in trainer.raw.state_dict().items()})
        return taken
    trainer.step = recorded
    trainer.run()
    expected = seen[0]  # the first update copies the weights
    for n, weights in enumerate(seen[1:], 1):  # n updates before this one
        d = min(0.9, (1 + n) / (3 + n))
        expected = {k: d * expected[k] + (1 - d) * w for k, w in weights.items()}
    assert len(seen) == 12 and trainer.ema.n_averaged == 12
    for k, v in trainer.ema.module.state_dict().items():
        torch.testing.assert_close(v.double(), expected[k], rtol=0, atol=1e-6, msg=k)
    # And validation is the average's (the same batches again: the same float sums), not the raw
    # weights', which nothing else checks.
    val = {m: val_metrics(m, trainer.evaluator.batches, trainer.precision, trainer.device, trainer.dist)["val_loss"]
           for m in (trainer.ema.module, trainer.raw)}
    assert summary(tmp_path / "run")["val_loss"] == val[trainer.ema.module] != val[trainer.raw]


def expected_stop(vals: list[tuple[int, float]], patience: int, delta: float) -> int:
    best, bad = None, 0
    for step, v in vals:
        if best is None or v < best - delta:
            best, bad = v, 0
        else:
            bad += 1
            if bad >= patience:
                return step
    raise AssertionError("the rule never stops on these values")


def test_early_stopping_stops_at_the_right_evaluation(tmp_path, cache):
    # A min_delta this large makes improvements rare, so the rule fires well before max_steps.
    args = [cache, "train.max_steps=200", "train.eval_every=4", "train.early_stop_patience=2",
            "train.early_stop_min_delta=0.2"]
    out = tmp_path / "run"
    first = train_here(out, *args)
    vals = [(r["step"], r["val_loss"]) for r in metrics(out) if "val_loss" in r]
    s = summary(out)
    assert s["stopped_early"] and s["steps"] == expected_stop(vals, 2, 0.2) < 200, (vals, s)
    assert "did not improve by 0.2 for 2 evaluations" in s["stop_reason"]
    # The console says why the run ended before train.max_steps, not only "done: N steps".
    assert f"stopped early at step {s['steps']}: {s['stop_reason']}" in first.stdout, first.stdout
    rerun = train_here(out, *args)  # the stop is part of the state: running again trains nothing
    assert summary(out)["steps"] == s["steps"] and len(metrics(out)) == s["steps"], rerun.stdout
    assert (f"note: this run stopped early ({s['stop_reason']}), so nothing more is trained; to "
            f"train on, rerun with a larger train.early_stop_patience, or 0") in rerun.stdout
    # Resumed without early stopping (or with more patience), it trains on: the new value applies,
    # as the note says, and the run does not stay stopped.
    more = f"train.max_steps={s['steps'] + 4}"
    train_here(out, *args, more, "train.early_stop_patience=0")
    assert summary(out)["steps"] == s["steps"] + 4 and not summary(out)["stopped_early"]


# A min_delta no loss change reaches: the first evaluation (step 4) sets the reference, each after
# it counts, and a patience of 2 runs out at the third (step 12), whatever the losses.
NEVER_IMPROVES = ["train.eval_every=4", "train.early_stop_patience=2", "train.early_stop_min_delta=100"]


def test_the_stop_line_follows_the_lines_of_the_step_that_stops(tmp_path, cache):
    # The console reads in order: the stopping step's own step and eval lines, then why the run ends there.
    proc = train_here(tmp_path / "run", cache, "train.max_steps=20", *NEVER_IMPROVES)
    s, lines = summary(tmp_path / "run"), proc.stdout.splitlines()
    assert s["stopped_early"] and s["steps"] == 12, s
    step, evaluation, stop = (next(i for i, line in enumerate(lines) if line.startswith(start))
                              for start in ("step     12/20", "eval     12/20", "stopped early at step 12"))
    assert step < evaluation < stop, proc.stdout


def test_a_patience_that_runs_out_at_the_last_step_reads_as_a_finished_run(tmp_path, cache):
    # Step 12 is train.max_steps: the stop ends nothing early, so summary.json, the report and the
    # console read as for any run that trained every step asked of it.
    from loop.observe.report import load_run

    out = tmp_path / "run"
    proc = train_here(out, cache, "train.max_steps=12", *NEVER_IMPROVES)
    s = summary(out)
    assert s["steps"] == 12 and s["stopped_early"] is False and s["stop_reason"] is None, s
    assert load_run(out)["status"] == "finished"
    assert "stopped early" not in proc.stdout, proc.stdout
    rerun = train_here(out, cache, "train.max_steps=12", *NEVER_IMPROVES)  # nothing to train, as for any finished run
    assert "stopped early" not in rerun.stdout and summary(out)["stopped_early"] is False, rerun.stdout


def test_a_non_finite_evaluation_is_never_the_best():
    # A NaN first evaluation must not become the best: no later value would compare below it, the
    # best checkpoint would stay that step and early stopping would count every later improvement
    # as none.
    from loop.monitor import Monitor

    m = Monitor("val_loss", "min", patience=2, min_delta=0.0)
    assert m.update(10, float("nan")) is False
    assert m.update(20, 3.0) is True and (m.state.best, m.state.best_step) == (3.0, 20)
    assert m.update(30, float("-inf")) is False and m.state.best_step == 20
    m = Monitor("val_accuracy", "max", patience=2, min_delta=0.0)
    assert not m.update(10, float("nan")) and not m.update(20, float("nan"))
    assert m.state.stop_reason == "val_accuracy did not improve by 0.0 for 2 evaluations (none finite)"


def test_an_improvement_must_beat_the_best_by_more_than_min_delta_in_either_mode():
    # "Did not improve by min_delta": an equal value, or one better by min_delta or less, is no
    # improvement and counts towards patience, in max mode as in min mode. The best checkpoint
    # takes any improvement: min_delta must not make it skip better evaluations, even with
    # patience 0.
    from loop.monitor import Monitor

    m = Monitor("val_accuracy", "max", patience=3, min_delta=0.125)
    assert m.update(10, 0.5) is True
    assert [m.update(20, 0.625), m.update(30, 0.5)] == [True, False] and m.state.bad_evals == 2
    assert m.update(40, 0.75) is True
    assert (m.state.best, m.state.best_step, m.state.bad_evals) == (0.75, 40, 0)
    m = Monitor("val_loss", "min", patience=2, min_delta=0.1)
    assert [m.update(10, 1.0), m.update(20, 0.95), m.update(30, 0.92)] == [True, True, True]
    assert m.state.stop_reason == "val_loss did not improve by 0.1 for 2 evaluations (best 0.92 at step 30)"
    m = Monitor("val_loss", "min", patience=0, min_delta=0.5)
    assert [m.update(10, 1.0), m.update(20, 0.9)] == [True, True] and not m.state.stop_reason
    # Its state goes through a checkpoint whole, and only into a monitor watching the same way.
    m = Monitor("val_loss", "min", patience=3, min_delta=0.1)
    assert m.update(10, 1.0) and m.update(20, 0.95) and m.state.bad_evals == 1
    again = Monitor("val_loss", "min", patience=3, min_delta=0.1)
    again.load_state_dict(m.state_dict())
    assert again.state == m.state
    for other in (Monitor("val_loss", "max", 3, 0.1), Monitor("val_accuracy", "min", 3, 0.1)):
        other.load_state_dict(m.state_dict())
        assert other.state.best is None and other.state.bad_evals == 0
    m = Monitor("val_loss", "min", patience=2, min_delta=0.0)
    assert m.update(10, 2.0) is True and m.update(20, 2.0) is False and m.update(30, 2.0) is False
    assert m.state.stop_reason == "val_loss did not improve by 0.0 for 2 evaluations (best 2 at step 10)"
    # Resumed under a smaller patience its count has reached: it stops there (it trained on, and
    # stopped one evaluation later, saying "for 2" where 4 had passed); under a larger one it goes on.
    m = Monitor("val_loss", "min", patience=5, min_delta=0.0)
    assert [m.update(s, 2.0) for s in (10, 20, 30, 40)] == [True, False, False, False] and not m.state.stop_reason
    for patience, stops in ((2, "for 3 evaluations (best 2 at step 10)"), (3, "for 3 evaluations"), (4, ""), (0, "")):
        again = Monitor("val_loss", "min", patience=patience, min_delta=0.0)
        again.load_state_dict(m.state_dict())
        assert (stops in again.state.stop_reason) if stops else not again.state.stop_reason, (patience, again.state)


def test_a_resume_that_tracks_another_metric_or_direction_starts_the_best_over(tmp_path, cache):
    # The best so far is not compared with the new direction (or metric): in max mode a loss the
    # earlier run minimised would never be beaten, no later evaluation would be a best, and `best`
    # would stay where it was.
    out, args = tmp_path / "run", [cache, "train.eval_every=4", "train.max_steps=8"]
    train_here(out, *args)
    rerun = train_here(out, *args, "train.max_steps=12", "train.best_mode=max")
    assert ("note: train.best_metric/best_mode val_loss/min -> val_loss/max: the best checkpoint and "
            "early stopping start over from this step") in rerun.stdout, rerun.stdout
    val12 = next(r["val_loss"] for r in metrics(out) if r["step"] == 12)
    assert summary(out)["best"] == {"metric": "val_loss", "value": val12, "step": 12}
    assert (out / "checkpoints" / "best").read_text() == "step_00000012"


def test_early_stopping_without_evaluations_says_it_has_no_effect(tmp_path, cache):
    # train.eval_every=0 evaluates once, at the end: a patience counting evaluations never fires.
    proc = train_here(tmp_path / "run", cache, "train.max_steps=2", "train.eval_every=0",
                     "train.early_stop_patience=2")
    assert ("note: train.early_stop_patience has no effect with train.eval_every=0: it counts "
            "evaluations, and this run evaluates once, at its end") in proc.stdout, proc.stdout


def test_evaluating_a_validation_set_that_augments_leaves_training_as_it_was(tmp_path, cache, monkeypatch):
    # The text sample's prompt is fetched from the validation set at each evaluation; when that set
    # augments (as the README says a Dataset may), the fetch must not draw from the global streams,
    # or the steps after an evaluation train with other dropout masks than a run that did not
    # evaluate there.
    from conftest import Mapped, augment
    from data import DATASETS

    def text_val_augmented(cfg: TextOptions):
        d = build_text(cfg)
        d.val = Mapped(d.val, augment)
        return d

    monkeypatch.setitem(DATASETS, "text_val_augmented", text_val_augmented)
    losses = {}
    for every in (2, 0):
        out = tmp_path / f"every{every}"
        train_here(out, cache, "data.name=text_val_augmented", "model.dropout=0.2", "train.max_steps=5",
                   f"train.eval_every={every}", "train.sample_tokens=4")
        losses[every] = [r["loss"] for r in metrics(out)]
    assert len(losses[2]) == 5 and losses[2] == losses[0]


def test_the_last_step_is_evaluated_like_any_other(tmp_path, cache):
    # 10 steps, evaluating every 4: the end's evaluation gives summary.json its val_loss, and it is
    # logged (metrics.jsonl, TensorBoard) and a candidate for the best checkpoint like any other;
    # otherwise the report gives a best val loss below the best checkpoint's (4.3214 at 10, best
    # 4.3623 at 8, say).
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=10", "train.eval_every=4", "train.ckpt_every=0")
    vals = {r["step"]: r["val_loss"] for r in metrics(out) if "val_loss" in r}
    s = summary(out)
    assert list(vals) == [4, 8, 10] and s["val_loss"] == vals[10]
    best = min(vals, key=vals.get)
    assert s["best"] == {"metric": "val_loss", "value": vals[best], "step": best}
    assert (out / "checkpoints" / "best").read_text() == f"step_{best:08d}"


@pytest.mark.parametrize("mode", ["min", "max"])
def test_best_checkpoint_is_tracked_and_kept(tmp_path, cache, mode):
    # keep_last=1: only the newest survives retention, plus the best one.
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=30", "train.eval_every=5", "train.ckpt_every=10",
              "train.keep_last=1", f"train.best_mode={mode}")
    vals = {r["step"]: r["val_loss"] for r in metrics(out) if "val_loss" in r}
    pick = min if mode == "min" else max
    best_step = pick(vals, key=vals.get)
    s = summary(out)
    assert s["best"] == {"metric": "val_loss", "value": vals[best_step], "step": best_step}
    root = out / "checkpoints"
    assert (root / "best").read_text() == f"step_{best_step:08d}"
    assert {p.name for p in store.step_dirs(root)} == {f"step_{best_step:08d}", "step_00000030"}
    if mode == "max":
        assert best_step < 30  # the highest val loss is early: kept although it is old


def test_the_last_step_is_checkpointed_when_its_evaluation_is_no_best(tmp_path, cache):
    # best_mode=max on a falling loss: the end's evaluation is no new best, and step 15 is no
    # periodic checkpoint. Saved all the same, a rerun of the finished run trains nothing again.
    out = tmp_path / "run"
    args = ("train.max_steps=15", "train.ckpt_every=10", "train.eval_every=10", "train.best_mode=max")
    train_here(out, cache, *args)
    root = out / "checkpoints"
    assert [d.name for d in store.step_dirs(root)] == ["step_00000010", "step_00000015"]
    assert (root / "latest").read_text() == "step_00000015" and (root / "best").read_text() == "step_00000010"
    rerun = train_here(out, cache, *args)
    assert "at step 15" in rerun.stdout and [r["step"] for r in metrics(out)] == list(range(1, 16))


def test_a_resume_back_in_time_leaves_the_newer_checkpoints_and_their_pointers_alone():
    # The repair of what a kill in the last save left undone is for a resume from the newest
    # checkpoint: resumed from an older one (run.resume=PATH), `latest` still names the newest and
    # `best` the run's best until this run saves, and retention deletes nothing.
    import tempfile
    from pathlib import Path

    from loop.checkpoint.saver import Saver
    from loop.distributed.group import Dist

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        for step in (5, 10, 15, 20):
            (root / f"step_{step:08d}").mkdir(parents=True)
        for pointer in ("latest", "best"):
            (root / pointer).write_text("step_00000020")
        Saver(root, 3, Dist(), False).repair(root / "step_00000010", 5)
        assert [d.name for d in store.step_dirs(root)] == [f"step_{s:08d}" for s in (5, 10, 15, 20)]
        assert (root / "latest").read_text() == (root / "best").read_text() == "step_00000020"


@pytest.mark.parametrize("keep_last", [1, 3])
def test_pointers_a_kill_in_the_last_save_left_behind_are_repaired_by_the_rerun(tmp_path, cache, keep_last):
    # A kill after the last checkpoint's rename but before `latest` and `best` were written: the
    # rerun resumes from that checkpoint and, the run being done, saves nothing; the pointers named
    # the checkpoint before (or, with keep_last=1, one retention had deleted) for good.
    out = tmp_path / "run"
    args = ("train.max_steps=4", "train.eval_every=2", "train.ckpt_every=2", f"train.keep_last={keep_last}")
    train_here(out, cache, *args)
    root = out / "checkpoints"
    best = summary(out)["best"]["step"]
    assert (root / "best").read_text() == f"step_{best:08d}" and best == 4  # the loss falls
    for pointer in ("latest", "best"):
        (root / pointer).write_text("step_00000002")
    if keep_last == 1:  # killed in retention too: step 2 half deleted
        (root / "step_00000002").mkdir()
        (root / "step_00000002" / "state.pt").write_bytes(b"what was left")
    # Temp copies a kill mid-write left (of the run's files), beside one of tools.report's.
    leftovers = [out / ".config.yaml.tmp-99999", out / ".model.pt.tmp-7", root / ".best.tmp-12"]
    for tmp in [*leftovers, out / ".report.md.tmp-5"]:
        tmp.write_bytes(b"half")
    (root / ".tmp-step_00000004-321").mkdir()  # a fetch from the mirror cut short
    (root / ".tmp-step_00000004-321" / "state.pt").write_bytes(b"half")
    leftovers.append(root / ".tmp-step_00000004-321")
    train_here(out, cache, *args)
    assert (root / "latest").read_text() == (root / "best").read_text() == "step_00000004"
    assert [d.name for d in store.step_dirs(root)] == (["step_00000004"] if keep_last == 1 else
                                                       ["step_00000002", "step_00000004"])
    assert not any(tmp.exists() for tmp in leftovers) and (out / ".report.md.tmp-5").exists()


def test_the_best_pointer_never_names_a_missing_checkpoint(tmp_path):
    # Resumed back in time (run.resume=PATH in the same run.out_dir), a run's best can be a step the
    # earlier run deleted once its own best moved on, or there is none yet: then `best` must name
    # nothing, not that missing directory or the earlier run's best, or
    # run.init_from=checkpoints/best fails or takes the wrong weights.
    from loop.checkpoint.saver import Saver
    from loop.distributed.group import Dist

    saver = Saver(tmp_path, keep_last=3, dist=Dist(), async_save=False)
    for name in ("step_00000020", "step_00000040"):
        (tmp_path / name).mkdir()
    (tmp_path / "best").write_text("step_00000040")  # the earlier run's
    saver.saved(tmp_path / "step_00000020", best="step_00000015")
    assert not (tmp_path / "best").exists()
    saver.saved(tmp_path / "step_00000020", best="step_00000020")
    assert (tmp_path / "best").read_text() == "step_00000020"
    saver.saved(tmp_path / "step_00000020", best=None)
    assert not (tmp_path / "best").exists()


@pytest.mark.slow
@pytest.mark.parametrize("gone", ["checkpoints", "run.out_dir"])
def test_resume_from_mirror_when_local_checkpoints_are_gone(tmp_path, cache, reference, gone):
    # run.out_dir gone too (a new machine): the fetch must not leave a directory holding
    # checkpoints that "no run made", which the run would refuse (exit 2), then and at every rerun.
    out, mirror = tmp_path / "run", tmp_path / "bucket"
    args = [cache, *STEPS, f"run.mirror={mirror}"]
    run_and_kill(out, 33, *args)
    assert (mirror / "latest").exists()
    shutil.rmtree(out / "checkpoints" if gone == "checkpoints" else out)  # the mirror is not gone
    rerun = run_train(out, *args)
    assert re.search(r"resumed from \S+ at step 30", rerun.stdout), rerun.stdout
    assert (f"note: no valid checkpoint in {out / 'checkpoints'}; step_00000030 fetched from "
            f"run.mirror={mirror}") in rerun.stdout, rerun.stdout
    if gone == "checkpoints":
        same_run(reference, out)
    else:  # its metrics from the resumed step on
        assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(reference)][30:]
        assert summary(out)["params_sha256"] == summary(reference)["params_sha256"]


@pytest.mark.slow
def test_init_from_loads_weights_only(tmp_path, cache, reference):
    ckpt = reference / "checkpoints" / "step_00000040"
    zero = tmp_path / "zero"
    # With an EMA: it starts from the warm-start weights too (not the fresh model's), and with no
    # step taken it is what is validated and exported.
    proc = train_here(zero, cache, "train.max_steps=0", f"run.init_from={ckpt}", "ema.enabled=true")
    assert "done: 0 steps | loss n/a | val_loss " in proc.stdout, proc.stdout  # not "loss None"
    assert summary(zero)["params_sha256"] == summary(reference)["params_sha256"]
    assert summary(zero)["ema_params_sha256"] == summary(reference)["params_sha256"]
    assert summary(zero)["val_loss"] == summary(reference)["val_loss"]
    warm = tmp_path / "warm"
    train_here(warm, cache, "train.max_steps=5", f"run.init_from={ckpt}")
    first = metrics(warm)[0]
    assert first["step"] == 1 and first["lr"] == metrics(reference)[0]["lr"]  # fresh schedule
    assert first["loss"] < metrics(reference)[0]["loss"] - 0.3  # but trained weights


@pytest.mark.slow
def test_init_from_on_a_run_that_resumes_says_it_is_not_used(tmp_path, cache, reference):
    # A run with checkpoints resumes from them; run.init_from only starts fresh runs. The note says
    # so, not "config differs in: run.init_from; this run's values apply from here on", which is
    # untrue here.
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    ckpt = reference / "checkpoints" / "step_00000020"
    rerun = train_here(out, cache, *STEPS, f"run.init_from={ckpt}")
    assert (f"note: run.init_from={ckpt} is not used: it starts a fresh run, and this one resumes "
            f"from its checkpoint; to start from those weights, give the run a new run.out_dir"
            ) in rerun.stdout, rerun.stdout
    assert "differs from the checkpoint's in: run.init_from" not in rerun.stdout
    assert summary(out)["params_sha256"] == summary(reference)["params_sha256"]
    assert "another run.seed" not in rerun.stdout


@pytest.mark.slow
def test_a_resume_with_another_seed_says_what_it_does_to_the_epoch(tmp_path, cache, reference):
    # The data order is a function of (seed, epoch, index): the epoch goes on in another
    # permutation from the same position, and validation draws other batches.
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    rerun = train_here(out, cache, *STEPS, "run.seed=7")
    assert ("note: with another run.seed the rest of this epoch follows another order, so some of "
            "its samples are trained on twice and some not at all, and validation reads other "
            "batches") in rerun.stdout, rerun.stdout


def test_init_from_a_missing_checkpoint_is_bad_input(tmp_path, cache):
    out = tmp_path / "run"
    proc = train_here(out, cache, f"run.init_from={tmp_path / 'nope'}", check=False)
    assert proc.returncode == 2 and "run.init_from" in proc.stderr and not out.exists()
    assert "holds checkpoints" not in proc.stderr  # nothing near it to suggest


@pytest.mark.slow
def test_init_from_a_model_pt_loads_its_weights(tmp_path, cache, reference):
    # The export is what a finished run (or someone else) hands on: run.init_from takes it, so a
    # model.pt alone, with no checkpoints beside it, can be fine-tuned.
    alone = tmp_path / "given" / "model.pt"
    alone.parent.mkdir()
    alone.write_bytes((reference / "model.pt").read_bytes())
    zero = tmp_path / "zero"
    proc = train_here(zero, cache, "train.max_steps=0", f"run.init_from={alone}")
    assert f"initialised model weights from {alone}" in proc.stdout, proc.stdout
    assert summary(zero)["params_sha256"] == summary(reference)["params_sha256"]
    # Its one validation, at the end, logs its text sample (the loop took no step to log one at).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(zero / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Tensors("sample/text_summary")] == [0]
    # A bare state_dict, as torch.save(model.state_dict(), PATH) writes it, loads the same.
    torch.save(torch.load(alone, weights_only=True)["model"], alone)
    bare = tmp_path / "bare"
    train_here(bare, cache, "train.max_steps=0", f"run.init_from={alone}")
    assert summary(bare)["params_sha256"] == summary(reference)["params_sha256"]
    torch.save({"weights": [1, 2]}, alone)
    proc = train_here(tmp_path / "bad", cache, f"run.init_from={alone}", check=False)
    assert proc.returncode == 2 and not (tmp_path / "bad").exists(), proc.stderr
    assert proc.stderr.endswith(f"error: run.init_from={alone}: expected a checkpoint directory, a "
                                f"model.pt as train.py exports it (a dict whose \"model\" is a state_dict), "
                                f"or a state_dict saved with torch.save(model.state_dict(), PATH).\n"), \
        proc.stderr
    wider = train_here(tmp_path / "wider", cache, "model.n_embd=48", f"run.init_from={reference / 'model.pt'}",
                      check=False)
    # Named: the 16 tensors that differ, and the keys that set the shapes otherwise in its run; the
    # advice is for a warm start, not a resume.
    assert wider.returncode == 2 and not (tmp_path / "wider").exists(), wider.stderr
    listed = wider.stderr.split("\n")[1:-2]
    assert wider.stderr.split("\n")[0] == (f"error: model file {reference / 'model.pt'} does not fit "
                                           f"the configured model (16 tensor(s)):"), wider.stderr
    assert len(listed) == 16 and listed[0] == "  wte.weight: checkpoint (103, 32) vs model (103, 48)"
    assert listed[-1] == "  lm_head.weight: checkpoint (103, 32) vs model (103, 48)", listed
    assert wider.stderr.endswith(
        "\nIt was trained with model.n_embd=32 (this config: model.n_embd=48). Set the model.* keys it "
        "was trained with, or leave run.init_from empty to start from random weights.\n"), wider.stderr
    # A resume whose context (data.seq_len sizes the position table) was changed: named, not
    # "the model code differs".
    shorter = train_here(tmp_path / "shorter", cache, "data.seq_len=16",
                        f"run.resume={reference / 'checkpoints' / 'step_00000040'}", check=False)
    assert shorter.returncode == 2 and not (tmp_path / "shorter").exists()
    assert shorter.stderr.endswith(
        "  wpe.weight: checkpoint (32, 32) vs model (16, 32)\nIt was trained with data.seq_len=32 (this "
        "config: data.seq_len=16). Use the config and model code it was trained with, or a new "
        "run.out_dir (and a new run.mirror, if one is set: it would hand the new run the same "
        "checkpoint).\n"), shorter.stderr


def test_init_from_weights_the_model_lacks_names_each_of_them_and_the_key(tmp_path, cache):
    # Weights with tensors this model has no place for (trained with model.bias=true, warm-started
    # with false): every one named, and the key that made them, not load_state_dict's "Unexpected
    # key(s)" traceback (exit 1).
    biased = tmp_path / "biased"
    train_here(biased, cache, "train.max_steps=0", "model.bias=true")
    extra = [k for k in torch.load(biased / "model.pt", weights_only=True)["model"] if k.endswith(".bias")]
    out = tmp_path / "run"
    proc = train_here(out, cache, "train.max_steps=0", "model.bias=false", f"run.init_from={biased / 'model.pt'}",
                      check=False)
    assert proc.returncode == 2 and not out.exists(), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    listed = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("  ")]
    assert extra and listed == [f"{k}: in checkpoint, not in the model" for k in extra], proc.stderr
    assert f"({len(extra)} tensor(s))" in proc.stderr and "model.bias=True" in proc.stderr, proc.stderr
    # The other way, weights without the biases this model has: each named as missing from them,
    # not load_state_dict's "Missing key(s)" traceback.
    plain = tmp_path / "plain"
    train_here(plain, cache, "train.max_steps=0", "model.bias=false")
    out = tmp_path / "run_biased"
    proc = train_here(out, cache, "train.max_steps=0", "model.bias=true", f"run.init_from={plain / 'model.pt'}",
                      check=False)
    assert proc.returncode == 2 and not out.exists() and "Traceback" not in proc.stderr, proc.stderr
    listed = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("  ")]
    assert listed == [f"{k}: missing from checkpoint" for k in extra], proc.stderr
    assert "model.bias=False" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_latest_and_best_pointers_name_their_checkpoints(tmp_path, cache, reference):
    # checkpoints/latest and /best are what one sees in a run directory, and what one names. They
    # stand for the checkpoint they name; read as checkpoint files they give an IndexError traceback
    # from the unpickler for init_from, and "manifest.json is missing" for resume.
    ckpts = reference / "checkpoints"
    zero = tmp_path / "zero"
    proc = train_here(zero, cache, "train.max_steps=0", f"run.init_from={ckpts / 'latest'}")
    assert f"initialised model weights from {ckpts / 'step_00000040'}\n" in proc.stdout, proc.stdout
    assert summary(zero)["params_sha256"] == summary(reference)["params_sha256"]
    best = ckpts / (ckpts / "best").read_text()
    proc = train_here(tmp_path / "best", cache, "train.max_steps=0", f"run.init_from={ckpts / 'best'}")
    assert f"initialised model weights from {best}\n" in proc.stdout, proc.stdout
    proc = train_here(tmp_path / "on", cache, "train.max_steps=40", f"run.resume={ckpts / 'latest'}")
    assert f"resumed from {ckpts / 'step_00000040'} at step 40" in proc.stdout, proc.stdout
    # Any other file that torch.save did not write: named, exit 2, nothing written.
    out = tmp_path / "text"
    proc = train_here(out, cache, f"run.init_from={reference / 'summary.json'}", check=False)
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert proc.stderr.endswith(f"error: checkpoint file {reference / 'summary.json'}: not a file "
                                f"torch.save wrote (it starts with b'{{\\n \"'); expected a "
                                f"checkpoint's state.pt or an exported model.pt.\n"), proc.stderr
    # A pointer naming a checkpoint that is gone (deleted by hand): named as such, not read as a
    # checkpoint directory itself ("manifest.json is missing ... NotADirectoryError").
    copy = tmp_path / "copy"
    shutil.copytree(ckpts, copy)
    (copy / "latest").write_text("step_00000099")
    out = tmp_path / "stale"
    proc = train_here(out, cache, f"run.resume={copy / 'latest'}", check=False)
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert proc.stderr.startswith(f"error: {copy / 'latest'} names step_00000099, which is not in {copy}; "
                                  f"expected the name of a checkpoint directory there. {copy} holds "
                                  f"checkpoints: the newest is {copy / 'step_00000040'}"), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("named", ["", "checkpoints"])
def test_init_from_a_run_dir_names_the_checkpoints_that_would_do(tmp_path, cache, reference, named):
    # A finished run is what one warm-starts from, and its directory what one names. The error
    # says which checkpoints in it run.init_from takes (the newest, and the best).
    out = tmp_path / "run"
    proc = train_here(out, cache, f"run.init_from={reference / named}", check=False)
    ckpts = reference / "checkpoints"
    best = ckpts / (ckpts / "best").read_text()
    said = f"{ckpts} holds checkpoints: the newest is {ckpts / 'step_00000040'}; the best: {best}."
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_model_s_own_submodule_named_module_is_checkpointed_with_the_rest(tmp_path):
    # Only DDP's wrapper is taken off the model: a user's wrapper may keep its inner model as
    # `.module`, and the checkpoint, the EMA and evaluation need the whole of it.
    from conftest import build_data, build_model, load_config
    from loop.optim import build_optimizer
    from loop.precision import Precision
    from loop.schedule import build_scheduler
    from loop.trainer import Trainer

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.module, self.gain = inner, torch.nn.Parameter(torch.ones(()))

        def forward(self, batch: dict):
            return self.module(batch) * self.gain

    cpu = torch.device("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "data.name=markov", f"data.cache_dir={tmp_path / 'cache'}", "data.markov.tokens=4000",
        "data.seq_len=16", "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
        f"run.out_dir={tmp_path / 'run'}", "train.device=cpu"])
    data = build_data(cfg.data)
    model = Wrapper(build_model(cfg.model, data))
    opt = build_optimizer(model, cfg.optim, cpu)
    trainer = Trainer(cfg, model, data, opt, build_scheduler(opt, cfg.schedule, 10), Precision("fp32", cpu), cpu)
    trainer.run_facts = {"config": {}, "config_sha256": "", "world_size": 1, "metadata": {}}
    trainer.save()
    saved = torch.load(trainer.checkpoints.root / "step_00000000" / "state.pt", weights_only=True)["model"]
    assert saved.keys() == model.state_dict().keys() and "gain" in saved


def test_non_finite_weights_are_never_checkpointed(tmp_path, capsys):
    from conftest import build_data, build_model, load_config
    from loop.optim import build_optimizer
    from loop.precision import Precision
    from loop.schedule import build_scheduler
    from loop.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "data.name=markov", f"data.cache_dir={tmp_path / 'cache'}", "data.markov.tokens=4000",
        "data.seq_len=16", "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
        f"run.out_dir={tmp_path / 'run'}", "train.device=cpu"])
    data = build_data(cfg.data)
    model = build_model(cfg.model, data)
    model.register_buffer("running", torch.ones(2))  # a running statistic (BatchNorm's)
    # Not finite by design, as built: an additive attention mask, in the checkpoint or not.
    model.register_buffer("mask", torch.tensor([0.0, -float("inf")]))
    model.register_buffer("scratch", torch.tensor([float("nan")]), persistent=False)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    trainer = Trainer(cfg, model, data, opt, build_scheduler(opt, cfg.schedule, 10),
                      Precision("fp32", torch.device("cpu")), torch.device("cpu"))
    trainer.run_facts = {"config": {}, "config_sha256": "", "world_size": 1, "metadata": {}}
    trainer.progress.step = 1
    trainer.save()
    root = trainer.checkpoints.root
    assert store.verify(root / "step_00000001") is None  # finite: saved
    with torch.no_grad():
        model.blocks[0].mlp[0].weight[0, 0] = float("inf")
    trainer.progress.step = 2
    trainer.save()
    assert not (root / "step_00000002").exists()
    assert "step 2: weights" in capsys.readouterr().err
    with torch.no_grad():  # the running statistic is saved and resumed from too
        model.blocks[0].mlp[0].weight[0, 0] = 0.0
        model.running[1] = float("nan")
    trainer.progress.step = 3
    trainer.save()
    assert not (root / "step_00000003").exists()
    # A skip judges the running statistic alone, as the save does: stained, the run gives up.
    nan = torch.tensor(float("nan"))
    with pytest.raises(GaveUp, match=r"buffers running not finite"):
        trainer.nonfinite.verdict(nan[None], nan, model)
    model.running.fill_(1.0)
    assert trainer.nonfinite.verdict(nan[None], nan, model) == "skip"  # the mask and scratch are not judged
    assert json.loads((root / "step_00000001" / "manifest.json").read_text())["world_size"] == 1
