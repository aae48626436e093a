"""The benchmarks run end to end in CI-sized form (tiny model, a few steps) and write their record;
the figures themselves are machine-dependent and are not asserted, only their consistency."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from fake_mnist import write_fake_mnist

from bench import attention, ckpt_stall, loop_vs_bare
from bench.common import command
from conftest import ROOT, TINY, build_trainer, load_config
from loop.checkpoint import store
from loop.config.load import DEFAULT_CONFIG
from loop.distributed.group import Dist
from loop.errors import BadInput
from loop.observe.metrics import NullLog


@pytest.mark.slow
def test_loop_vs_bare_runs_and_records(tmp_path, cache, capsys):
    results = tmp_path / "r.jsonl"
    args = ["--steps", "4", "--warmup", "2", "--reps", "2", "--results", str(results),
            "--variant", "model.activation_checkpointing=true model.dropout=0 data.batch_size=2",  # 1 arm
            *[t for t in TINY if "log_every" not in t], cache,
            f"run.mirror={tmp_path / 'bucket'}"]  # a config that mirrors a real run's checkpoints
    assert loop_vs_bare.main(args) == 0
    assert not (tmp_path / "bucket").exists()  # its runs' pruning deleted the real run's there
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["command"] == " ".join(["python -m bench.loop_vs_bare", *args])
    arms = ["scaffold", "bare", "model.activation_checkpointing=true model.dropout=0 data.batch_size=2"]
    # Each repetition runs every arm, the order reversed every other one: drift hits them alike.
    ran = re.findall(r"^rep (\d)/2 (.+):", capsys.readouterr().out, re.M)
    assert ran == [("1", a) for a in arms] + [("2", a) for a in arms[::-1]]
    med = record["median"]
    assert set(med) == set(arms)
    for arm, m in med.items():
        assert m["tokens_per_s"] > 0 and 0.05 < m["max_rss_gb"] < 20  # Linux's ru_maxrss is in kB
        assert record["ratio_to_bare"][arm] == pytest.approx(m["tokens_per_s"] / med["bare"]["tokens_per_s"])
        (one, bare), (two, bare2) = [(r["tokens_per_s"], b["tokens_per_s"])
                                     for r, b in zip(record["runs"][arm], record["runs"]["bare"])]
        # The median of two: their mean. Pairs each repetition's arm with its own bare run.
        assert record["paired_ratio_to_bare"][arm] == pytest.approx((one / bare + two / bare2) / 2)
    assert med["bare"]["data_wait_pct"] == 0 and 0 <= med["scaffold"]["data_wait_pct"] < 100
    # The micro-batch each arm trained at: TINY's 4, and the variant's own 2.
    assert [m["micro_batch"] for m in med.values()] == [4, 4, 2]
    assert all(m["warmup_s"] > 0 for m in med.values())


FIGURES = {"tokens_per_s": 100.0, "data_wait_pct": 0.0, "micro_batch": 4, "max_rss_gb": 0.1, "warmup_s": 1.0}


def fail_one_arm(monkeypatch, failing: str) -> None:
    """Every arm gives FIGURES at once but `failing`, which runs for real on a config that is not
    there: its process exits 2, as a run that fails after the bench's own checks passed."""
    real = loop_vs_bare.run_arm

    def run_arm(arm, name, extra, args, workdir):
        if arm == failing:
            return real(arm, name, extra, argparse.Namespace(**{**vars(args), "config": "gone.yaml"}), workdir)
        return dict(FIGURES)

    monkeypatch.setattr(loop_vs_bare, "run_arm", run_arm)


