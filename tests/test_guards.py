"""Numerical and memory guards: a non-finite step is skipped (nothing moves), rolled back past
(its data window never trained on), or aborts with a diagnostic; too many in a row give up; an
out-of-memory halves the micro-batch and retries with the same global batch; one host read per
optimizer step; determinism mode gives identical runs."""
from __future__ import annotations

import functools
import gc
import json
import os
import sys
import weakref

import pytest
import torch

from conftest import (
    ROOT,
    Mapped,
    load_config,
    metrics,
    out_of_memory_in_a_cycle,
    run_and_kill,
    run_train,
    summary,
    train_here,
)
from loop.checkpoint import store
from loop.config.load import DEFAULT_CONFIG as DEFAULT
from loop.config.runtime import check_with_world, idle_settings
from loop.data.bundle import IGNORE_INDEX
from loop.distributed.group import Dist
from loop.errors import BadInput, GaveUp
from loop.guards import oom, preemption
from loop.precision import Precision

STEPS = ["train.max_steps=20", "train.ckpt_every=5"]
GB = 8  # global batch in samples: TINY's batch_size 4 x default grad_accum 2


def state(out, step):
    return torch.load(out / "checkpoints" / f"step_{step:08d}" / "state.pt", weights_only=True)


def test_skip_leaves_everything_as_it_was(tmp_path, cache):
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=12", "train.ckpt_every=1", "train.keep_last=20",
              "ema.enabled=true", "faults.nan_at_step=7")
    before, after = state(out, 6), state(out, 7)
    for part in ("model", "optimizer", "scheduler", "ema"):
        assert _equal(before[part], after[part]), part
    assert after["progress"]["skipped"] == 1 and after["progress"]["samples"] == 7 * GB
    recs = metrics(out)
    assert [r["skipped"] for r in recs].count(True) == 1 and recs[6]["skipped"]
    assert recs[7]["lr"] == recs[6]["lr"]  # the skipped step did not advance the schedule
    assert summary(out)["skipped_steps"] == 1 and summary(out)["steps"] == 12


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def mask_even(i: int, item: dict) -> dict:
    """Every even-numbered sample has all its targets -100 (say, a prompt with no answer kept)."""
    return {**item, "y": torch.full_like(item["y"], IGNORE_INDEX)} if i % 2 == 0 else item


def test_a_step_without_targets_is_skipped_and_nothing_moves(tmp_path, cache, capsys):
    # Its loss is 0/0: skipped, not a ZeroDivisionError traceback (and not read as non-finite,
    # which would meet nan_policy=abort). A step with some masked samples trains on the rest as
    # usual.
    from conftest import TINY, build_trainer

    out = tmp_path / "run"
    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=12",
                                "data.batch_size=2", "train.grad_accum=1", "data.log_ids=true",
                                "train.ckpt_every=1", "train.keep_last=20", "ema.enabled=true",
                                "train.nan_policy=abort"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.data.train = Mapped(t.data.train, mask_even)
    t.run()
    recs = metrics(out)
    empty = [r["step"] for r in recs if all(i % 2 == 0 for i in r["ids"])]
    mixed = [r["step"] for r in recs if any(i % 2 == 0 for i in r["ids"]) and r["step"] not in empty]
    assert empty == [2, 4, 5, 12] and mixed  # the seed's order: both kinds are met
    err = capsys.readouterr().err
    for k in empty:
        before, after = state(out, k - 1), state(out, k)
        for part in ("model", "optimizer", "scheduler", "ema"):
            assert _equal(before[part], after[part]), (k, part)
        assert after["progress"]["samples"] == 2 * k  # the data moved on
        assert recs[k - 1]["skipped"] and recs[k - 1]["tokens"] == recs[k - 2]["tokens"]
        assert k == 12 or recs[k]["lr"] == recs[k - 1]["lr"]  # the schedule did not advance
        assert f"warning: step {k}: no targets in this step's batches (every y is -100" in err
    assert not any(recs[k - 1]["skipped"] for k in mixed)
    assert summary(out)["empty_steps"] == 4 and summary(out)["skipped_steps"] == 0
    assert summary(out)["steps"] == 12


def test_an_fp16_overflow_is_skipped_and_counted_apart_from_non_finite_steps(tmp_path, cache):
    # The GradScaler starts at 2**20 instead of 2**16, so that this small model overflows in fp16
    # on the CPU (at the default scale it never does): steps 1, 4 and 11 of the seed's run. Each
    # is the scaler's to skip (nothing moves, the LR does not advance, the scale halves), is not
    # a non-finite step for train.nan_policy (abort here), and is counted as overflow_steps.
    from conftest import TINY, build_trainer

    out = tmp_path / "run"
    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={out}", "train.precision=fp16",
                                "train.max_steps=12", "train.ckpt_every=1", "train.keep_last=20",
                                "ema.enabled=true", "train.nan_policy=abort"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.scaler = t.precision.scaler = t.parts["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    t.run()
    recs = metrics(out)
    assert [r["step"] for r in recs if r["skipped"]] == [1, 4, 11]
    for k in (4, 11):
        before, after = state(out, k - 1), state(out, k)
        for part in ("model", "optimizer", "scheduler", "ema"):
            assert _equal(before[part], after[part]), (k, part)
        assert after["scaler"]["scale"] == before["scaler"]["scale"] / 2
        assert recs[k]["lr"] == recs[k - 1]["lr"]  # the step after trains with the same LR
    assert state(out, 12)["scaler"]["scale"] == 2.0 ** 17
    s = summary(out)
    assert (s["overflow_steps"], s["skipped_steps"], s["steps"]) == (3, 0, 12)


def test_a_non_finite_loss_under_fp16_meets_the_nan_policy_not_the_scaler(tmp_path, cache):
    # Gradients that overflow fp16 are the GradScaler's to skip; a loss that is not finite is the
    # model's or the data's fault whatever the precision. Counted as an overflow and skipped, it
    # would never let train.nan_policy=abort stop an fp16 run diverging.
    from conftest import TINY, build_trainer

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.precision=fp16",
                                "train.max_steps=4", "train.nan_policy=abort", "faults.nan_at_step=3"])
    with pytest.raises(GaveUp, match="step 3: non-finite loss of micro-batch 0"):
        build_trainer(cfg, Dist(), torch.device("cpu")).run()


def test_fp16_gradients_that_overflow_at_a_scale_of_1_meet_the_nan_policy(tmp_path, cache):
    # A NaN gradient with a finite loss reads as an fp16 overflow; the scaler halves its scale
    # at each one. At a scale of 1 or less the overflow is the model's: counted as an overflow
    # forever, it would idle the run to train.max_steps with train.nan_policy=abort never met.
    from conftest import TINY, build_trainer

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.precision=fp16",
                                "train.max_steps=6", "train.nan_policy=abort"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.scaler = t.precision.scaler = t.parts["scaler"] = torch.amp.GradScaler("cpu", init_scale=4.0)
    t.raw.lm_head.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(GaveUp, match=r"step 3: non-finite grad norm \(nan\)"):
        t.run()
    assert (t.progress.overflows, t.progress.step) == (2, 2)  # at scales 4 and 2


