"""make verify (tools/verify.py) end to end: it passes on the default config, with a table that
names every check and its numbers; --nproc 2 compares 2 processes with 1; bad input exits 2 before
anything runs. tests/test_lab.py shows each check failing for the concern it guards."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY, run_train

VERIFY = [sys.executable, "-m", "tools.verify"]


def verify(tmp_path, *args: str, env=None) -> subprocess.CompletedProcess:
    """make verify into tmp_path / "verify runs": a path with a space, as many users' have."""
    return subprocess.run([*VERIFY, "--out", str(tmp_path / "verify runs"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """check -> (PASS|FAIL, numbers), from the printed table."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[1] in ("PASS", "FAIL"):
            out[parts[0]] = (parts[1], parts[2])
    return out


@pytest.mark.slow
def test_verify_passes_on_the_default_config(tmp_path, cache):
    # The default config (dropout 0.1, grad_accum 2) shrunk as in every end-to-end test; the full
    # size passes too (README: make verify, 95 s on 2 cores), but would take a minute here.
    proc = verify(tmp_path, "--steps", "12", *TINY, cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = rows(proc.stdout)
    assert list(table) == ["resume", "determinism", "accumulation", "clipping", "data", "eval"]
    assert all(result == "PASS" for result, _ in table.values()), proc.stdout
    assert "final checkpoint state identical" in table["resume"][1]
    assert "2 x 4 vs 1 x 8" in table["accumulation"][1]  # the config's own grad_accum and batch
    assert "targets per micro-batch [128, 32]" in table["accumulation"][1]  # unequal on purpose
    assert "96 sample ids over 12 steps" in table["data"][1]
    assert not (tmp_path / "verify runs").exists(), "runs, and the --out they made, go when every check passes"


@pytest.mark.slow
def test_verify_compares_two_processes_with_one(tmp_path, cache):
    proc = verify(tmp_path, "--nproc", "2", "--checks", "ddp", "--keep", *TINY, cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result, numbers = rows(proc.stdout)["ddp"]
    assert result == "PASS" and "2 processes x micro-batch 4 vs 1 x 8" in numbers, numbers
    assert "sample ids identical" in numbers
    assert "runs kept in" in proc.stdout


def test_bad_input_exits_2_and_runs_nothing(tmp_path, capsys):
    from tools.verify import main  # in this process: six interpreters would take 15 s to start

    for args, said in [(["model.n_layr=2"], "Did you mean 'model.n_layer'"),
                       (["--checks", "resume,speed"], "unknown check speed"),
                       (["--checks", "ddp"], "needs --nproc 2"),
                       (["--checks", ","], "--checks: empty; expected some of resume, "),
                       (["--steps", "3"], "at least 8"),
                       (["--kill-at", "20"], "--kill-at: expected a step after the first checkpoint "
                                             "(step 5) and before the last (20); got 20."),
                       (["--kill-at", "5"], "got 5."),
                       (["--kill-at", "0"], "got 0."),  # not taken for no --kill-at (a random step)
                       (["--nproc", "1"], "--nproc: expected 2 or more processes to compare with "
                                          "one; got 1."),  # not a silent run without the ddp check
                       # Refused up front, not by the 1-process runs with a FAIL row (exit 1):
                       (["--nproc", "2", "faults.nan_rank=1", "faults.nan_at_step=3"],
                        "config key faults.nan_rank: rank 1, but this run has 1 process(es)"),
                       (["--checks", "ddp", "--nproc", "2", "data.batch_size=auto", "train.global_batch=8"],
                        "config key data.batch_size=auto")]:  # its audits train at a given size
        code, err = main(["--out", str(tmp_path / "verify"), *args]), capsys.readouterr().err
        assert code == 2 and said in err, (args, err)
    proc = verify(tmp_path, "model.n_layr=2")  # and once as users run it: the exit code is 2
    assert proc.returncode == 2 and "Did you mean 'model.n_layer'" in proc.stderr, proc.stderr
    assert not list((tmp_path / "verify").glob("*")), "nothing is left behind"
    assert not (tmp_path / "verify runs").exists()
    code, err = main(["--out", str(tmp_path / "verify"), "--timeout", "0"]), capsys.readouterr().err
    assert code == 2 and "--timeout: expected a number of seconds > 0, got 0.0." in err, err
    # --out where a file is: exit 2 naming it, not a FileExistsError traceback with exit 1
    (tmp_path / "file").write_text("mine")
    code, err = main(["--out", str(tmp_path / "file" / "v")]), capsys.readouterr().err
    assert code == 2 and err == (f"error: option --out={tmp_path / 'file' / 'v'}: {tmp_path / 'file'} is "
                                 f"a file; expected a directory, or a path where one can be made.\n"), err
    assert (tmp_path / "file").read_text() == "mine"


def test_config_given_twice_is_refused_as_train_py_refuses_it(tmp_path, capsys):
    # Not the last one audited without a word: which config the table is about would be a guess.
    from tools.verify import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "verify"), "--config", "configs/mnist.yaml", "--config",
              "configs/default.yaml"])
    assert e.value.code == 2 and "--config: given twice" in capsys.readouterr().err
    assert not (tmp_path / "verify").exists()


def test_a_config_its_first_run_refuses_is_bad_input_not_a_fail(tmp_path, cache, capsys):
    # Exit 2 as the in-process checks give it (--checks accumulation), not a FAIL row and exit 1.
    from tools.verify import main

    code = main(["--out", str(tmp_path / "verify"), "--checks", "resume", cache, *TINY,
                 f"run.init_from={tmp_path / 'none.pt'}"])
    err = capsys.readouterr().err
    assert code == 2 and "error: " in err and "run.init_from" in err, err
    assert not list((tmp_path / "verify").glob("*")), "nothing is left behind"


def test_ctrl_c_stops_verify_and_its_run_with_exit_130(tmp_path, cache):
    proc = subprocess.Popen([*VERIFY, "--out", str(tmp_path / "verify"), "--checks", "determinism", cache,
                             *TINY, "train.max_steps=400"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert "verify: run A" in proc.stderr.readline()
    time.sleep(2)  # the run under way
    proc.send_signal(signal.SIGINT)  # to verify alone, as `kill -INT` sends it
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130 and "interrupted" in err and "Traceback" not in err, err
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "verify")], capture_output=True, text=True).stdout
    assert not left, f"a run outlived verify: {left}"


def test_ctrl_c_before_any_run_leaves_no_empty_directory_and_claims_no_runs_kept(tmp_path, capsys,
                                                                                  monkeypatch):
    # Ctrl-C in the in-process gradient audits, which come before the first run: nothing was run,
    # so the --out verify made goes, and the message names no runs kept.
    import tools.verify as verify_tool

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_tool, "gradient_audits", interrupted)
    out = tmp_path / "new" / "verify"
    code, err = verify_tool.main(["--out", str(out), *TINY]), capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "kept" not in err, err
    assert not (tmp_path / "new").exists()


def test_ctrl_c_while_a_job_is_watched_for_its_step_ends_it_and_its_watchdog_at_once(tmp_path):
    # The resume check's run R (jobs.run_until): the job trained on, and the watchdog thread kept
    # verify alive, until --timeout.
    job = f"import time  # {tmp_path}\nwhile True: print('step 1/9', flush=True); time.sleep(0.2)"
    watcher = f"from tools import jobs; import sys; jobs.run_until([sys.executable, '-c', {job!r}], 10**9, timeout=120)"
    proc = subprocess.Popen([sys.executable, "-c", watcher], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    time.sleep(3)  # both started
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert time.monotonic() - t0 < 10 and "KeyboardInterrupt" in proc.stderr.read()
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left, f"the job outlived its watcher: {left}"


def test_a_run_past_the_timeout_is_killed_and_fails_its_check(tmp_path, cache, capsys):
    # A hung run is killed and fails its check, not a subprocess.TimeoutExpired traceback that ends
    # verify (and, under torchrun, leaves the workers running). Here run A cannot even start within
    # 1 s: a FAIL row names it.
    from tools.verify import main

    code = main(["--out", str(tmp_path / "verify"), "--checks", "determinism", "--timeout", "1", cache, *TINY])
    out = capsys.readouterr().out
    assert code == 1 and rows(out)["determinism"] == (
        "FAIL", "run A did not finish within --timeout 1 s and was killed (A.log)"), out
    # Nothing was compared: the determinism check's usual cause (nondeterministic kernels) would
    # send the user the wrong way. The run's log is the lead, kept with the runs.
    assert "usual cause" not in out, out
    assert "runs kept in" in out and (next((tmp_path / "verify").iterdir()) / "A.log").exists()


@pytest.mark.slow
def test_the_resume_audit_kills_only_once_a_checkpoint_is_complete(tmp_path, cache, monkeypatch):
    # With train.async_save=true the checkpoint of step 2 may still be in flight when step 3 is
    # reported: a kill there would leave nothing to resume from, and the check would fail with "the
    # rerun did not resume from a checkpoint" on an honest config (as with a tiny model). A slow
    # disk makes that certain here; the kill waits for the checkpoint's `latest` pointer.
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs, jobs

    slow = str(ROOT / "tests" / "slow_save.py")
    train_cmd = jobs.train_cmd
    monkeypatch.setattr(jobs, "train_cmd", lambda args, *a: [train_cmd(args, *a)[0], slow, *args])
    plan = audit_runs.Plan(DEFAULT_CONFIG, [*TINY, cache, "train.async_save=true"], steps=10,
                           every=2, kill_at=3, nproc=0, root=tmp_path, timeout=300)
    assert audit_runs.run(plan, "A") is None
    result = audit_runs.resume(plan)
    assert result.ok, result
    killed, resumed = map(int, re.match(r"killed at step (\d+), resumed at step (\d+)", result.numbers).groups())
    assert killed > 3 and resumed in (2, 4), result.numbers  # 4's write may have ended before the kill


def test_a_job_past_its_timeout_is_killed_and_says_so():
    # Its SIGKILL is the watchdog's: a caller waiting to kill it at a step must not take it for its own.
    from tools import jobs

    hangs = [sys.executable, "-c", "import time; print('step 1/5', flush=True); time.sleep(60)"]
    start = time.monotonic()
    code, printed = jobs.run_until(hangs, 5, timeout=1)
    assert code == -signal.SIGKILL and printed == "step 1/5\n" + jobs.TIMED_OUT
    assert time.monotonic() - start < 30
    code, printed = jobs.run_until(hangs, 1, timeout=30)  # killed at its step: not timed out
    assert code == -signal.SIGKILL and printed == "step 1/5\n"


def test_a_job_process_that_ended_before_its_signal_is_passed_over(monkeypatch):
    # run_until lists a torchrun job's processes, then signals each: a worker that ended in
    # between (as in a 2-process kill at a run's end) is passed over, not a ProcessLookupError out
    # of run_until.
    from tools import jobs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process that has ended and been reaped
    monkeypatch.setattr(jobs, "descendants", lambda pid: [int(gone)])
    job = [sys.executable, "-c", "import time; print('step 1/9', flush=True); time.sleep(60)"]
    code, printed = jobs.run_until(job, 1, tree=True)
    assert code == -signal.SIGKILL and printed == "step 1/9\n"


def test_a_model_that_crashes_gives_its_traceback_and_leaves_no_empty_directory(tmp_path, cache, monkeypatch):
    # A bug in the model is a traceback, as train.py gives; the --out it made goes with it.
    from conftest import gpt_then
    from model import MODELS
    from tools.verify import main

    def crash(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setitem(MODELS, "gpt_crash", gpt_then(lambda m: setattr(m, "forward", crash) or m))
    out = tmp_path / "new" / "verify"
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        main(["--out", str(out), "--checks", "accumulation", "model.name=gpt_crash", cache, *TINY])
    assert not (tmp_path / "new").exists()


def test_a_model_kept_in_bf16_is_held_to_bf16_tolerances(cache, monkeypatch):
    # A model whose weights are bf16 (a checkpoint loaded in bf16) computes its gradients in bf16
    # under train.precision=fp32: at fp32's tolerance accumulation and clipping would fail (3.6e-3
    # against 1e-4), with a "usual cause" of a per-micro-batch mean that is not there.
    import torch

    from conftest import gpt_then
    from loop.config.load import DEFAULT_CONFIG
    from model import MODELS
    from tools.audit_grads import gradient_audits

    monkeypatch.setitem(MODELS, "gpt_bf16", gpt_then(lambda m: m.to(torch.bfloat16)))
    results = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt_bf16", "train.precision=fp32"],
                              {"accumulation", "clipping"})
    assert [(r.check, r.ok) for r in results] == [("accumulation", True), ("clipping", True)], results
    assert "(tolerance 0.05, bf16 weights)" in results[0].numbers, results[0].numbers
    assert results[1].numbers.endswith("(train.clip_grad=1, bf16 weights)"), results[1].numbers
    diff = float(re.search(r"rel. difference ([0-9.e+-]+)", results[0].numbers).group(1))
    assert 1e-4 < diff < 5e-2, results[0].numbers  # bf16 rounding, not a wrong normalisation (~1)


def test_a_model_whose_forward_casts_to_its_16_bit_layer_is_audited_in_its_own_dtypes(cache, monkeypatch):
    # The clipping check's reference keeps each weight's dtype: made float32, a forward that casts
    # to a bf16 layer's dtype would fail in it, a traceback (dtype mismatch) and no table.
    import torch

    from conftest import gpt_then
    from loop.config.load import DEFAULT_CONFIG
    from model import MODELS
    from tools.audit_grads import gradient_audits

    class Bf16Linear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x.to(torch.bfloat16)).to(x.dtype)

    def mixed(m):
        n_embd = m.wte.embedding_dim
        m.drop = torch.nn.Sequential(Bf16Linear(n_embd, n_embd).to(torch.bfloat16), m.drop)
        return m

    monkeypatch.setitem(MODELS, "gpt_mixed", gpt_then(mixed))
    results = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt_mixed", "train.precision=fp32"],
                              {"accumulation", "clipping"})
    assert [(r.check, r.ok) for r in results] == [("accumulation", True), ("clipping", True)], results
    assert results[1].numbers.startswith("applied gradient vs a plain own-dtype reference"), results[1].numbers
    assert results[1].numbers.endswith("(train.clip_grad=1, bf16 weights)"), results[1].numbers


def test_a_failed_run_is_named_by_its_error_not_by_torchrun_s_summary(tmp_path, monkeypatch):
    # Under torchrun the worker's one-paragraph error comes first and the launcher's failure summary
    # (a traceback, a table of ranks) last: the row shows the error.
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs

    plan = audit_runs.Plan(DEFAULT_CONFIG, [], steps=10, every=2, kill_at=5, nproc=2, root=tmp_path,
                           timeout=60)
    said = ("import sys; print('error: step 1: parameters spare.weight got no gradient', file=sys.stderr); "
            "print('Traceback (most recent call last):\\n  error_file: <N/A>\\n====', file=sys.stderr); sys.exit(1)")
    monkeypatch.setattr(audit_runs.jobs, "train_cmd", lambda args, nproc: [sys.executable, "-c", said])
    why = audit_runs.run(plan, "P", nproc=2)
    assert why == "run P exited 1 (P.log): step 1: parameters spare.weight got no gradient", why
    plan.nproc = 0  # a run that fails without saying "error: " shows its last lines
    monkeypatch.setattr(audit_runs.jobs, "train_cmd", lambda args, nproc: [
        sys.executable, "-c", "import sys; print('a\\nb\\nc\\nd', file=sys.stderr); sys.exit(3)"])
    assert audit_runs.run(plan, "Q").endswith("(Q.log): b | c | d")


def test_a_ddp_failure_of_a_model_whose_dropout_no_key_turns_off_names_its_dropout(tmp_path, monkeypatch):
    # The check sets model.dropout=0; a model whose dropout has another key (model.p_drop) keeps it,
    # each rank draws its own masks and the check fails, which the row put down to the loop's
    # normalisation. It names the dropout, as it names batch norm.
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.Dropout(0.0))
    assert audit_runs.dropouts(net) == ["1"]
    plan = audit_runs.Plan(DEFAULT_CONFIG, [], steps=2, every=2, kill_at=0, nproc=2, root=tmp_path, timeout=60)
    records = {"P1": [{"loss": 1.0, "ids": [0, 1]}] * 2, "P": [{"loss": 1.1, "ids": [0, 1]}] * 2}
    monkeypatch.setattr(audit_runs, "run", lambda plan, name, *extra, nproc=0: None)
    monkeypatch.setattr(audit_runs, "_records", lambda plan, name: records[name])
    result = audit_runs.ddp(plan, 2, 1e-4, [], [], audit_runs.dropouts(net))
    assert not result.ok and result.hint.startswith("the model's dropout (1) stays on, each rank drawing its "
                                                    "own masks"), result
    assert audit_runs.ddp(plan, 2, 1e-4, [], []).hint == audit_runs.HINTS["ddp"]


def test_the_ddp_hint_names_the_model_s_own_cause_only_where_both_read_the_same_samples(tmp_path, monkeypatch):
    # Sample ids that differ are the loop's data order: a batch norm or dropout of the model named
    # then would send the user to the wrong place. Every kind of dropout counts (Dropout2d too).
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.Dropout2d(0.1))
    assert audit_runs.dropouts(net) == ["1"]
    plan = audit_runs.Plan(DEFAULT_CONFIG, [], steps=2, every=2, kill_at=0, nproc=2, root=tmp_path, timeout=60)
    records = {"P1": [{"loss": 1.0, "ids": [0, 1]}] * 2, "P": [{"loss": 1.1, "ids": [1, 2]}] * 2}
    monkeypatch.setattr(audit_runs, "run", lambda plan, name, *extra, nproc=0: None)
    monkeypatch.setattr(audit_runs, "_records", lambda plan, name: records[name])
    for norms, drops in ((["0"], []), ([], ["1"])):
        result = audit_runs.ddp(plan, 2, 1e-4, norms, [], drops)
        assert not result.ok and "sample ids DIFFER" in result.numbers and result.hint == audit_runs.HINTS["ddp"]


def test_the_ddp_check_looks_for_dropout_in_the_model_as_its_runs_build_it(tmp_path, monkeypatch, cache):
    # Its runs set model.dropout=0: the default GPT then drops nothing and the hint stays the usual
    # cause's, while a dropout no such key turns off (one of the model's own) is named.
    import argparse

    from conftest import gpt_then
    from loop.config.load import DEFAULT_CONFIG
    from model import MODELS
    from tools import audit_runs, verify

    seen = []

    def ddp(plan, batch, tolerance, norms, quiet, drops=()):
        seen.append((quiet, list(drops)))
        return audit_runs.Result("ddp", True, "", "")

    def dropping(m):
        m.drop = torch.nn.Sequential(torch.nn.Dropout(0.1), m.drop)
        return m

    monkeypatch.setattr(audit_runs, "ddp", ddp)
    monkeypatch.setitem(MODELS, "gpt_dropping", gpt_then(dropping))
    for name in ("gpt", "gpt_dropping"):
        a = argparse.Namespace(config=DEFAULT_CONFIG, overrides=[*TINY, cache, f"model.name={name}"], kill_at=None,
                               steps=8, nproc=2, timeout=60, checks="ddp")
        verify.audit(a, ["ddp"], tmp_path)
    assert seen == [(["model.dropout=0"], []), (["model.dropout=0"], ["drop.0"])]


def test_a_resume_audit_that_never_killed_or_never_resumed_fails(tmp_path, monkeypatch):
    # Two ways the resume check could pass without proving anything: run R finished before the kill
    # (a config that runs fewer steps than asked), or its rerun started over instead of resuming (a
    # loop that cannot find its checkpoints). Each is a FAIL that says which, not a PASS.
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs

    plan = audit_runs.Plan(DEFAULT_CONFIG, [], steps=10, every=2, kill_at=5, nproc=0, root=tmp_path,
                           timeout=60)
    finished = (0, "step 10/10\ndone\n")
    monkeypatch.setattr(audit_runs.jobs, "run_until", lambda *a, **k: finished)
    result = audit_runs.resume(plan)
    assert not result.ok and "killed at step 5 but exited 0 (R.killed.log): " in result.numbers, result
    assert result.numbers.endswith("done") and (tmp_path / "R.killed.log").read_text() == finished[1]

    # Killed, but by the watchdog of a run that hung before step 5: not the kill the check is about.
    hung = (-signal.SIGKILL, "step 3/10\n" + audit_runs.jobs.TIMED_OUT)
    monkeypatch.setattr(audit_runs.jobs, "run_until", lambda *a, **k: hung)
    result = audit_runs.resume(plan)
    assert not result.ok and "did not reach step 5" in result.numbers and "--timeout 60" in result.numbers, result

    killed = (-signal.SIGKILL, "step 5/10\n")
    monkeypatch.setattr(audit_runs.jobs, "run_until", lambda *a, **k: killed)
    monkeypatch.setattr(audit_runs, "run", lambda plan, name: (tmp_path / f"{name}.log").write_text(
        "step 10/10\ndone\n") and None)  # ran to its end from step 1
    result = audit_runs.resume(plan)
    assert not result.ok and result.numbers == "the rerun did not resume from a checkpoint", result
    assert result.hint == audit_runs.HINTS["resume"]


def test_the_determinism_check_compares_the_weights_as_well_as_every_step(tmp_path, monkeypatch):
    # Nondeterminism that only the last update shows (a nondeterministic optimizer kernel, say)
    # leaves every logged loss equal: the weights' hash is what tells.
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs

    plan = audit_runs.Plan(DEFAULT_CONFIG, [], steps=2, every=2, kill_at=0, nproc=0, root=tmp_path,
                           timeout=60)
    records = [{"step": s, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-3} for s in (1, 2)]
    monkeypatch.setattr(audit_runs, "run", lambda plan, name: None)
    monkeypatch.setattr(audit_runs, "_records", lambda plan, name: records)
    monkeypatch.setattr(audit_runs, "_summary", lambda plan, name: {"params_sha256": name})  # A != B
    result = audit_runs.determinism(plan)
    assert not result.ok and result.numbers == "two identical runs differ: params_sha256", result


def test_the_data_check_fails_a_sampler_that_repeats_even_when_both_runs_agree(tmp_path, monkeypatch):
    # The same ids at every step in both runs, but a sample twice within an epoch (a sampler that
    # draws with replacement, or restarts its order inside an epoch): FAIL, with the count.
    from loop.config.load import DEFAULT_CONFIG
    from tools import audit_runs

    plan = audit_runs.Plan(DEFAULT_CONFIG, [], steps=3, every=2, kill_at=0, nproc=0, root=tmp_path,
                           timeout=60)
    ids = [[0, 1], [2, 0], [3, 4]]  # an epoch of 6: 0 twice, 5 never
    monkeypatch.setattr(audit_runs, "_records", lambda plan, name: [{"ids": i} for i in ids])
    result = audit_runs.data(plan, 6)
    assert not result.ok and result.numbers == ("across the resume: 1 samples seen twice within an "
                                                "epoch, 0 never seen; every step's sample ids are the "
                                                "uninterrupted run's"), result
    ids[1] = [2, 5]
    assert audit_runs.data(plan, 6).ok


def test_the_clipping_check_fails_a_loop_that_logs_the_clipped_norm(cache, monkeypatch):
    # A common slip: logging clip_grad_norm_'s norm after clipping it. The gradient applied is right,
    # so only the logged norm, against the reference's, tells.
    import torch

    from loop.config.load import DEFAULT_CONFIG
    from tools.audit_grads import gradient_audits

    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr("loop.trainer.clip_grad_norm_",
                        lambda params, max_norm, **kw: real(params, max_norm, **kw).clamp(max=max_norm))
    [result] = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "train.clip_grad=0.5"], {"clipping"})
    assert not result.ok and "gradient norm logged 0.5, reference " in result.numbers, result
    assert float(re.search(r"rel. difference ([0-9.e+-]+)", result.numbers).group(1)) < 1e-4


def test_under_cuda_graphs_verify_leaves_out_the_accumulation_it_cannot_audit(tmp_path, cache, monkeypatch, capsys):
    # A run whose CUDA graphs train each step in one micro-batch (loop/compiler.py) has no
    # accumulation to audit: said and left out, or exit 2 where --checks
    # names it; the clipping check runs on the step in one micro-batch alone.
    from conftest import load_config
    from loop import compiler
    from loop.config.load import DEFAULT_CONFIG
    from tools import verify as tool
    from tools.audit_grads import gradient_audits

    def graphs(cfg, device):  # the CPU taken for CUDA
        mode = cfg.train.compile_mode
        return f"train.compile_mode={mode}" if mode in compiler.CUDA_GRAPH_MODES else ""
    monkeypatch.setattr(compiler, "cuda_graphs", graphs)
    monkeypatch.setattr(tool, "cuda_graphs", graphs)
    args = [*TINY, cache, "train.compile_mode=reduce-overhead"]
    [clipping] = gradient_audits(DEFAULT_CONFIG, args, {"clipping"})
    assert clipping.check == "clipping" and clipping.ok, clipping
    cfg = load_config(DEFAULT_CONFIG, args)
    assert tool.without_accumulation_under_cuda_graphs(cfg, ["resume", "accumulation", "clipping"],
                                                       asked=False) == ["resume", "clipping"]
    assert "accumulation: not run: train.compile_mode=reduce-overhead" in capsys.readouterr().out
    assert tool.main(["--out", str(tmp_path / "v"), "--checks", "accumulation,clipping", *args]) == 2
    assert "--checks accumulation: train.compile_mode=reduce-overhead" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_the_accumulation_check_fails_a_loop_that_leaves_a_micro_batch_out_in_bf16(cache, monkeypatch):
    # Each micro-batch after the first keeps a quarter of its targets: enough weight that a step
    # without one is past bf16's tolerance (with one target kept it was 1/129 of the gradient).
    from loop.config.load import DEFAULT_CONFIG
    from loop.data.feed import Feed
    from tools.audit_grads import gradient_audits

    draw = Feed.draw
    monkeypatch.setattr(Feed, "draw", lambda feed: (lambda b, ms: (b[:1] if len(b) > 1 else b, ms))(*draw(feed)))
    [result] = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "train.precision=bf16"], {"accumulation"})
    assert not result.ok and "(targets per micro-batch [128, 32])" in result.numbers, result


def test_the_accumulation_check_sees_a_wrong_factor_that_the_clip_hides(cache, monkeypatch):
    # The loss divided by grad_accum once more: the same factor on the whole step, which the clip
    # takes out of the gradient it applies (both sides clipped to one norm); the logged gradient
    # norm and loss are half the one-batch step's.
    from loop.config.load import DEFAULT_CONFIG
    from loop.trainer import Trainer
    from tools.audit_grads import gradient_audits

    forward = Trainer.forward
    monkeypatch.setattr(Trainer, "forward", lambda t, batch: forward(t, batch) / t.cfg.train.grad_accum)
    [result] = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "train.clip_grad=0.1"], {"accumulation"})
    assert not result.ok and "rel. difference 5.0e-01" in result.numbers, result


def test_the_clipping_check_sets_a_clip_that_acts_and_fails_a_loop_that_does_not_clip(cache, monkeypatch):
    # train.clip_grad=5 is above the step's gradient norm: compared at 5, a loop that never clips
    # would pass. The check clips at half the norm instead, and says so.
    from loop.config.load import DEFAULT_CONFIG
    from tools.audit_grads import gradient_audits

    overrides = [*TINY, cache, "train.clip_grad=5"]
    [result] = gradient_audits(DEFAULT_CONFIG, overrides, {"clipping"})
    assert result.ok and "set below the norm: the config's 5 would not clip" in result.numbers, result
    norm, clip = (float(re.search(rf"{k}([0-9.]+)", result.numbers).group(1)) for k in ("reference ", "clip_grad="))
    assert clip == pytest.approx(norm / 2, rel=1e-3), result
    monkeypatch.setattr("loop.trainer.clip_grad_norm_", lambda params, max_norm, **kw: torch.nn.utils.get_total_norm(
        [q.grad for q in params if q.grad is not None]))
    [result] = gradient_audits(DEFAULT_CONFIG, overrides, {"clipping"})
    assert not result.ok and "rel. difference 1.0e+00" in result.numbers, result


def test_the_accumulation_check_says_when_equal_target_counts_cannot_tell(cache):
    # One target per micro-batch (batch 1, seq_len 1): a per-micro-batch mean is then the right
    # division too, so the pass proves less; the row says so.
    from loop.config.load import DEFAULT_CONFIG
    from tools.audit_grads import gradient_audits

    [result] = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "data.batch_size=1", "data.seq_len=1"],
                               {"accumulation"})
    assert result.ok and "(targets per micro-batch [1, 1])" in result.numbers, result
    assert result.numbers.endswith("; equal target counts, so a per-micro-batch mean would pass too")


@pytest.mark.slow
def test_verify_leaves_the_configs_mirror_alone(tmp_path, cache):
    # A config that mirrors its checkpoints (run.mirror, a bucket): no audit run may use that
    # bucket, or run A, with no checkpoint of its own, resumes from the newest one there (another
    # run's), and each audit run's pruning deletes the bucket's checkpoints it did not keep itself.
    bucket = tmp_path / "bucket"
    run_train(tmp_path / "prod", cache, "train.max_steps=4", "train.ckpt_every=2", f"run.mirror={bucket}")
    before = {p.relative_to(bucket): p.read_bytes() for p in bucket.rglob("*") if p.is_file()}
    proc = verify(tmp_path, "--checks", "determinism", *TINY, cache, f"run.mirror={bucket}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" not in proc.stdout + proc.stderr
    assert {p.relative_to(bucket): p.read_bytes() for p in bucket.rglob("*") if p.is_file()} == before


class Points(torch.utils.data.Dataset):
    """x: 3 features, y: one float target of shape (1,), y = x's sum."""

    def __init__(self, n: int):
        self.x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True), "idx": i}


class Broadcasting(torch.nn.Module):
    """Predicts (B,) against targets (B, 1): the squared errors broadcast to a (B, B) matrix."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 1)

    def forward(self, batch):
        return ((self.w(batch["x"]).squeeze(-1) - batch["y"]) ** 2).sum()


def test_an_accumulation_failure_with_equal_target_counts_names_a_loss_that_does_not_grow_with_the_batch(monkeypatch):
    # One float target per sample: every micro-batch holds as many, so a per-micro-batch mean is not
    # the cause, and the row neither says it "would go unnoticed" nor blames the mean.
    from data import DATASETS
    from loop.config.load import DEFAULT_CONFIG
    from loop.data.bundle import Data
    from model import MODELS
    from tools.audit_grads import gradient_audits

    monkeypatch.setitem(DATASETS, "points", lambda cfg: Data(Points(64), Points(16), vocab_size=1, seq_len=1))
    monkeypatch.setitem(MODELS, "broadcasting", lambda cfg, data: Broadcasting())
    [result] = gradient_audits(DEFAULT_CONFIG, ["data.name=points", "model.name=broadcasting", "train.device=cpu",
                                                "data.batch_size=4", "train.grad_accum=2"], {"accumulation"})
    assert not result.ok and "(targets per micro-batch [4, 4])" in result.numbers, result
    assert "unnoticed" not in result.numbers and "would pass" not in result.numbers, result
    assert "a prediction of shape (B,) broadcast against targets of shape (B, 1)" in result.hint, result


class Unlabelled(Points):
    """Points whose odd samples hold no target (y -100: unlabelled, or a prompt without an answer)."""

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        return {**item, "y": torch.full_like(item["y"], -100.0)} if i % 2 else item


class MaskedMean(torch.nn.Module):
    """The mean squared error over the real targets: a mean, not the sum the loop divides."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 1)

    def forward(self, batch):
        real = batch["y"] != -100
        return (((self.w(batch["x"]) - batch["y"]) ** 2) * real).sum() / real.sum().clamp_min(1)


def test_a_micro_batch_without_targets_does_not_let_a_mean_pass_the_accumulation_check(monkeypatch):
    # A micro-batch whose samples hold no target weighs nothing whatever its loss is divided by, so
    # with one in the step a per-micro-batch mean matched the sum: a plain PASS. The audit takes
    # the first samples that hold targets; with one float target each, their counts are equal,
    # which the row says cannot tell a mean (the start's probe finds it: tests/test_model.py).
    from data import DATASETS
    from loop.config.load import DEFAULT_CONFIG
    from loop.data.bundle import Data
    from model import MODELS
    from tools.audit_grads import gradient_audits

    monkeypatch.setitem(DATASETS, "unlabelled", lambda cfg: Data(Unlabelled(64), Unlabelled(16), vocab_size=1,
                                                                 seq_len=1))
    monkeypatch.setitem(MODELS, "masked_mean", lambda cfg, data: MaskedMean())
    for seed in range(4):
        args = ["data.name=unlabelled", "model.name=masked_mean", "train.device=cpu", "data.batch_size=2",
                "train.grad_accum=2", f"run.seed={seed}"]
        [result] = gradient_audits(DEFAULT_CONFIG, args, {"accumulation"})
        assert "(targets per micro-batch [2, 2])" in result.numbers, result
        assert not result.ok or "a per-micro-batch mean would pass too" in result.numbers, result


def test_a_loss_that_is_not_finite_in_an_audit_is_its_fail_row_naming_the_usual_causes(cache, monkeypatch):
    # A model that averages per sequence, then over sequences: the audit keeps the first quarter of
    # each later micro-batch's targets (whole sequences first), so that micro-batch has sequences
    # without targets, whose mean over none is NaN: a FAIL row naming the usual causes, not a
    # GaveUp traceback advising a lower learning rate.
    import torch.nn.functional as F

    from conftest import gpt_then
    from loop.config.load import DEFAULT_CONFIG
    from model import MODELS
    from tools.audit_grads import gradient_audits

    class PerSequenceMean(torch.nn.Module):
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, batch):
            y = batch["y"]
            token = F.cross_entropy(self.gpt.logits(batch["x"]).transpose(1, 2), y, ignore_index=-100,
                                    reduction="none")  # (B, T)
            return (token.sum(1) / (y != -100).sum(1)).mean()

    monkeypatch.setitem(MODELS, "gpt_per_sequence", gpt_then(PerSequenceMean))
    [r] = gradient_audits(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt_per_sequence"], {"accumulation"})
    assert not r.ok and r.numbers.endswith("the loss was nan") and "per sequence" in r.hint, r


def test_logs_compare_nan_as_nan_and_resume_and_determinism_compare_validation_too():
    # A step with no target logs NaN in every run: an honest setup failed resume, determinism and
    # eval ("loss nan vs nan"). State only evaluation reads (a normalisation's running statistics
    # not in the state_dict) passed resume: the validation metrics were not compared.
    from tools.audit_runs import _first_difference

    nan = float("nan")
    a = [{"step": 1, "loss": nan, "grad_norm": nan, "lr": 0.1}, {"step": 2, "loss": 2.0, "grad_norm": 1.0,
                                                                 "lr": 0.1, "val_loss": 1.5}]
    assert _first_difference(a, [dict(r) for r in a], val=True) is None
    b = [dict(a[0]), {**a[1], "val_loss": 1.25}]
    assert _first_difference(a, b) is None  # the eval check: its runs evaluate at other steps
    assert _first_difference(a, b, val=True) == "step 2: val_loss 1.5 vs 1.25"
    assert _first_difference(a, [{**a[0], "loss": 1.0}, a[1]]) == "step 1: loss nan vs 1.0"


def test_gradients_compare_a_parameter_one_side_left_without_one_as_zeros():
    # A model that uses a parameter for some samples only: a traceback (sizes 72 vs 36) in verify.
    from tools.audit_grads import _rel

    g = torch.ones(3, dtype=torch.float64)
    assert _rel({"a": g}, {"a": g, "b": torch.zeros(2, dtype=torch.float64)}) == 0.0
    assert _rel({"a": g}, {"a": g, "b": torch.ones(2, dtype=torch.float64)}) == pytest.approx(2 ** 0.5 / 5 ** 0.5)