def test_a_failed_variant_is_reported_and_the_other_arms_run_on(tmp_path, monkeypatch, capsys, cache):
    # One variant's exit 2 must not lose the figures of the arms that ran, nor the arms still to run:
    # on a rented GPU both cost minutes.
    monkeypatch.chdir(tmp_path)  # the work directory goes under ./runs
    fail_one_arm(monkeypatch, "model.dropout=0")
    results = tmp_path / "r.jsonl"
    code = loop_vs_bare.main(["--reps", "2", "--config", str(ROOT / DEFAULT_CONFIG), "--results", str(results),
                              "--variant", "model.dropout=0", "--variant", "train.clip_grad=0.5", *TINY, cache])
    out, err = capsys.readouterr()
    assert code == 1
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["failed"] == {"model.dropout=0": 2}
    assert set(record["median"]) == set(record["runs"]) == {"scaffold", "bare", "train.clip_grad=0.5"}
    # Not run again in the second repetition; the arm after it ran in both.
    assert re.findall(r"^rep (\d)/2 (.+?):", out, re.M) == [
        ("1", "scaffold"), ("1", "bare"), ("1", "train.clip_grad=0.5"),
        ("2", "train.clip_grad=0.5"), ("2", "bare"), ("2", "scaffold")]
    # Named with its exit code and its log's end (the error it stopped at), once: a failure repeats.
    assert err.count("model.dropout=0: failed (exit 2)") == 1 and "cannot read it" in err
    (log,) = (tmp_path / "runs").iterdir()  # its log stays, nothing else
    assert log.name.endswith("-variant1.log") and "cannot read it" in log.read_text()
    (below,) = [line for line in out.splitlines() if line.startswith("failed: ")]  # under the table
    assert "model.dropout=0 (exit 2)" in below and str(log.relative_to(tmp_path)) in below
    assert "0 of its 2 runs" in below  # none of its figures are in the table


@pytest.mark.parametrize("failing", ["scaffold", "bare"])
def test_a_failed_scaffold_or_bare_arm_stops_the_run_without_a_record(tmp_path, monkeypatch, capsys, cache,
                                                                      failing):
    # Every ratio is to the bare arm, and the scaffold's is the one measured: without either there
    # are no figures to record, and the arms still to run would be time for nothing.
    monkeypatch.chdir(tmp_path)
    fail_one_arm(monkeypatch, failing)
    results = tmp_path / "r.jsonl"
    code = loop_vs_bare.main(["--reps", "2", "--config", str(ROOT / DEFAULT_CONFIG), "--results", str(results),
                              "--variant", "model.dropout=0", *TINY, cache])
    out, err = capsys.readouterr()
    assert code == 1 and not results.exists()
    assert re.findall(r"^rep (\d)/2 (.+?):", out, re.M) == ([] if failing == "scaffold" else [("1", "scaffold")])
    assert f"{failing}: failed (exit 2)" in err and "cannot read it" in err
    (log,) = (tmp_path / "runs").iterdir()
    assert log.name.endswith(f"-{failing}.log") and str(log.relative_to(tmp_path)) in err


def test_a_bare_arm_that_fails_in_a_later_repetition_keeps_the_ones_before(tmp_path, monkeypatch, capsys):
    # A whole repetition of every arm is figures paid for (minutes on a GPU): they make the table
    # and the record; the run stops at the failure, whose arm the record names.
    monkeypatch.chdir(tmp_path)
    calls = []

    def run_arm(arm, name, extra, args, workdir):
        calls.append(arm)
        if calls.count("bare") == 2:
            log = workdir / f"{name}.log"
            # A long log: the error it ended at is its last lines, not its first.
            log.write_text("".join(f"step {n}\n" for n in range(100)) +
                           "Traceback ...\nRuntimeError: CUDA error: an illegal memory access\n")
            raise loop_vs_bare.ArmFailed(arm, 1, log, ["python", "-m", "bench.loop_vs_bare", "--bare"])
        return dict(FIGURES)

    monkeypatch.setattr(loop_vs_bare, "run_arm", run_arm)
    results = tmp_path / "r.jsonl"
    code = loop_vs_bare.main(["--reps", "3", "--config", str(ROOT / DEFAULT_CONFIG), "--results", str(results),
                              "--variant", "model.dropout=0"])
    assert code == 1
    assert calls == ["scaffold", "bare", "model.dropout=0", "model.dropout=0", "bare"]  # rep 2 reversed
    record = json.loads(results.read_text())
    assert record["failed"] == {"bare": 1}
    assert [len(record["runs"][a]) for a in ("scaffold", "bare", "model.dropout=0")] == [1, 1, 2]
    err = capsys.readouterr().err
    assert "illegal memory access" in err and "step 0\n" not in err


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_bench_keeps_the_arms_that_finished(tmp_path, monkeypatch, capsys, cache, how):
    # A GPU lease's time limit (SIGTERM from `timeout`) or Ctrl-C during a slow arm (a compile mode
    # that autotunes for minutes): the scaffold and bare figures already measured make the table and
    # the record, which names the arm stopped; exit 130. SIGTERM's own handler is back after.
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)

    def run_arm(arm, name, extra, args, workdir):
        if arm != "train.compile_mode=reduce-overhead":
            return dict(FIGURES)
        if how == "ctrl-c":
            raise KeyboardInterrupt  # as run_arm raises it, once it has killed its arm
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the arm would run on: the signal must end the wait

    monkeypatch.setattr(loop_vs_bare, "run_arm", run_arm)
    results = tmp_path / "r.jsonl"
    t0 = time.monotonic()
    assert loop_vs_bare.main(["--reps", "2", "--results", str(results), "--variant",
                              "train.compile_mode=reduce-overhead", *TINY, cache]) == 130
    assert time.monotonic() - t0 < 20 and signal.getsignal(signal.SIGTERM) == before
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert set(record["median"]) == {"scaffold", "bare"}
    assert record["interrupted"] == "train.compile_mode=reduce-overhead in rep 1/2"
    assert "interrupted: train.compile_mode=reduce-overhead in rep 1/2" in capsys.readouterr().out