class TokenNorm(torch.nn.BatchNorm1d):
    """BatchNorm over the channels of (B, T, C) activations."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_skip_cannot_undo_a_buffer_its_forward_made_non_finite(tmp_path, cache, policy, monkeypatch):
    # A forward in train mode updates BatchNorm's running statistics before the step is judged.
    # Skipped, the step would keep them not finite: every evaluation NaN, silently. The run gives
    # up naming the buffer; a rollback restores it from the checkpoint and trains on.
    from conftest import TINY, build_trainer
    from model import MODELS

    norm, build_gpt = TokenNorm(32, affine=False), MODELS["gpt"]

    @functools.wraps(build_gpt)
    def with_norm(options, data):  # the GPT with a BatchNorm after its embeddings, as built
        model = build_gpt(options, data)
        model.drop = torch.nn.Sequential(norm, model.drop)
        return model

    monkeypatch.setitem(MODELS, "gpt", with_norm)
    out = tmp_path / "run"
    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=6",
                                "train.ckpt_every=1", f"train.nan_policy={policy}"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    fired = []

    def blow(_module, inputs):
        if t.model.training and t.progress.step + 1 == 3 and not fired:
            fired.append(True)
            return inputs[0] * float("inf")

    norm.register_forward_pre_hook(blow)
    if policy == "skip":
        with pytest.raises(GaveUp, match=r"step 3: .*drop\.0\.running_mean"):
            t.run()
        assert [d.name for d in store.step_dirs(out / "checkpoints")] == ["step_00000001", "step_00000002"]
    else:
        assert t.run()["rollbacks"] == 1
        assert torch.isfinite(norm.running_mean).all() and torch.isfinite(norm.running_var).all()


def test_a_rollback_under_fp16_trains_on(tmp_path, cache):
    # The scaler has checked the bad step's gradients for infs; a rollback that does not finish
    # that step with it (update) leaves the check pending, and the next step raises "unscale_() has
    # already been called on this optimizer since the last update()".
    from conftest import TINY, build_trainer

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.precision=fp16",
                                *STEPS, "train.max_steps=8", "train.nan_policy=rollback",
                                "faults.nan_at_step=7"])
    s = build_trainer(cfg, Dist(), torch.device("cpu")).run()
    assert (s["rollbacks"], s["steps"], s["skipped_steps"]) == (1, 8, 0)


@pytest.mark.parametrize("every, bad, back_to", [(5, 1, 0), (2, 3, 2)])
def test_a_rollback_goes_back_to_the_checkpoint_of_the_step_just_before(tmp_path, cache, capsys, every, bad, back_to):
    # A bad first step: back to the step-0 checkpoint written for it. A bad step right after a
    # checkpoint: back to that one, not one older.
    from conftest import TINY, build_trainer

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=6",
                                f"train.ckpt_every={every}", "train.nan_policy=rollback", f"faults.nan_at_step={bad}"])
    s = build_trainer(cfg, Dist(), torch.device("cpu")).run()
    assert (s["rollbacks"], s["steps"]) == (1, 6)
    assert f"rolled back to step {back_to};" in capsys.readouterr().err


def test_a_rollback_is_not_a_step_the_loop_evaluates_or_checkpoints_again(tmp_path, cache, monkeypatch):
    # Trainer.step returns False after a rollback: the loop goes on from the checkpoint's step with
    # nothing a finished step does. Counted as one, the step rolled back to (2, an eval and checkpoint
    # step) would be evaluated a second time: an evaluation more for early stopping's patience, its
    # val_loss logged twice, and its checkpoint written again.
    from conftest import TINY, build_trainer
    from loop.evaluate import Evaluator

    evaluated, evaluate = [], Evaluator.evaluate

    def recorded(self, *args):
        evaluated.append(self.progress.step)
        return evaluate(self, *args)

    monkeypatch.setattr(Evaluator, "evaluate", recorded)
    out = tmp_path / "run"
    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=6", "train.ckpt_every=2",
                                "train.eval_every=2", "train.nan_policy=rollback", "faults.nan_at_step=3"])
    s = build_trainer(cfg, Dist(), torch.device("cpu")).run()
    assert (s["rollbacks"], s["steps"]) == (1, 6)
    assert evaluated == [2, 4, 6]
    assert [r["step"] for r in metrics(out) if "val_loss" in r] == [2, 4, 6]


@pytest.mark.slow
def test_a_rollback_waits_for_the_checkpoint_still_being_written(tmp_path, cache, monkeypatch, capsys):
    # train.async_save: step 10's checkpoint (on a disk made a second slower) is still being
    # written when step 12 turns out bad. The rollback waits for it; without the wait it would go
    # back to step 5, replaying five steps more than needed.
    import time

    from conftest import TINY, build_trainer

    save = store.save
    monkeypatch.setattr(store, "save", lambda *a, **k: (time.sleep(1), save(*a, **k))[1])
    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", *STEPS,
                                "train.max_steps=14", "train.async_save=true",
                                "train.nan_policy=rollback", "faults.nan_at_step=12"])
    s = build_trainer(cfg, Dist(), torch.device("cpu")).run()
    assert "rolled back to step 10;" in capsys.readouterr().err and s["rollbacks"] == 1


def test_the_stop_signals_are_the_callers_again_after_a_run(tmp_path, cache):
    # The run handles SIGTERM and SIGUSR1 itself (finish the step, checkpoint, exit 143). Kept
    # after it, the handler would only raise a flag on a run that is over: a notebook that had
    # called train.main would ignore SIGTERM from then on. Put back after a run that ends, or gives
    # up.
    import signal

    from conftest import TINY, build_trainer

    mine = {s: signal.signal(s, signal.default_int_handler) for s in preemption.STOP_SIGNALS}
    try:
        for extra in ([], ["train.nan_policy=abort", "faults.nan_at_step=2"]):
            cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / str(len(extra))}",
                                        "train.max_steps=3", *extra])
            gave_up = False
            try:
                build_trainer(cfg, Dist(), torch.device("cpu")).run()
            except GaveUp:
                gave_up = True
            assert gave_up == bool(extra)  # the second run did end on its error path
            assert all(signal.getsignal(s) is signal.default_int_handler for s in mine), extra
    finally:
        for s, handler in mine.items():
            signal.signal(s, handler)


def test_a_run_that_diverges_in_its_last_steps_ends_without_a_sample(tmp_path, cache):
    # Step 1 (finite) throws the weights to ~1e30; every step after is non-finite and skipped, too
    # few to give up. No final text sample: drawn from NaN probabilities, it is a RuntimeError
    # traceback.
    out = tmp_path / "run"
    proc = train_here(out, cache, "train.max_steps=4", "optim.lr=1e30", "schedule.warmup_steps=0")
    assert [r["skipped"] for r in metrics(out)] == [False, True, True, True]
    assert "warning: step 4: val_loss is nan; no text sample drawn" in proc.stderr, proc.stderr
    s = summary(out)
    assert s["sample"] is None and s["val_loss"] != s["val_loss"] and s["skipped_steps"] == 3


@pytest.mark.slow
def test_rollback_passes_over_the_bad_window_and_resumes_exactly(tmp_path, cache):
    args = [cache, *STEPS, "train.nan_policy=rollback", "faults.nan_at_step=13", "train.keep_last=10"]
    ref, clean = tmp_path / "ref", tmp_path / "clean"
    proc = run_train(ref, *args)
    assert "rolled back to step 10" in proc.stderr and f"position {12 * GB}" in proc.stderr
    run_train(clean, cache, *STEPS)  # the same run without the fault
    recs, plain = metrics(ref), metrics(clean)
    assert [r["step"] for r in recs] == list(range(1, 21))  # each step once in the log
    assert [r["loss"] for r in recs[:12]] == [r["loss"] for r in plain[:12]]  # replay is exact
    assert recs[12]["loss"] != plain[12]["loss"]  # step 13 trained on the next window instead
    final = state(ref, 20)["progress"]
    assert final["skip_windows"] == [[12 * GB, 13 * GB]] and final["rollbacks"] == 1
    assert final["samples"] == 21 * GB  # one window more was drawn than steps were taken
    assert summary(ref)["rollbacks"] == 1 and summary(ref)["skipped_steps"] == 0
    # A run killed after the rollback and rerun ends the same: the skip list is in the checkpoint.
    out = tmp_path / "run"
    run_and_kill(out, 17, *args)
    run_train(out, *args)
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]
    # The rerun has checkpoints to roll back to: it writes no step 0 of its own (it holds step 15).
    for d in store.step_dirs(out / "checkpoints"):
        assert torch.load(d / "state.pt", weights_only=True)["progress"]["step"] == int(d.name[5:])


@pytest.mark.slow
def test_a_run_resumed_back_in_time_rolls_back_to_its_own_past(tmp_path, cache):
    # run.resume=step 10 of a directory that holds steps 15 and 20 of the run before: a NaN at
    # step 13 goes back to step 10, not forward to 20, and the run ends as one that met the NaN
    # without the detour.
    import shutil

    args = [cache, *STEPS, "train.nan_policy=rollback", "faults.nan_at_step=13"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, *args)
    run_train(out, cache, *STEPS)
    proc = run_train(out, *args, f"run.resume={out / 'checkpoints' / 'step_00000010'}")
    assert "rolled back to step 10" in proc.stderr, proc.stderr
    assert [r["step"] for r in metrics(out)] == list(range(1, 21))
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]
    # Branched off another directory's step 10 into one that holds only newer steps: the run
    # writes its own step 10 to go back to.
    other = tmp_path / "other"
    shutil.copytree(ref, other)
    for old in store.step_dirs(other / "checkpoints", upto=15):
        shutil.rmtree(old)
    run_train(other, *args, f"run.resume={ref / 'checkpoints' / 'step_00000010'}")
    assert (other / "checkpoints" / "step_00000010").is_dir()
    assert summary(other)["params_sha256"] == summary(ref)["params_sha256"]


@pytest.mark.slow
def test_a_run_stopped_between_a_rollback_and_its_bad_step_reruns_without_the_fault(tmp_path, cache):
    # Stopped by a signal while it replays steps 11 and 12 after rolling back from 13, the run
    # saves a checkpoint that holds the window to pass over; the rerun takes step 13 past it, as
    # the run that was never stopped did, and meets no second injected NaN there.
    import signal

    from conftest import train_cmd
    from tools import jobs

    args = [cache, *STEPS, "train.nan_policy=rollback", "faults.nan_at_step=13", "train.keep_last=10"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, *args)
    calls = []  # step lines from 11 on: 11 and 12, the rollback, then 11 again

    def replaying() -> bool:
        calls.append(1)
        return len(calls) == 3

    code, printed = jobs.run_until(train_cmd(out, *args), 11, signal.SIGTERM, cwd=ROOT, ready=replaying)
    assert code == 143 and "rolled back to step 10" in printed, printed
    assert state(out, int(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"])
                 )["progress"]["last_bad"] == 13
    rerun = run_train(out, *args)
    assert "rolled back" not in rerun.stderr, rerun.stderr
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]


def test_rollback_that_never_gets_past_a_bad_step_gives_up(tmp_path, cache):
    # Step 1 throws the weights to ~1e30 and step 2 is non-finite, whatever its data: each
    # rollback replays step 1 (a good step, which would reset the count of bad steps in a row) and
    # meets step 2 again, with the next data window. The run gives up rather than go on forever.
    proc = train_here(tmp_path / "run", cache, "train.max_steps=8", "optim.lr=1e30",
                     "schedule.warmup_steps=0", "train.nan_policy=rollback", "train.max_bad_steps=2",
                     check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("rolled back to step 0") == 2
    assert ("Gave up: 3 bad steps in a row (train.max_bad_steps=2); the last 2 rollbacks did not "
            "get the run past step 2.") in proc.stderr, proc.stderr


def test_abort_names_step_and_micro_batch_and_saves_nothing_after(tmp_path, cache):
    out = tmp_path / "run"
    proc = train_here(out, cache, *STEPS, "train.nan_policy=abort", "faults.nan_at_step=8",
                     check=False)
    assert proc.returncode == 3, proc.stderr
    assert "step 8: non-finite loss of micro-batch 0" in proc.stderr
    assert "train.nan_policy=abort" in proc.stderr
    assert [p.name for p in store.step_dirs(out / "checkpoints")] == ["step_00000005"]
    assert not (out / "summary.json").exists()
    assert [r["step"] for r in metrics(out)] == list(range(1, 8))  # finished steps are logged


def test_too_many_bad_steps_in_a_row_gives_up(tmp_path, cache):
    out = tmp_path / "run"  # an absurd LR makes every step after the first few non-finite
    proc = train_here(out, cache, *STEPS, "optim.lr=1e20", "train.clip_grad=0",
                     "train.max_bad_steps=3", check=False)
    assert proc.returncode == 3
    assert "4 bad steps in a row (train.max_bad_steps=3)" in proc.stderr


def trainer_with_bad_windows(out, cache, windows: set[int], *overrides):
    """An in-process trainer (TINY, 20 steps, a checkpoint every 5) whose training loss is NaN on
    the data windows starting at the sample positions in `windows`: bad data, bad again whenever
    its window is drawn again (unlike faults.nan_at_step, which fires once)."""
    from conftest import TINY, build_trainer

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={out}", *STEPS, *overrides])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    met = []

    def hook(module, _inputs, loss):
        if not (module.training and t.progress.samples in windows):
            return loss
        met.append(t.progress.samples)  # once per micro-batch, 2 a window (default grad_accum)
        # Met again after a rollback, a window can be met forever (each rollback the other's
        # replay): fail instead of hanging.
        assert len(met) <= 2 * len(windows), f"a bad window was met again: {met}"
        return loss * float("nan")

    t.raw.register_forward_hook(hook)
    return t


def test_bad_steps_that_are_not_in_a_row_never_give_up(tmp_path, cache):
    # max_bad_steps counts bad steps in a row: a good step in between starts the count again.
    t = trainer_with_bad_windows(tmp_path / "run", cache, {2 * GB, 4 * GB, 6 * GB},
                                 "train.max_bad_steps=1")
    s = t.run()
    assert [r["step"] for r in metrics(tmp_path / "run") if r["skipped"]] == [3, 5, 7]
    assert (s["skipped_steps"], s["steps"]) == (3, 20)


@pytest.mark.parametrize("at, windows, batch, starts", [
    (96, [[96, 112]], 4, 112),  # half the width that marked it: not its second half trained
    (96, [[96, 104]], 8, 104),  # twice the width: not the good samples past the window
    (88, [[96, 104]], 8, 104),  # a step that would end inside a window starts past it
    (96, [[96, 104], [104, 120]], 4, 120),  # windows back to back
    (88, [[96, 104]], 2, 88),  # a step that ends where a window starts is trained
    (96, [96], 4, 104),  # a window as its start only: one step of the run's width
])
def test_a_window_is_passed_over_whole_at_any_step_width(cache, at, windows, batch, starts):
    # A checkpoint written after a rollback and before its window came up holds the window; a run
    # resumed from it with another global batch (another process count or data.batch_size, without
    # train.global_batch) takes its first step past the window's end.
    import itertools

    from conftest import TINY, build_data
    from loop.data.feed import Feed
    from loop.data.sampler import StreamSampler
    from loop.progress import Progress

    cfg = load_config(DEFAULT, [cache, *TINY, f"data.batch_size={batch}"])  # x train.grad_accum 2
    data = build_data(cfg.data)
    order = [i for _, i in itertools.islice(iter(StreamSampler(len(data.train), cfg.run.seed)), 200)]
    p = Progress(samples=at, skip_windows=windows)
    feed = Feed(data, cfg, False, p, Dist())
    feed.start()
    drawn = [i for b in feed.draw()[0] for i in b["idx"].tolist()]
    feed.close()
    assert p.samples == starts and drawn == order[starts:starts + 2 * batch]


def test_a_window_past_this_rank_s_share_but_inside_the_global_step_is_passed_over(cache):
    # Windows are in global samples: a step of 2 processes takes twice one process's, so a window
    # that starts past this rank's share of the step but inside the step is passed over whole, or
    # the other rank's half of the step would train on samples a rollback marked as bad.
    import itertools

    from conftest import TINY, build_data
    from loop.data.feed import Feed
    from loop.data.sampler import StreamSampler
    from loop.progress import Progress

    cfg = load_config(DEFAULT, [cache, *TINY])  # batch_size 4 x train.grad_accum 2
    data = build_data(cfg.data)
    assert Feed(data, cfg, False, Progress(), Dist()).width() == 8
    p = Progress(samples=96, skip_windows=[[104, 112]])
    feed = Feed(data, cfg, False, p, Dist(world=2))  # rank 0 of 2: no process group needed to draw
    assert feed.width() == 16
    feed.start()
    drawn = [b["idx"].tolist() for b in feed.draw()[0]]
    feed.close()
    order = [i for _, i in itertools.islice(iter(StreamSampler(len(data.train), cfg.run.seed)), 200)]
    assert p.samples == 112 and drawn == [order[112:116], order[120:124]]  # rank 0's slice of each micro-batch


def test_every_window_rolled_back_from_stays_passed_over(tmp_path, cache):
    # Two bad windows after the same checkpoint (step 10): the second rollback goes back to it
    # too, and must pass over the first window as well, or it meets it again (and again...). The
    # good step 13 between them ends the first bad step's row: max_bad_steps=1 does not give up.
    out = tmp_path / "run"
    s = trainer_with_bad_windows(out, cache, {12 * GB, 14 * GB}, "train.nan_policy=rollback",
                                 "train.max_bad_steps=1").run()
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 21)) and not any(r["skipped"] for r in recs)
    final = state(out, 20)["progress"]
    assert final["skip_windows"] == [[12 * GB, 13 * GB], [14 * GB, 15 * GB]] and final["samples"] == 22 * GB
    assert (s["rollbacks"], s["skipped_steps"]) == (2, 0)


def test_a_rollback_keeps_the_micro_batch_an_oom_split_to(tmp_path, cache):
    # Out of memory at step 12 (micro-batch 8 -> 4), then a NaN at step 14 rolls back to step 10,
    # saved before the split: the replay keeps micro-batch 4, which is known to fit.
    out = tmp_path / "run"
    train_here(out, cache, *STEPS, "data.batch_size=8", "train.grad_accum=1",
              "train.nan_policy=rollback", "faults.oom_at_step=12", "faults.nan_at_step=14")
    assert [r["micro_batch"] for r in metrics(out)] == [8] * 10 + [4] * 10
    assert state(out, 20)["progress"]["micro_split"] == 2 and summary(out)["rollbacks"] == 1


def test_oom_halves_the_micro_batch_and_keeps_the_maths(tmp_path, cache):
    args = [cache, *STEPS, "data.batch_size=8", "train.grad_accum=1", "model.dropout=0"]
    ref = tmp_path / "ref"
    train_here(ref, *args)
    plain = metrics(ref)
    for where in ("forward", "backward"):  # as the forward ends; as the backward starts
        out = tmp_path / where
        proc = train_here(out, *args, "faults.oom_at_step=6", f"faults.oom_in={where}")
        assert "step 6: out of memory; micro-batch 8 -> 4, accumulation x2" in proc.stderr
        assert "dropout" in proc.stderr  # what the split does not keep
        recs = metrics(out)
        assert [r["micro_batch"] for r in recs] == [8] * 5 + [4] * 15
        assert [r["tokens"] for r in recs] == [r["tokens"] for r in plain]  # same global batch
        # Same samples, same maths; only the order of float additions differs (two partial sums
        # instead of one), so losses agree to float32 rounding, not bit for bit.
        for a, b in zip(recs, plain):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (where, a["step"])
        assert state(out, 20)["progress"]["micro_split"] == 2  # a resume keeps the smaller size
        assert summary(out)["micro_batch"] == 4


def test_a_resume_with_another_batch_size_cuts_it_to_the_micro_batch_known_to_fit(tmp_path, cache):
    # Out of memory at step 3 split data.batch_size 8 into micro-batches of 4. The split is for 8:
    # resumed at 4 (the advice after an out of memory) it trains whole, at 16 in pieces of 4, not
    # at half and at 8, which is known not to fit; at 8 again it keeps the split.
    import shutil

    first = tmp_path / "first"
    train_here(first, cache, "train.max_steps=5", "train.ckpt_every=5", "data.batch_size=8",
               "train.grad_accum=1", "faults.oom_at_step=3")
    assert state(first, 5)["progress"]["micro_split"] == 2
    for batch, accum, micro, split in ((4, 2, 4, 1), (16, 1, 4, 4), (8, 1, 4, 2)):
        out = tmp_path / str(batch)
        shutil.copytree(first, out)
        proc = train_here(out, cache, "train.max_steps=7", "train.ckpt_every=7", f"data.batch_size={batch}",
                          f"train.grad_accum={accum}")
        assert [r["micro_batch"] for r in metrics(out)] == [8, 8, 4, 4, 4, micro, micro], batch
        assert state(out, 7)["progress"]["micro_split"] == split
        said = f"data.batch_size={batch} now trains in micro-batches of {micro}"
        assert (said in proc.stdout) is (batch != 8), proc.stdout



def test_a_resplit_counts_an_uneven_split_by_its_largest_micro_batch():
    # data.batch_size 6 split 4 ways trained in micro-batches of 2, 2, 1, 1: 2 is known to fit, so a
    # resume at 4 trains in 2s (split 2), not in 1s.
    from loop.progress import Progress

    p = Progress(micro_split=4)
    note = oom.resplit(p, 6, 4)
    assert p.micro_split == 2 and "micro-batches of 2" in note and note.endswith("micro-batches of 2")


def test_a_rollback_keeps_the_split_its_run_found_and_says_no_other(tmp_path, cache):
    # Resumed at 16 from 8 split in 4s (so in 4s), out of memory again at step 6 (in 2s), then a
    # rollback to that checkpoint: the run keeps its 2s, and the resume's note is not said again
    # with the 4s the checkpoint alone would give.
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=5", "train.ckpt_every=5", "data.batch_size=8",
               "train.grad_accum=1", "faults.oom_at_step=3")
    proc = train_here(out, cache, "train.max_steps=8", "train.ckpt_every=100", "data.batch_size=16",
                      "train.grad_accum=1", "faults.oom_at_step=6", "faults.nan_at_step=7",
                      "train.nan_policy=rollback")
    assert "rolled back to step 5" in proc.stderr, proc.stderr
    assert [r["micro_batch"] for r in metrics(out)] == [8, 8, 4, 4, 4, 2, 2, 2]
    assert proc.stdout.count("data.batch_size=16 now trains in micro-batches of 4") == 1, proc.stdout


def test_a_cuda_library_s_failure_to_allocate_is_an_out_of_memory_and_other_errors_are_not():
    # cuBLAS creates the backward thread's handle at the first backward pass; with the forward's
    # activations filling the card that fails as a RuntimeError (on an H100, GPT-2 124M retried at
    # micro-batch 64), which a smaller micro-batch fixes like any out-of-memory.
    from loop.progress import Progress

    guard = oom.OutOfMemory("split", 8, Progress(), Dist(), sharded=False)
    with guard.attempt() as a:
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert a.failed
    with pytest.raises(RuntimeError, match="illegal memory access"), guard.attempt():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_split_frees_the_failed_try_s_tensors_that_a_reference_cycle_held():
    # On an H200 (GPT-2 124M at micro-batch 512, eager) the dropped error still held the failed
    # try's 139 GiB of activations through a cycle (error -> traceback -> frame -> error) until a
    # collection: every smaller retry then ran out too, down to 16. The split collects first.
    from loop.progress import Progress

    guard, held = oom.OutOfMemory("split", 8, Progress(), Dist(), sharded=False), []

    def forward():
        activations = torch.zeros(1000)
        held.append(weakref.ref(activations))
        out_of_memory_in_a_cycle()

    gc.disable()  # no collection but the split's
    try:
        with guard.attempt() as a:
            forward()
        assert a.failed and held[0]() is not None  # the error is dropped, the cycle is not
        guard.split(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), torch.device("cpu"))
        assert held[0]() is None and guard.micro_batch() == 4
    finally:
        gc.enable()


def test_the_contract_probe_retries_in_halves_with_what_the_failed_try_held_freed():
    # The validation probe before training halves a batch too big for the card (for training's
    # split to reach it); each half starts with the failed try's tensors freed, as the split does.
    from types import SimpleNamespace

    from loop.probe import fitted

    class FitsTwo(torch.nn.Module):  # runs out of memory past 2 samples, in a cycle
        def __init__(self):
            super().__init__()
            self.tries = []

        def forward(self, batch):
            x = batch["x"].float() + 1
            assert all(t() is None for t in self.tries), "a failed try's tensors are still held"
            self.tries.append(weakref.ref(x))
            if len(x) > 2:
                out_of_memory_in_a_cycle()
            return (batch["y"] != -100).sum().float() * 2  # a loss of 2 per target

    y = torch.zeros(8, 4, dtype=torch.long)
    batch = {"idx": torch.arange(8), "x": torch.zeros(8, 4, dtype=torch.long), "y": y, "n_targets": 32}
    cpu = torch.device("cpu")
    evaluator = SimpleNamespace(precision=Precision("fp32", cpu), device=cpu, dist=Dist(), sharded=False)
    gc.disable()  # no collection but the probe's own
    try:
        assert fitted(evaluator, FitsTwo(), batch, oom=None) == ({"val_loss": 2.0}, 4)
    finally:
        gc.enable()


def test_validation_after_an_oom_runs_in_the_smaller_micro_batches():
    # A card that ran out of memory in training at micro-batch 8 may run out in validation too:
    # validation cuts its batches the same way, and its means do not change.
    from loop.distributed.group import Dist
    from loop.evaluate import val_metrics

    class Sizes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, batch):
            self.seen.append(len(batch["idx"]))
            return (batch["y"] != -100).sum().float() * 2  # a loss of 2 per target

    y = torch.zeros(8, 4, dtype=torch.long)
    y[0] = -100  # a padded sample: targets are recounted per piece
    batch = {"idx": torch.arange(8), "x": torch.zeros(8, 4, dtype=torch.long), "y": y, "n_targets": 28}
    cpu, model = torch.device("cpu"), Sizes()
    got = val_metrics(model, [batch, batch], Precision("fp32", cpu), cpu, Dist(), split=2)
    assert model.seen == [4, 4, 4, 4] and got == {"val_loss": 2.0}
    for mode in (False, True):  # it evaluates in eval mode and leaves the model in its own
        model.train(mode)
        val_metrics(model, [batch], Precision("fp32", cpu), cpu, Dist())
        assert model.training is mode


def test_a_split_into_uneven_pieces_records_the_largest(tmp_path, cache, capsys):
    # 6 samples on a card that fits 2: halves of 3 fail, quarters are 2, 2, 1 and 1. The recorded
    # micro-batch (the log's and the summary's) is the largest piece, 2, not 1 (rounded down).
    from conftest import TINY, build_trainer, small_card

    out = tmp_path / "run"
    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=2",
                                "data.batch_size=6", "train.grad_accum=1", "train.eval_every=0"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    small_card(t, 2)
    assert t.run()["micro_batch"] == 2
    assert [r["micro_batch"] for r in metrics(out)] == [2, 2]
    err = capsys.readouterr().err
    assert "micro-batch 6 -> 3" in err and "micro-batch 3 -> 2" in err, err


def test_a_batch_too_big_from_the_start_reaches_training_and_is_split(tmp_path, cache, capsys):
    # A card that fits 2 samples at a time (a test double: the forward raises out of memory on
    # more). The contract probe before training must not run the whole validation batch: its out
    # of memory would be a traceback before any step, and the recovery below would never get its
    # chance.
    from conftest import TINY, build_trainer, small_card

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=3",
                                "data.batch_size=8", "train.grad_accum=1", "train.eval_every=0"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    sizes = small_card(t, 2)
    assert t.run()["micro_batch"] == 2
    err = capsys.readouterr().err
    assert "step 1: out of memory; micro-batch 8 -> 4" in err and "micro-batch 4 -> 2" in err
    # The probe: halved until it fits (it checks the contract only), then one piece that fitted,
    # again under another seed, and its halves, whose losses must add up.
    assert sizes[:10] == [8, 4, 2, 2, 2, 2, 2, 2, 1, 1]
    assert set(sizes[10:]) <= {8, 4, 2} and sizes[-1] == 2  # the final validation: pieces of 2

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'none'}", "data.batch_size=8"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    sizes.clear()

    def no_card(batch):
        sizes.append(len(batch["idx"]))
        raise torch.OutOfMemoryError("test double: nothing fits")

    t.raw.forward = no_card
    with pytest.raises(GaveUp, match=r"^out of memory in the model's first forward \(validation, no "
                                     r"gradients\), even one sample at a time: the model does not fit cpu"):
        t.run()
    assert sizes == [8, 4, 2, 1] and not (tmp_path / "none").exists()  # nothing written


@pytest.mark.parametrize("batch", [4, 1])
def test_a_card_that_fits_one_sample_trains_at_micro_batch_1(tmp_path, cache, batch):
    # The contract probe fits at one sample: its check of the loss as a sum compares that sample's
    # loss with its targets' two halves', and runs nothing larger (a classifier's one target:
    # tests/test_mnist.py).
    from conftest import TINY, build_trainer, small_card

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=2",
                                f"data.batch_size={batch}", "train.grad_accum=1", "train.eval_every=0"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    sizes = small_card(t, 1)
    assert t.run()["micro_batch"] == 1
    probe = [4, 2, 1] if batch == 4 else [1]  # halved until it fits
    # Then the check: the sample under two seeds and its targets' two halves; then training.
    assert sizes[:len(probe) + 4] == probe + [1] * 4, sizes


def test_a_trainer_that_gives_up_on_out_of_memory_keeps_its_model(tmp_path, cache):
    # A notebook that catches GaveUp still has the model to save or look at: the model is dropped
    # for a fresh DDP only once the split goes on.
    from conftest import TINY, build_trainer

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=4",
                                "train.oom_policy=abort", "faults.oom_at_step=2"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    model = t.model
    with pytest.raises(GaveUp, match="train.oom_policy=abort"):
        t.run()
    assert t.model is model


def test_a_split_under_ddp_retries_in_a_fresh_ddp_like_the_run_s_with_the_failed_try_freed(tmp_path, cache):
    # DDP over a one-process gloo group. The retry's DDP wraps the module itself (not the failed
    # try's DDP) with the run's train.find_unused_parameters: without it a model with unused
    # parameters stops at the next step. The failed try's graph is freed before the split hands
    # memory back, and the old DDP (its buckets a gradient's worth of memory, its hooks on every
    # parameter) before the new one is made: on a card that ran out, the retry needs that memory.
    import torch.distributed as dist

    from conftest import TINY, build_trainer
    from loop.distributed.wrap import is_ddp
    from loop.progress import Progress

    cfg = load_config(DEFAULT, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=3",
                                "train.grad_accum=1", "train.find_unused_parameters=true",
                                "faults.oom_at_step=2", "faults.oom_in=backward"])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    gc.disable()  # no collection but the guard's own
    try:
        t = build_trainer(cfg, Dist(), torch.device("cpu"))
        old, losses, freed = weakref.ref(t.model), [], {}
        forward, release, rewrap = t.forward, oom.release_memory, t.oom.rewrap

        def recorded(batch):
            loss = forward(batch)
            losses.append(weakref.ref(loss))
            return loss

        def released(device):
            release(device)
            freed["graph"] = losses[-1]() is None

        def rewrapped(device):
            model = rewrap(device)
            freed["old ddp"] = old() is None
            return model

        t.forward, t.oom.rewrap, oom.release_memory = recorded, rewrapped, released
        try:
            t.run()
        finally:
            oom.release_memory = release
        assert freed == {"graph": True, "old ddp": True}
        assert [r["micro_batch"] for r in metrics(tmp_path / "run")] == [4, 2, 2]
        assert is_ddp(t.model) and t.model.module is t.raw and t.model.find_unused_parameters
        # The messages name the module's own switch under DDP too.
        with pytest.raises(GaveUp, match=r"model\.activation_checkpointing=true"):
            oom.OutOfMemory("abort", 4, Progress(), Dist(), False, t.model).split(t.optimizer, torch.device("cpu"))
    finally:
        gc.enable()
        dist.destroy_process_group()


def test_oom_at_micro_batch_1_gives_up(tmp_path, cache):
    out = tmp_path / "run"
    proc = train_here(out, cache, *STEPS, "data.batch_size=1", "faults.oom_at_step=3", check=False)
    assert proc.returncode == 3
    assert "step 3: out of memory at micro-batch 1" in proc.stderr


def test_an_out_of_memory_under_cuda_graphs_gives_up_instead_of_splitting(tmp_path, cache, monkeypatch):
    # A split's micro-batches would accumulate gradients over CUDA graph replays, each writing over
    # the last one's (loop/compiler.py): exit 3 naming the mode, no split.
    import loop.trainer

    monkeypatch.setattr(loop.trainer, "cuda_graphs", lambda cfg, device: "train.compile_mode=reduce-overhead")  # the CPU as CUDA
    proc = train_here(tmp_path / "run", cache, *STEPS, "train.grad_accum=1", "faults.oom_at_step=2", check=False)
    assert proc.returncode == 3 and "train.compile_mode=reduce-overhead" in proc.stderr, proc.stderr
    assert "micro-batch 4 -> 2" not in proc.stderr


def test_a_resume_under_cuda_graphs_of_a_run_that_split_its_micro_batch_is_bad_input(tmp_path, cache, monkeypatch):
    # The checkpoint's run ran out of memory and trains data.batch_size 8 in micro-batches of 4
    # (Progress.micro_split, kept by a resume at the same size): resumed under CUDA graphs, that
    # is the accumulation check_cuda_graphs refuses, so exit 2 before a step, not wrong gradients.
    import loop.trainer

    out, args = tmp_path / "run", ["data.batch_size=8", "train.grad_accum=1"]
    train_here(out, cache, "train.max_steps=5", "train.ckpt_every=5", *args, "faults.oom_at_step=3")
    assert state(out, 5)["progress"]["micro_split"] == 2
    monkeypatch.setattr(loop.trainer, "cuda_graphs", lambda cfg, device: "train.compile_mode=reduce-overhead")  # the CPU as CUDA
    proc = train_here(out, cache, "train.max_steps=7", "train.ckpt_every=7", *args, check=False)
    assert proc.returncode == 2 and "train.compile_mode=reduce-overhead" in proc.stderr, proc.stderr
    assert "2 micro-batches of 4" in proc.stderr
    assert [r["step"] for r in metrics(out)][-1] == 5


def test_oom_policy_abort(tmp_path, cache):
    proc = train_here(tmp_path / "run", cache, *STEPS, "train.oom_policy=abort",
                     "faults.oom_at_step=2", check=False)
    assert proc.returncode == 3 and "train.oom_policy=abort" in proc.stderr


def test_a_resumed_run_gives_up_at_the_same_bad_step_as_the_uninterrupted_one(tmp_path, cache):
    # train.max_bad_steps counts non-finite steps in a row. A run stopped inside such a row (here
    # by its max_steps) resumes the count with the checkpoint: otherwise it trains on past the step
    # where the uninterrupted run gives up.
    import re

    from loop.progress import Progress

    diverge = [cache, "optim.lr=1e30", "schedule.warmup_steps=0", "train.clip_grad=0",
               "train.ckpt_every=100", "train.max_bad_steps=3"]
    ref = train_here(tmp_path / "ref", *diverge, "train.max_steps=30", check=False)
    assert ref.returncode == 3, ref.stderr
    gave_up = re.search(r"error: step (\d+): non-finite", ref.stderr).group(1)
    first_bad = int(re.search(r"warning: step (\d+): non-finite", ref.stderr).group(1))
    out = tmp_path / "run"
    train_here(out, *diverge, f"train.max_steps={first_bad + 1}")  # ends two bad steps into the row
    rerun = train_here(out, *diverge, "train.max_steps=30", check=False)
    assert rerun.returncode == 3 and f"error: step {gave_up}: non-finite" in rerun.stderr, rerun.stderr
    p = Progress()  # a checkpoint without the count: no row under way
    p.load_state_dict({k: v for k, v in Progress(bad_streak=2).state_dict().items() if k != "bad_streak"})
    assert p.bad_streak == 0



def test_a_checkpoint_without_the_row_of_bad_steps_loads_with_none_under_way():
    # Checkpoints written before the row was counted hold neither bad_streak nor last_bad.
    from loop.progress import Progress

    p = Progress()
    p.load_state_dict({k: v for k, v in Progress(bad_streak=2, last_bad=7).state_dict().items()
                       if k not in ("bad_streak", "last_bad")})
    assert (p.bad_streak, p.last_bad) == (0, 0)


def test_out_of_memory_outside_the_forward_and_backward_gives_up_with_exit_3(tmp_path, cache, monkeypatch):
    # AdamW's first step makes its two moments (twice the weights): a model whose forward and
    # backward fit can run out there, where no smaller micro-batch retries it. Exit 3 in one line
    # (docs/failures.md), not a traceback.
    from loop import optim

    def step(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(optim.AdamW, "step", step)
    proc = train_here(tmp_path / "run", cache, *STEPS, check=False)
    assert proc.returncode == 3 and "error: out of memory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("ema", [False, True])
def test_one_host_read_per_optimizer_step(tmp_path, monkeypatch, ema):
    """Count every tensor -> Python conversion during three steps of 4 micro-batches each."""
    from types import SimpleNamespace

    from conftest import build_data, build_model, load_config
    from loop.data.sampler import train_loader
    from loop.ema import EMA
    from loop.optim import build_optimizer
    from loop.schedule import build_scheduler
    from loop.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "data.name=markov", f"data.cache_dir={tmp_path / 'cache'}", "data.markov.tokens=4000",
        "data.seq_len=16", "data.batch_size=2", "train.grad_accum=4", "model.n_layer=1",
        "model.n_embd=16", "model.n_head=2", f"run.out_dir={tmp_path / 'run'}", f"ema.enabled={ema}"])
    cpu = torch.device("cpu")
    data = build_data(cfg.data)
    model = build_model(cfg.model, data)
    opt = build_optimizer(model, cfg.optim, cpu)
    trainer = Trainer(cfg, model, data, opt, build_scheduler(opt, cfg.schedule, 10),
                      Precision("fp32", cpu), cpu, ema=EMA(model, 0.999, 10) if ema else None)
    trainer.log = SimpleNamespace(record=lambda *a: None)
    loader = train_loader(data.train, 2, 0, 0, 0, 2, False)
    trainer.feed.batches = iter([b for b, _ in zip(loader, range(12))])  # loaded before counting
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            caller = sys._getframe(1).f_code.co_filename
            reads.append("ema" if caller.endswith("ema.py") else _name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(3):
        trainer.step()
    monkeypatch.undo()
    assert trainer.progress.step == 3
    # Ours: the finite check, once per optimizer step. With EMA, loop/ema.py::EMA.update also reads
    # its update counter (is this the first average?); that counter lives in host memory, so on
    # a GPU this is a host read, not a device sync.
    assert reads == ["tolist", *(["ema"] if ema else [])] * 3, reads


@pytest.mark.slow
def test_determinism_mode_gives_identical_runs(tmp_path, cache):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run_train(out, cache, "train.max_steps=10", "run.deterministic=true")
    assert [r["loss"] for r in metrics(a)] == [r["loss"] for r in metrics(b)]
    assert summary(a)["params_sha256"] == summary(b)["params_sha256"]
    det = json.loads((a / "metadata.json").read_text())["determinism"]
    assert det["deterministic"] and det["cublas_workspace_config"] == ":4096:8"
    assert det["sdpa_kernels"] == ["flash", "efficient", "math"]  # the fused ones stay, cuDNN's goes


def test_determinism_mode_ends_with_its_run(tmp_path, cache, monkeypatch):
    # Its switches are the process's: left on, train.main called again in one process (a
    # notebook) with the mode off would run with it still on (no cuDNN attention; an op without a
    # deterministic kernel an error). What was in effect before is put back, whatever
    # it was.
    import train
    from conftest import TINY
    from loop import determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cuda = torch.backends.cuda
    before = determinism.in_effect()
    assert not before["deterministic"] and "cudnn" in before["sdpa_kernels"]
    args = [*TINY, cache, "train.max_steps=2", "run.deterministic=true"]
    assert train.main([*args, f"run.out_dir={tmp_path / 'a'}"]) == 0
    assert json.loads((tmp_path / "a" / "metadata.json").read_text())["determinism"]["deterministic"]
    assert determinism.in_effect() == before and cuda.cudnn_sdp_enabled()
    cuda.enable_cudnn_sdp(False)  # settings of the caller's own: kept
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True
    try:
        assert train.main([*args, f"run.out_dir={tmp_path / 'b'}"]) == 0
        assert not cuda.cudnn_sdp_enabled() and cuda.mem_efficient_sdp_enabled()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.benchmark
    finally:
        cuda.enable_cudnn_sdp(True)
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = False


@pytest.mark.parametrize("workspace", [":4096:8", ":16:8"])
def test_determinism_mode_takes_either_cublas_workspace_and_turns_cudnn_s_choices_off(monkeypatch, workspace):
    # Both workspaces cuBLAS documents as deterministic are taken (:16:8 uses less memory), and
    # cuDNN's autotuner is off in the mode: it may pick another kernel from one run to the next.
    from loop import determinism

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspace)
    torch.backends.cudnn.benchmark = True  # the caller's, put back after
    try:
        restore = determinism.enable()
        try:
            assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, True)
            assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
            assert determinism.in_effect()["cublas_workspace_config"] == workspace
        finally:
            restore()
        assert torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.backends.cudnn.benchmark = False


def test_determinism_mode_puts_the_compiler_in_its_deterministic_mode_and_back(monkeypatch):
    # torch's flag turns inductor's own deterministic mode on: kernels chosen without timing them where
    # the choice changes the numbers, so a cold compile cache builds a warm one's kernels. The mode is
    # put back as it was (TORCHINDUCTOR_DETERMINISTIC=1 set it, whatever torch's flag), and a run that
    # asks the compiler to leave it off is exit 2 naming the key, before anything is built.
    from torch._inductor import config as inductor

    from conftest import build_trainer
    from loop import determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    process = inductor.deterministic  # not monkeypatch: its undo would delete the option, hiding it
    try:
        for before in (False, True):
            inductor.deterministic = before
            restore = determinism.enable()
            try:
                assert inductor.deterministic
            finally:
                restore()
            assert inductor.deterministic is before and not torch.are_deterministic_algorithms_enabled()
    finally:
        inductor.deterministic = process
    off = ["train.compile=true", "train.compile_options.deterministic=false", "train.device=cpu"]
    cfg = load_config(DEFAULT, [*off, "run.deterministic=true"])
    with pytest.raises(BadInput, match=r"train\.compile_options\.deterministic=false.*run\.deterministic=true"):
        build_trainer(cfg, Dist(), torch.device("cpu"))
    build = load_config(DEFAULT, off)  # without run.deterministic: the run's choice
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)
    build_trainer(build, Dist(), torch.device("cpu"))


def test_faults_are_recorded_in_metadata(tmp_path, cache):
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=3", "faults.nan_at_step=2")
    assert json.loads((out / "metadata.json").read_text())["faults_injected"] == {"nan_at_step": 2}


def test_a_fault_aimed_at_a_rank_the_run_does_not_have_is_bad_input(tmp_path, cache):
    # It would never fire: a fire drill that "passes" because nothing happens. Exit 2, nothing
    # written.
    out = tmp_path / "run"
    proc = train_here(out, cache, *STEPS, "faults.nan_at_step=2", "faults.nan_rank=1", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.endswith("error: config key faults.nan_rank: rank 1, but this run has 1 "
                                "process(es); expected -1 (every rank) or a rank below 1.\n"), proc.stderr
    assert not out.exists()
    cfg = load_config(DEFAULT, ["faults.oom_rank=1"])
    check_with_world(cfg, Dist(rank=0, world=2))  # rank 1 of 2: fine
    with pytest.raises(BadInput, match="faults.oom_rank: rank 2, but this run has 2 process"):
        check_with_world(load_config(DEFAULT, ["faults.oom_rank=2"]), Dist(rank=0, world=2))


def test_a_fault_at_a_step_the_run_does_not_reach_says_it_will_not_fire():
    # A note, not an error: a later run may raise train.max_steps and reach it.
    cfg = load_config(DEFAULT, ["train.max_steps=10", "faults.nan_at_step=11", "faults.oom_at_step=0",
                                "faults.kill_in_ckpt_at_step=10", "schedule.warmup_steps=5"])
    steps = "will not fire: this run's steps are 1 to train.max_steps=10"
    assert idle_settings(cfg, Precision("fp32", torch.device("cpu"))) == [
        f"faults.nan_at_step=11 {steps}", f"faults.oom_at_step=0 {steps}"]


@pytest.mark.parametrize("step, every, when", [
    (7, 4, ""), (5, 4, " its evaluation is a new best or"), (8, 4, None), (10, 4, None),
    (8, 0, ""), (10, 0, None)])
def test_a_kill_in_a_checkpoint_at_a_step_that_writes_none_says_so(step, every, when):
    # faults.kill_in_ckpt_at_step=7 with checkpoints every 4 steps of 10 does nothing: said, not
    # left as a fire drill that passes because nothing happens. Steps 8 (a multiple) and 10 (the
    # last) save; with train.ckpt_every=0 only the last does (0 does not make every step a
    # multiple).
    cfg = load_config(DEFAULT, ["train.max_steps=10", f"train.ckpt_every={every}", "train.eval_every=5",
                                f"faults.kill_in_ckpt_at_step={step}", "schedule.warmup_steps=5"])
    notes = idle_settings(cfg, Precision("fp32", torch.device("cpu")))
    which = (f"is neither a multiple of train.ckpt_every={every} nor the last step" if every
             else "is not the last step (train.ckpt_every=0: at the end only)")
    assert notes == ([] if when is None else [
        f"faults.kill_in_ckpt_at_step={step} may not fire: step {step} {which}, so it writes a "
        f"checkpoint only if{when} the run stops there (early stopping, a preemption signal)"])


def test_a_kill_in_a_checkpoint_fires_in_that_step_s_checkpoint_only(monkeypatch):
    # faults.kill_in_ckpt_at_step=7 in a run that saves at 4 and 8: no kill at 8, as the note says.
    import signal

    from loop.guards import faults

    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    kill = faults.kill_midway(7)
    for step in (4, 8, 12):
        kill(step)
    assert sent == []
    kill(7)
    assert sent == [signal.SIGKILL] and faults.kill_midway(-1) is None


def test_allocator_gets_expandable_segments_in_both_spellings(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert oom.configure_allocator() == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # the user's choice stays
    assert oom.configure_allocator() == "expandable_segments:False"


def test_activation_checkpointing_needs_the_model_s_own_switch():
    # On a model without one it would silently do nothing (and an out-of-memory message would
    # advise it to every model): refused, naming the key and the method; the GPT's is switched on.
    from types import SimpleNamespace

    from conftest import build_model, model_options, token_data
    from loop.errors import BadInput

    images = SimpleNamespace(train=[{"x": torch.zeros(1, 8, 8)}], vocab_size=10, seq_len=1)
    with pytest.raises(BadInput) as e:
        build_model(model_options("cnn", activation_checkpointing=True), images)
    assert str(e.value).startswith("config key model.activation_checkpointing=true: model.name=cnn has no "
                                   "switch for it; expected a method set_activation_checkpointing(on)")
    gpt = build_model(model_options("gpt", activation_checkpointing=True, n_layer=1, n_head=1, n_embd=8),
                      token_data(8, 4))
    assert gpt.activation_checkpointing


def test_an_early_stop_or_a_warmup_the_run_cannot_reach_says_so():
    # Said, not accepted without a word: a patience of 1 with one evaluation in the run never stops
    # it, and a warmup of 1000 steps in a 3-step run trains at a thousandth of optim.lr.
    fp32 = Precision("fp32", torch.device("cpu"))
    cfg = load_config(DEFAULT, ["train.max_steps=30", "train.eval_every=10", "train.early_stop_patience=3",
                                "schedule.warmup_steps=40"])
    assert idle_settings(cfg, fp32) == [
        "train.early_stop_patience=3 cannot stop this run: it evaluates 3 time(s) (train.eval_every=10 "
        "of train.max_steps=30), and stopping takes 3 after the first",
        "schedule.warmup_steps=40 is longer than train.max_steps=30: the learning rate never reaches "
        "optim.lr (the run ends at 75% of it)"]
    # Two evaluations after the first can stop it; a warmup as long as the run reaches the peak.
    cfg = load_config(DEFAULT, ["train.max_steps=30", "train.eval_every=10", "train.early_stop_patience=2",
                                "schedule.warmup_steps=30"])
    assert idle_settings(cfg, fp32) == []