def test_a_bench_interrupted_before_bare_finished_writes_no_record(tmp_path, monkeypatch, capsys, cache):
    monkeypatch.chdir(tmp_path)

    def run_arm(arm, name, extra, args, workdir):
        if arm == "bare":
            raise KeyboardInterrupt
        return dict(FIGURES)

    monkeypatch.setattr(loop_vs_bare, "run_arm", run_arm)
    results = tmp_path / "r.jsonl"
    assert loop_vs_bare.main(["--reps", "1", "--results", str(results), *TINY, cache]) == 130
    assert not results.exists() and "the bare arm did not finish its first run" in capsys.readouterr().err
    assert not list((tmp_path / "runs").iterdir())  # the work directory goes too


def test_an_interrupted_bench_stops_the_arm_it_was_running(tmp_path, monkeypatch):
    # Ctrl-C (or a time limit's signal) reaches the bench: the arm's process, a GPU run, must not
    # train on behind it.
    started, real = [], subprocess.Popen

    def popen(cmd, **kw):
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    def interrupted(pid, options):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_vs_bare.subprocess, "Popen", popen)
    monkeypatch.setattr(loop_vs_bare.os, "wait4", interrupted)
    args = argparse.Namespace(warmup=1, steps=1, config="c.yaml", overrides=[])
    with pytest.raises(KeyboardInterrupt):
        loop_vs_bare.run_arm("bare", "bare", [], args, tmp_path)
    assert started[0].poll() == -signal.SIGKILL  # killed, not left to run its course, and reaped


def test_an_arm_killed_by_a_signal_is_a_failed_arm(tmp_path, monkeypatch):
    # The kernel's out-of-memory killer or a crash in a CUDA library ends an arm by a signal (a
    # negative exit code): a failure like any other, reported with its log, not figures read from
    # a run that never finished.
    real = subprocess.Popen

    def popen(cmd, **kw):
        return real([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], **kw)

    monkeypatch.setattr(loop_vs_bare.subprocess, "Popen", popen)
    args = argparse.Namespace(warmup=1, steps=1, config="c.yaml", overrides=[])
    for arm in ("bare", "scaffold"):
        with pytest.raises(loop_vs_bare.ArmFailed) as e:
            loop_vs_bare.run_arm(arm, arm, [], args, tmp_path)
        assert e.value.code == -signal.SIGKILL and e.value.log == tmp_path / f"{arm}.log"


def test_a_variant_s_names_in_capitals_go_to_its_environment(tmp_path, monkeypatch, capsys, cache):
    # A compiler setting with no config key (TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1) is a lever
    # measured as an arm: NAME=VALUE with NAME in capitals is set in that arm's environment only,
    # and is not a config override (which train.py would refuse as an unknown key).
    monkeypatch.delenv("BENCH_KNOB", raising=False)
    real = subprocess.Popen

    def popen(cmd, **kw):  # the arm's process says what it got, then fails (no figures to read)
        code = "import os, sys; print(os.environ.get('BENCH_KNOB'), sys.argv[1:]); sys.exit(3)"
        return real([sys.executable, "-c", code, *cmd[1:]], **kw)

    monkeypatch.setattr(loop_vs_bare.subprocess, "Popen", popen)
    args = argparse.Namespace(warmup=1, steps=1, config="c.yaml", overrides=[])
    for arm, extra, knob in (("variant", ["BENCH_KNOB=a=b", "model.dropout=0"], "a=b"),
                             ("scaffold", [], "None"), ("bare", [], "None")):
        with pytest.raises(loop_vs_bare.ArmFailed) as e:
            loop_vs_bare.run_arm(arm, arm, extra, args, tmp_path)
        said = e.value.log.read_text()
        assert said.split()[0] == knob and "BENCH_KNOB" not in said.split(" ", 1)[1]
        assert ("model.dropout=0" in said) == bool(extra)
    monkeypatch.undo()
    # The bench's own check of every arm's config before the runs takes the overrides alone.
    monkeypatch.chdir(tmp_path)
    fail_one_arm(monkeypatch, "no arm")
    results = tmp_path / "r.jsonl"
    variant = "BENCH_KNOB=1 model.dropout=0"
    assert loop_vs_bare.main(["--reps", "1", "--results", str(results), "--variant", variant, *TINY, cache]) == 0
    assert set(json.loads(results.read_text())["median"]) == {"scaffold", "bare", variant}


def test_only_a_whole_name_in_capitals_is_a_variant_s_environment_variable():
    # Config keys are dotted and in lower case: anything else that is not NAME=VALUE with NAME all
    # capitals (a key missing its dot, a key written with a capital) stays an override, which
    # train.py refuses by name, not an environment variable no one reads. Every capital name counts,
    # wherever it stands in the variant.
    overrides, env = loop_vs_bare.split_variant(["model.dropout=0", "TORCHINDUCTOR_X=1", "dropout=0",
                                                 "Model.dropout=0", "A_B2=x=y"])
    assert (overrides, env) == (["model.dropout=0", "dropout=0", "Model.dropout=0"],
                                {"TORCHINDUCTOR_X": "1", "A_B2": "x=y"})


def test_a_variant_s_environment_wins_over_the_same_name_in_the_shell_s(tmp_path, monkeypatch):
    # An arm measuring TORCHINDUCTOR_X=1 from a shell that exported TORCHINDUCTOR_X=0 runs with 1:
    # else the arm measures the shell's setting under the variant's name. The other arms keep the
    # shell's.
    monkeypatch.setenv("BENCH_KNOB", "shell")
    real = subprocess.Popen

    def popen(cmd, **kw):  # the arm's process says what it got, then fails (no figures to read)
        return real([sys.executable, "-c", "import os, sys; print(os.environ['BENCH_KNOB']); sys.exit(3)"], **kw)

    monkeypatch.setattr(loop_vs_bare.subprocess, "Popen", popen)
    args = argparse.Namespace(warmup=1, steps=1, config="c.yaml", overrides=[])
    for arm, extra, knob in (("variant", ["BENCH_KNOB=arm"], "arm"), ("scaffold", [], "shell")):
        with pytest.raises(loop_vs_bare.ArmFailed) as e:
            loop_vs_bare.run_arm(arm, arm, extra, args, tmp_path)
        assert e.value.log.read_text().split() == [knob]
    # A PYTHONPATH in a variant is the arm's too, after the scaffold's own root.
    popen_said = "import os, sys; print(os.environ['PYTHONPATH']); sys.exit(3)"
    monkeypatch.setattr(loop_vs_bare.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", popen_said],
                                                                                 **kw))
    with pytest.raises(loop_vs_bare.ArmFailed) as e:
        loop_vs_bare.run_arm("variant", "variant", ["PYTHONPATH=/my/lib"], args, tmp_path)
    assert e.value.log.read_text().split()[0].split(os.pathsep) == [str(loop_vs_bare.ROOT), "/my/lib"]


def test_a_variant_with_a_path_in_it_has_a_log_file_of_its_own(tmp_path, monkeypatch, capsys, cache):
    # An arm's files are named by its place among the arms: an override's value may be a path, whose
    # '/' would make the log's path a directory that is not there.
    monkeypatch.chdir(tmp_path)
    variant = f"data.cache_dir={tmp_path}"
    fail_one_arm(monkeypatch, variant)
    results = tmp_path / "r.jsonl"
    assert loop_vs_bare.main(["--reps", "1", "--config", str(ROOT / DEFAULT_CONFIG), "--results", str(results),
                              "--variant", variant, *TINY, cache]) == 1
    (log,) = (tmp_path / "runs").iterdir()
    assert "cannot read it" in log.read_text() and str(log.relative_to(tmp_path)) in capsys.readouterr().out
    assert json.loads(results.read_text())["failed"] == {variant: 2}


def test_scaffold_figures_use_only_the_timed_window():
    # Intervals of 2 steps: 10 ms/step while warming up, then 20 ms/step; 100 tokens a step.
    # On a GPU the interval's last record also has MFU (of that interval) and the peak memory so far.
    # 2 samples a step; the last interval's targets fewer (-100): MFU follows samples, not targets.
    recs = [{"step": s, "tokens": 100 * s, "samples": 2 * s, "data_ms": 1.0, "micro_batch": 8 if s < 6 else 4,
             **({"ms_per_step": 10.0 if s <= 2 else 20.0, "cuda_max_alloc_gb": s / 10,
                 "tokens_per_s": (50 if s == 6 else 100) / (0.010 if s <= 2 else 0.016 if s == 6 else 0.020),
                 "samples_per_s": 2 / (0.010 if s <= 2 else 0.016 if s == 6 else 0.020),
                 "mfu": 0.3} if s % 2 == 0 else {})} for s in range(1, 7)]
    fig = loop_vs_bare.scaffold_figures(recs, warmup=2, steps=4, every=2)
    assert fig["tokens_per_s"] == pytest.approx(400 / 0.080)  # 4 steps x 20 ms
    assert fig["data_wait_pct"] == pytest.approx(100 * 4.0 / 80.0)
    assert fig["mfu"] == pytest.approx(0.3 * 0.016 / 0.020)  # the last interval's, at the window's rate
    assert fig["peak_gb"] == 0.6
    assert fig["micro_batch"] == 4  # where the window ended: the arm trained at less than it asked
    assert fig["warmup_s"] == pytest.approx(0.020)  # the warm-up's one interval: 2 steps x 10 ms
    # --warmup 0 (allowed): the window starts at step 0, which has no record (it must not be looked
    # up: a KeyError after every arm had run). One interval of 6 steps, its mean ms/step on its
    # last record.
    fig = loop_vs_bare.scaffold_figures(recs, warmup=0, steps=6, every=6)
    assert fig["tokens_per_s"] == pytest.approx(600 / 0.120) and fig["warmup_s"] == 0


@pytest.mark.slow
def test_ckpt_stall_runs_and_records(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its saves go under ./runs
    save = store.save

    def slow_save(*args, **kwargs):  # a slow disk: steps go on beside the async write, several
        time.sleep(0.5)
        return save(*args, **kwargs)

    monkeypatch.setattr(store, "save", slow_save)
    results = tmp_path / "r.jsonl"
    config = str(ROOT / DEFAULT_CONFIG)
    assert ckpt_stall.main(["--reps", "2", "--config", config, "--results", str(results), *TINY, cache]) == 0
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    med = record["median_ms"]
    assert set(med) == {"sync", "async", "async_done", "beside_write", "without_write"}
    assert all(v > 0 for v in med.values()) and med["sync"] >= 500 and med["async"] < 500
    # Training goes on until the write is done, then as many steps without one; the slowdown per
    # checkpoint is the extra time of those steps (medians, rounded to 0.01 ms in the record).
    n = record["steps_beside_write"]
    assert n >= 2 and med["async_done"] >= 500
    assert record["slowdown_ms"] == pytest.approx((med["beside_write"] - med["without_write"]) * n,
                                                  abs=0.01 * n + 0.01)
    assert record["async_total_ms"] == pytest.approx(med["async"] + record["slowdown_ms"], abs=0.02)
    assert not list((tmp_path / "runs").iterdir())  # the checkpoints it wrote are gone


@pytest.mark.parametrize("main, args, named", [
    (loop_vs_bare.main, ["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (loop_vs_bare.main, ["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
    (loop_vs_bare.main, ["--reps", "0"], "--reps: expected an integer >= 1, got 0"),
    (ckpt_stall.main, ["--reps", "0"], "--reps: expected an integer >= 1, got 0"),
])
def test_counts_below_their_minimum_are_usage_errors(tmp_path, capsys, main, args, named):
    # Refused before any run: let through, they end in a ZeroDivisionError or StatisticsError
    # after all the runs.
    with pytest.raises(SystemExit) as e:
        main([*args, "--results", str(tmp_path / "r.jsonl")])
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("main, args, named", [
    (loop_vs_bare.main, ["--variant", "train.clip_grad=1 trian.x=1"], "unknown config key 'trian.x'"),
    (loop_vs_bare.main, ["--config", "nope.yaml"], "config file nope.yaml: cannot read it"),
    (ckpt_stall.main, ["model.n_layr=2"], "Did you mean 'model.n_layer'"),
    (loop_vs_bare.main, ["train.device=cuda:99"], "config key train.device"),  # a device not here
    (loop_vs_bare.main, ["--variant", "train.device=cuda:99"], "config key train.device"),
    (loop_vs_bare.main, ["--variant", "train.compile_options.no_such=true"], "train.compile_options.no_such"),
    (loop_vs_bare.main, ["train.compile_options.no_such=true"], "train.compile_options.no_such"),
])
def test_bad_config_input_is_one_line_and_exit_2(tmp_path, capsys, main, args, named):
    # One line and exit 2, before anything runs (a bad --variant too, not after the other arms),
    # not a BadInput traceback with exit 1.
    with pytest.raises(SystemExit) as e:
        command(lambda: main([*args, "--results", str(tmp_path / "r.jsonl")]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and named in err, err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("main", [loop_vs_bare.main, ckpt_stall.main])
def test_a_results_file_that_cannot_be_written_is_exit_2_before_the_runs(tmp_path, capsys, cache, main):
    # Found after the runs, it was a traceback that lost their figures.
    (tmp_path / "afile").write_text("")
    for results, named in ((tmp_path / "afile" / "r.jsonl", "--results"), (tmp_path, "a directory")):
        with pytest.raises(SystemExit) as e:
            command(lambda: main(["--reps", "1", "--results", str(results), *TINY, cache]))
        said = capsys.readouterr()
        assert e.value.code == 2 and said.err.startswith("error: ") and named in said.err, said.err
        assert "rep 1" not in said.out  # before any run


@pytest.mark.parametrize("more", [
    ["train.clip_grad=0.05"],  # small enough that every step clips
    ["train.clip_grad=0"],  # no clipping (not a clip to 0, which zeroes the gradients)
    ["train.precision=bf16", "train.grad_accum=1"],
    ["train.precision=fp16"],  # with its GradScaler
])
def test_the_bare_loop_trains_what_the_scaffold_trains(cache, more):
    # The ratio compares like with like only if the bare arm does the scaffold's maths: from the
    # same seed, over the same batches, its weights after two steps are the scaffold's, bit for bit
    # (dropout off: the bare loop does not seed per rank, and need not).
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, "model.dropout=0", "train.grad_accum=2",
                                       "train.max_steps=2", "schedule.warmup_steps=2", *more])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.log = NullLog()
    t.feed.start()
    steps = [t.feed.draw()[0] for _ in range(2)]
    t.feed.batches = iter([b for s in steps for b in s])
    loop = loop_vs_bare.Bare(cfg, cfg.train.max_steps)
    before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    assert same(before, t.raw.state_dict())
    for s in steps:
        assert t.step() and loop.step(s) == sum(b["n_targets"] for b in s)
    assert t.progress.overflows == 0  # fp16: an overflow holds back only the scaffold's schedule
    assert same(loop.model.state_dict(), t.raw.state_dict())
    assert not same(before, t.raw.state_dict())  # it trained


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_bare_loop_refuses_accumulation_under_cuda_graphs_as_the_scaffold_does(monkeypatch):
    # Its gradients would be written over by the next micro-batch's replay (loop/compiler.py).
    from loop import compiler

    monkeypatch.setattr(compiler, "cuda_graphs", lambda cfg, device: "train.compile_mode=reduce-overhead")
    cfg = load_config(DEFAULT_CONFIG, ["train.compile_mode=reduce-overhead", "train.grad_accum=2"])
    with pytest.raises(BadInput, match=r"train\.compile_mode=reduce-overhead replays CUDA graphs"):
        loop_vs_bare.Bare(cfg, 4)


def test_the_bare_loop_takes_a_model_that_returns_sums(tmp_path, cache):
    # The CNN returns {"loss", "accuracy"}: the bare arm must take the loss out of the dict, or
    # `make bench BENCH_CONFIG=configs/mnist.yaml` ends in a TypeError (dict / int).
    root = write_fake_mnist(tmp_path / "mnist", n_train=200, n_val=50, seed=0)
    fig = loop_vs_bare.bare(str(ROOT / "configs/mnist.yaml"), [f"data.path={root}", cache,
                            "model.cnn.channels=2", "model.cnn.hidden=8", "data.batch_size=4",
                            "train.device=cpu"], warmup=1, steps=2)
    assert fig["tokens_per_s"] > 0


def test_the_bare_loop_takes_a_dataset_smaller_than_its_two_steps(tmp_path, cache):
    # 2 steps x 4 micro-batches x 4 samples > the 28 training windows of this text: the scaffold's
    # sampler goes round again, and so must the bare arm, or it collates empty batches (IndexError).
    text = tmp_path / "small.txt"
    text.write_text("abcdefghij" * 100)
    fig = loop_vs_bare.bare(DEFAULT_CONFIG, [*TINY, f"data.path={text}", cache, "train.grad_accum=4"],
                            warmup=1, steps=2)
    assert fig["tokens_per_s"] > 0


def test_make_bench_gives_its_overrides_to_both_benchmarks():
    # Both benchmarks must measure the same model: BENCH_OVERRIDES goes to both, ARGS (its options)
    # to the first only, so `make bench ARGS="model.n_layer=8"` would measure the comparison on
    # that model and the checkpoint stall on the config's own.
    out = subprocess.run(["make", "-n", "bench", f"PYTHON={sys.executable}", "BENCH_OVERRIDES=model.n_layer=3",
                          "ARGS=--variant train.compile=true"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    commands = out.replace("\\\n", " ").splitlines()
    (vs_bare,) = [c.split() for c in commands if "bench.loop_vs_bare" in c]
    (stall,) = [c.split() for c in commands if "bench.ckpt_stall" in c]
    assert "model.n_layer=3" in vs_bare and "model.n_layer=3" in stall
    assert "--variant" in vs_bare and "--variant" not in stall


def test_the_scaffold_s_end_of_run_work_is_outside_the_timed_window(tmp_path, cache):
    # A run's last step evaluates (and checkpoints): with the window ending there, the last timed
    # interval would hold a validation pass that the bare arm never makes. So the run goes one
    # interval on.
    from argparse import Namespace

    args = Namespace(warmup=2, steps=4, config=DEFAULT_CONFIG,
                     overrides=[*[t for t in TINY if "log_every" not in t], cache])
    loop_vs_bare.run_arm("scaffold", "scaffold", [], args, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "scaffold" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [8] and records[-1]["step"] == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer on a machine without a GPU")
def test_the_attention_bench_needs_a_gpu_and_says_so(capsys):
    # It measures CUDA kernels only (tests/test_cuda.py proves the ones determinism mode keeps).
    assert attention.main([]) == 2
    assert "CUDA" in capsys.readouterr().err
