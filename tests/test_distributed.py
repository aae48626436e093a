"""Many processes, one code path, through real torchrun subprocesses (gloo on CPU): 2 processes equal 1
process with twice the micro-batch, a SIGKILLed 2-process job resumes bit-identically, the world
size can change at a resume without skipping or repeating a sample, a NaN on one rank is skipped by
all (or rolled back by all, past the global window), torchrun --max-restarts recovers a killed
worker, and torchrun with one process takes the distributed path (DDP or FSDP over one rank) with
plain python's results."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DIST as STEPS
from conftest import ROOT, TINY, ids, metrics, run_and_signal, run_train, summary, train_cmd, watchdog
from loop.checkpoint import store
from loop.distributed.group import Dist
from loop.errors import BadInput
from loop.rng import rank_seed
from tools import jobs


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory, cache) -> Path:
    """DIST in plain python with twice the micro-batch: two_proc's global batch in one process;
    one thread, as each torchrun process has, so a one-process torchrun job can match it bit for bit."""
    out = tmp_path_factory.mktemp("one") / "run"
    proc = run_train(out, cache, *STEPS, "data.batch_size=8")
    assert "1 process(es), no process group |" in proc.stdout, proc.stdout
    return out


@pytest.mark.slow
def test_two_processes_equal_one_with_twice_the_batch(one_proc, two_proc):
    a, b = metrics(one_proc), metrics(two_proc)
    assert ids(one_proc) == ids(two_proc)  # the same samples per step, in the same order
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    # Same samples and maths; the sums over ranks add in a different order than one process's
    # sums, so agreement is to float32 rounding (seen: 1.1e-7 relative), not bit for bit.
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
    assert summary(two_proc)["val_loss"] == pytest.approx(summary(one_proc)["val_loss"], rel=1e-5)
    wa = torch.load(one_proc / "model.pt", weights_only=True)["model"]
    wb = torch.load(two_proc / "model.pt", weights_only=True)["model"]
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5) for k in wa)
    ckpt = two_proc / "checkpoints" / "step_00000020"
    # Every rank's file is in the manifest: verified at a resume, and copied by run.mirror.
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert sorted(files) == ["rng_rank0.pt", "rng_rank1.pt", "state.pt"]
    # Each rank its own random streams: seeded alike, the ranks would draw the same dropout masks.
    r0, r1 = (torch.load(ckpt / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert not torch.equal(r0["torch"], r1["torch"]) and r0["python"] != r1["python"]
    assert not torch.equal(r0["numpy"]["keys"], r1["numpy"]["keys"])


@pytest.mark.slow
def test_ranks_holding_different_target_counts_still_equal_one_process(tmp_path, cache):
    # Each rank divides its summed loss by the step's target count over all ranks. With every
    # sample holding seq_len targets, its own count times the world size is the same number, so
    # only uneven counts tell the two apart: here each sample has another count (padding-like
    # masks).
    def run(out, nproc, batch):
        cmd = train_cmd(out, cache, "train.max_steps=6", "model.dropout=0", "data.log_ids=true",
                        "data.name=text_masked", f"data.batch_size={batch}", nproc=nproc)
        cmd[cmd.index(str(ROOT / "train.py"))] = str(ROOT / "tests" / "more_models.py")
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
        return metrics(out)

    one, two = run(tmp_path / "one", 0, 8), run(tmp_path / "two", 2, 4)
    assert [r["ids"] for r in one] == [r["ids"] for r in two]
    tokens = [r["tokens"] for r in one]
    assert tokens == [r["tokens"] for r in two] and len({b - a for a, b in zip([0, *tokens], tokens)}) > 1
    for x, y in zip(one, two):  # float32 reduction order only (as above)
        assert (y["loss"], y["grad_norm"]) == (pytest.approx(x["loss"], rel=1e-5),
                                               pytest.approx(x["grad_norm"], rel=1e-5)), x["step"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_with_one_process_runs_the_distributed_path_bit_for_bit(tmp_path, cache, one_proc,
                                                                        strategy):
    # Under torchrun even one process gets a process group and the DDP (or FSDP) wrapper, so one
    # GPU exercises nccl; the maths stay plain python's to the bit (a sum over one rank).
    out = tmp_path / "run"
    proc = run_train(out, cache, *STEPS, "data.batch_size=8", f"train.strategy={strategy}", nproc=1)
    assert f"1 process(es), {strategy} over gloo |" in proc.stdout, proc.stdout
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(one_proc)]
    assert summary(out)["params_sha256"] == summary(one_proc)["params_sha256"]


@pytest.mark.slow
def test_one_process_under_torchrun_recovers_an_oom_in_backward_like_plain_python(tmp_path, cache):
    # Alone, no rank can be left in a collective: an OOM in the backward that reduces gradients is
    # retried with a fresh DDP (its reducer cannot resume a reduction left halfway), and the run
    # stays plain python's, with the same fault, to the bit.
    args = [cache, *STEPS, "train.grad_accum=1", "faults.oom_at_step=6", "faults.oom_in=backward"]
    plain, one = tmp_path / "plain", tmp_path / "torchrun"
    run_train(plain, *args)
    proc = run_train(one, *args, nproc=1)
    assert "step 6: out of memory; micro-batch 4 -> 2" in proc.stderr, proc.stderr
    assert [r["micro_batch"] for r in metrics(one)] == [4] * 5 + [2] * 15
    assert [r["loss"] for r in metrics(one)] == [r["loss"] for r in metrics(plain)]
    assert summary(one)["params_sha256"] == summary(plain)["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_ddp_sigkill_then_rerun_is_bit_identical(tmp_path, cache, two_proc, async_save):
    # With a mirror too: every rank takes part in deciding it, only rank 0 copies. Async: each
    # rank's writer thread meets the others' on a group of their own while training goes on.
    out, mirror = tmp_path / "run", f"run.mirror={tmp_path / 'bucket'}"
    args = [*STEPS, mirror, f"train.async_save={async_save}"]
    code, printed = run_and_signal(out, 12, cache, *args, nproc=2, group=True)
    assert code == -signal.SIGKILL and not (out / "summary.json").exists(), printed
    rerun = run_train(out, cache, *args, nproc=2)
    # An async write of step 10 may still have been in flight at the kill: then step 5 it is.
    want = r"resumed from \S+ at step (10|5)\b" if async_save else r"resumed from \S+ at step 10\b"
    assert re.search(want, rerun.stdout), rerun.stdout
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(two_proc)]
    assert summary(out)["params_sha256"] == summary(two_proc)["params_sha256"]


@pytest.mark.slow
def test_ddp_with_dropout_sigkill_then_rerun_is_bit_identical(tmp_path, cache):
    # Every rank gets its own random streams back. The runs above train without dropout (DIST), so
    # nothing draws from rank 1's streams: every rank restoring rank 0's would pass them all.
    args = [*STEPS, "model.dropout=0.1"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, cache, *args, nproc=2)
    code, printed = run_and_signal(out, 12, cache, *args, nproc=2, group=True)
    assert code == -signal.SIGKILL, printed
    rerun = run_train(out, cache, *args, nproc=2)
    assert re.search(r"resumed from \S+ at step 10\b", rerun.stdout), rerun.stdout
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]


@pytest.mark.slow
def test_ddp_batch_norm_and_its_ema_validate_as_one_model_across_a_kill_and_a_rerun(tmp_path, cache):
    # Each rank's BatchNorm statistics, and the EMA's average of them, move with its own data; a
    # checkpoint keeps rank 0's. Validation sums every rank's share, so every rank validates rank
    # 0's model: a resumed run, and a rerun of a finished one, report the uninterrupted val_loss.
    def cmd(out: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "tests/more_models.py", f"run.out_dir={out}", *TINY, cache, *STEPS, "model.name=gpt_bn",
                "ema.enabled=true", "ema.decay=0.9", "train.eval_every=5", "train.sample_tokens=0"]

    whole, out = tmp_path / "whole", tmp_path / "run"
    done = subprocess.run(cmd(whole), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    code, printed = jobs.run_until(cmd(out), 12, tree=True, cwd=ROOT)
    assert code == -signal.SIGKILL and not (out / "summary.json").exists(), printed
    rerun = subprocess.run(cmd(out), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and "at step 10" in rerun.stdout, rerun.stdout + rerun.stderr
    assert [r["val_loss"] for r in metrics(out) if "val_loss" in r] == \
        [r["val_loss"] for r in metrics(whole) if "val_loss" in r]
    first = summary(whole)["val_loss"]
    again = subprocess.run(cmd(whole), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "at step 20" in again.stdout, again.stdout + again.stderr
    assert summary(whole)["val_loss"] == first == summary(out)["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, first, then",
                         [("ddp", 2, 1), ("ddp", 1, 2), ("fsdp", 2, 1), ("fsdp", 1, 2)])
def test_world_size_change_continues_the_global_order(tmp_path, cache, two_proc, strategy, first, then):
    # Bit-exactness is not promised across process counts (reduction order differs), but every
    # global sample position is consumed once: the ids of each step are the uninterrupted run's.
    # FSDP's sharded checkpoint is resharded on load (torch.distributed.checkpoint); its one
    # process runs under torchrun, where the model is still sharded (over one rank).
    out = tmp_path / "run"
    batch = {1: "data.batch_size=8", 2: "data.batch_size=4"}
    nproc = {1: 1 if strategy == "fsdp" else 0, 2: 2}
    args = [*STEPS, f"train.strategy={strategy}"]
    run_train(out, cache, *args, "train.max_steps=10", batch[first], nproc=nproc[first])
    proc = run_train(out, cache, *args, batch[then], nproc=nproc[then])
    assert "at step 10" in proc.stdout and "a step now takes" not in proc.stdout, proc.stdout
    assert (f"note: this resume is not where the checkpoint was written (processes {nproc[first] or 1} "
            f"-> {nproc[then] or 1}): the run goes on from the same data position") in proc.stdout
    assert "with another number of processes dropout (and any random draw in the model) draws other " \
           "masks" in proc.stdout, proc.stdout
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 21))
    assert ids(out) == ids(two_proc)
    seen = [i for step in ids(out) for i in step]
    assert len(seen) == 20 * 16 and len(set(seen)) == len(seen)  # each sample once
    for x, y in zip(metrics(two_proc), recs):  # the same maths, to float32 rounding
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
    if then == 2:
        assert "has no rng_rank1.pt" in proc.stdout + proc.stderr  # new rank: fresh streams


@pytest.mark.slow
def test_a_global_batch_keeps_the_step_when_the_process_count_changes(tmp_path, cache, two_proc):
    # train.global_batch=16 (two_proc's) with micro-batches of 4: train.grad_accum follows, 4 in
    # one process, then 2 in two after a resume. No "a step now takes" note: the same samples a
    # step as two_proc, in its order, with its maths (to float32 rounding across layouts).
    out, args = tmp_path / "run", [*STEPS, "train.global_batch=16", "data.batch_size=4", "train.grad_accum=7"]
    first = run_train(out, cache, *args, "train.max_steps=10")
    assert "train.global_batch=16: train.grad_accum=4 (1 process(es) x data.batch_size 4 x 4)" in first.stdout
    then = run_train(out, cache, *args, nproc=2)
    assert "train.grad_accum=2 (2 process(es) x data.batch_size 4 x 2)" in then.stdout, then.stdout
    assert "at step 10" in then.stdout and "a step now takes" not in then.stdout, then.stdout
    assert not re.search(r"config differs[^\n]*train\.grad_accum", then.stdout), then.stdout  # derived, not set
    assert ids(out) == ids(two_proc)
    for x, y in zip(metrics(two_proc), metrics(out)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]


@pytest.mark.slow
def test_ddp_run_whose_last_step_is_not_an_eval_step_finishes(tmp_path, cache):
    # The final validation all-reduces over ranks, so every rank must run it, not rank 0 alone;
    # and a finished DDP run started again (resumed at its last step) validates the same way.
    out = tmp_path / "run"
    args = [cache, "train.max_steps=7", "train.eval_every=5", "train.ckpt_every=5", "model.dropout=0"]
    run_train(out, *args, nproc=2)
    first = summary(out)
    assert first["steps"] == 7 and first["val_loss"] > 0
    rerun = run_train(out, *args, nproc=2)
    assert "at step 7" in rerun.stdout and summary(out)["val_loss"] == first["val_loss"]


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_by_every_rank(tmp_path, cache):
    out = tmp_path / "run"
    proc = run_train(out, cache, *STEPS, "faults.nan_at_step=7", "faults.nan_rank=1", nproc=2)
    recs = metrics(out)
    assert [r["step"] for r in recs if r["skipped"]] == [7]
    assert summary(out)["skipped_steps"] == 1 and summary(out)["steps"] == 20
    # Each rank says what it saw: rank 1 its own loss, rank 0 the gradients summed with rank 1's.
    assert "warning: rank 1: step 7: non-finite loss of micro-batch 0" in proc.stderr, proc.stderr
    assert "warning: rank 0: step 7: non-finite grad norm" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_nan_on_one_rank_rolls_every_rank_back_past_the_global_window(tmp_path, cache, two_proc):
    out = tmp_path / "run"
    proc = run_train(out, cache, *STEPS, "train.nan_policy=rollback", "faults.nan_at_step=13",
                     "faults.nan_rank=1", nproc=2)
    assert "rolled back to step 10; the samples at position 192 will be passed over" in proc.stderr
    recs, ref = metrics(out), metrics(two_proc)
    # Steps 11-12 replayed as before; from step 13 on, each trains on the uninterrupted run's next
    # window: the one at position 192 (12 steps x 16 samples, both ranks') is never trained on.
    assert [r["ids"] for r in recs] == [r["ids"] for r in ref[:12] + ref[13:]] + [recs[-1]["ids"]]
    # The position counts both ranks' samples, the window passed over too: a resume continues
    # from it. Counting one rank's alone, it would fall 8 behind the data the ranks had drawn.
    assert [r["samples"] for r in recs] == [16 * k for k in [*range(1, 13), *range(14, 22)]]
    assert summary(out)["rollbacks"] == 1 and summary(out)["steps"] == 20


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


@pytest.mark.slow
def test_max_restarts_recovers_a_killed_worker(tmp_path, cache, two_proc):
    out = tmp_path / "run"
    cmd = train_cmd(out, cache, *STEPS, nproc=2, restarts=1)
    # Without this, restarted workers can read the previous attempt's addresses from torchrun's
    # shared TCPStore and never connect (pytorch/pytorch#135712; seen here as a hang and as
    # "Connection refused"). The README tells users to set it with --max-restarts.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    timer = watchdog(proc)  # a hang fails this test instead of stalling the whole suite
    seen, killed = [], None
    try:
        for line in proc.stdout:
            seen.append(line)
            if killed is None and line.startswith("step") and int(line.split()[1].split("/")[0]) >= 12:
                workers = children(proc.pid)
                assert len(workers) == 2, workers
                killed = workers[-1]
                os.kill(killed, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    printed = "".join(seen)
    assert proc.returncode == 0 and killed, printed
    # Killed once step 12 was printed: the worker may have got past step 15 (and its checkpoint)
    # by then on a loaded machine, so the restart resumes from 10 or 15.
    resumed = re.search(r"resumed from \S+ at step (\d+)", printed)
    assert resumed and resumed[1] in ("10", "15"), printed
    assert summary(out)["params_sha256"] == summary(two_proc)["params_sha256"]
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(two_proc)]


@pytest.mark.slow
def test_a_stop_signal_to_one_rank_stops_every_rank_at_one_checkpoint(tmp_path, cache, two_proc):
    # SIGTERM to one worker alone (a node's agent preempting its own processes): every rank agrees
    # at that step, all save it and exit 143; the others must not train on without it.
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(out, cache, *STEPS, nproc=2), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    timer = watchdog(proc)
    seen, signalled = [], None
    try:
        for line in proc.stdout:
            seen.append(line)
            if signalled is None and line.startswith("step") and int(line.split()[1].split("/")[0]) >= 5:
                signalled = children(proc.pid)[-1]
                os.kill(signalled, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    printed = "".join(seen)
    stopped = re.search(r"preempted at step (\d+); checkpoint written", printed)
    assert signalled and stopped and 5 <= int(stopped[1]) < 20, printed
    assert printed.count("exitcode  : 143") == 2 and not (out / "summary.json").exists(), printed
    assert store.step_dirs(out / "checkpoints")[-1].name == f"step_{int(stopped[1]):08d}"
    rerun = run_train(out, cache, *STEPS, nproc=2)
    assert f"at step {stopped[1]}" in rerun.stdout, rerun.stdout
    assert summary(out)["params_sha256"] == summary(two_proc)["params_sha256"]


@pytest.mark.slow
def test_workers_whose_torchrun_is_gone_save_and_stop(tmp_path, cache, two_proc):
    # SIGUSR1 to torchrun itself (not its workers): torchrun does not handle it and dies at once.
    # Its workers notice at the next step, checkpoint and exit as preempted, rather than train on to
    # the end unsupervised, with nobody to stop or restart them or read their exit codes.
    out = tmp_path / "run"
    code, printed = jobs.run_until(train_cmd(out, cache, *STEPS, nproc=2), 5, signal.SIGUSR1, cwd=ROOT)
    # run_until read to the end of the output: the workers, which hold the pipe, have exited too.
    assert code == -signal.SIGUSR1, printed
    assert re.search(r"torchrun \(pid \d+\) is gone: finishing this step, then saving a checkpoint "
                     r"and exiting with 143", printed), printed
    stopped = re.search(r"preempted at step (\d+); checkpoint written", printed)
    assert stopped and 5 <= int(stopped[1]) < 20 and not (out / "summary.json").exists(), printed
    rerun = run_train(out, cache, *STEPS, nproc=2)
    assert f"at step {stopped[1]}" in rerun.stdout, rerun.stdout
    assert summary(out)["params_sha256"] == summary(two_proc)["params_sha256"]
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(two_proc)]


@pytest.mark.slow
def test_oom_on_one_rank_is_agreed_by_every_rank(tmp_path, cache, two_proc):
    # Rank 1 runs out of memory in the forward of micro-batch 0 of 2; rank 0 goes on through
    # micro-batch 1's forward, which sets DDP to reduce in the next backward. They agree before
    # that backward, and both retry in halves with a fresh DDP, keeping the maths (float32
    # rounding only: two partial sums instead of one). Without the fresh DDP, rank 0's first
    # retried backward all-reduces on its own and the ranks' collectives no longer match.
    out = tmp_path / "run"
    proc = run_train(out, cache, *STEPS, "faults.oom_at_step=6", "faults.oom_rank=1", nproc=2)
    assert proc.stderr.count("step 6: out of memory; micro-batch 4 -> 2") == 1, proc.stderr  # rank 0
    recs = metrics(out)
    assert [r["micro_batch"] for r in recs] == [4] * 5 + [2] * 15
    for x, y in zip(metrics(two_proc), recs):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), x["step"]


ADVICE = "smaller data.batch_size and a larger train.grad_accum"


@pytest.mark.slow
@pytest.mark.parametrize("where, said, advice", [
    (["train.grad_accum=1", "faults.oom_in=backward"], "in the last micro-batch's backward", ADVICE),
    (["train.strategy=fsdp"], "in forward or backward under FSDP", ADVICE),
    (["train.strategy=fsdp", "train.grad_accum=1", "faults.oom_in=backward"],
     "in forward or backward under FSDP", ADVICE),
    # With a global batch the accumulation follows the micro-batch: a smaller one alone does it.
    (["train.strategy=fsdp", "train.global_batch=16"], "in forward or backward under FSDP",
     "smaller data.batch_size (train.global_batch keeps the step)")])
def test_oom_inside_collectives_ends_the_job_with_what_to_do(tmp_path, cache, where, said, advice):
    # Rank 1 runs out of memory where rank 0 is already in a collective it will never join: no
    # retry can put that right. Rank 1 says why and exits 3 (torchrun's report may show it killed
    # instead: rank 0's failure, as rank 1's connection closes, can be seen first); rank 0 does
    # not hang; the checkpoints are those written before.
    out = tmp_path / "run"
    proc = run_train(out, cache, *STEPS, "faults.oom_at_step=6", "faults.oom_rank=1", *where,
                     nproc=2, check=False)
    assert proc.returncode != 0
    assert f"error: rank 1: step 6: out of memory {said}" in proc.stderr, proc.stderr
    assert advice in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000005"]


LAUNCH = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "29500"}


@pytest.mark.slow
@pytest.mark.parametrize("env, named", [
    ({"RANK": "0"}, "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ({**LAUNCH, "MASTER_ADDR": ""}, "MASTER_ADDR is not"),
    ({**LAUNCH, "RANK": "zero"}, "expected integers; got RANK='zero'"),
    ({**LAUNCH, "RANK": "3", "WORLD_SIZE": "2"}, "RANK=3, LOCAL_RANK=0, WORLD_SIZE=2: expected 0 <= RANK"),
    ({**LAUNCH, "WORLD_SIZE": "0"}, "WORLD_SIZE=0: expected 0 <= RANK < WORLD_SIZE"),
    ({**LAUNCH, "MASTER_PORT": "http"}, "MASTER_PORT: expected a port from 1 to 65535; got 'http'"),
    ({**LAUNCH, "MASTER_PORT": "65536"}, "MASTER_PORT: expected a port from 1 to 65535; got '65536'")])  # one past
def test_a_half_set_launch_environment_exits_2_naming_the_variables(tmp_path, env, named):
    # A stray RANK (another tool's, or a hand-made launch) must not end in torch's rendezvous error.
    out = tmp_path / "run"
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH}
    proc = subprocess.run(train_cmd(out), cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**clean, **env})
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_negative_local_rank_is_refused_before_any_process_group(monkeypatch):
    # LOCAL_RANK=-1 (torch.distributed.launch's unset value) names no GPU of this process's own:
    # refused by name, before a process group exists (the slow launch test runs train.py).
    from loop.distributed import group

    for k, v in {**LAUNCH, "LOCAL_RANK": "-1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(BadInput) as e:
        group.init("cpu")
    assert "LOCAL_RANK=-1, WORLD_SIZE=1: expected 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0" in str(e.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_ddp_names_parameters_without_gradient_and_trains_them_with_find_unused(tmp_path, cache):
    # DDP without find_unused_parameters leaves the bucket of a parameter that got no gradient
    # unreduced, and its next forward raises a RuntimeError that names a keyword argument: the run
    # names the parameters and the config key that passes it (train.find_unused_parameters).
    def launch(out, *extra):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", "tests/more_models.py", f"run.out_dir={out}", *TINY,
                               cache, "train.max_steps=3", "model.name=gpt_spare", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)

    refused = launch(tmp_path / "a")
    assert refused.returncode == 1 and "exitcode  : 2 " in refused.stderr, refused.stderr
    assert "error: step 1: parameters spare.weight, spare.bias got no gradient" in refused.stderr
    assert "train.find_unused_parameters=true" in refused.stderr
    assert not (tmp_path / "a" / "checkpoints").exists()
    # Used in a step's first micro-batch alone: its gradient is there, but DDP reduced none of its
    # bucket; the optimizer stepped on each rank's own (the replicas parted, exit 0 at max_steps=1)
    # and the next forward was DDP's traceback.
    first = launch(tmp_path / "c", "model.name=gpt_first_micro", "data.batch_size=2", "train.grad_accum=2")
    assert first.returncode == 1 and "exitcode  : 2 " in first.stderr, first.stderr
    assert "error: step 1: parameters drop.extra.weight, drop.extra.bias got no gradient in the step's last " \
        "micro-batch" in first.stderr and not (tmp_path / "c" / "checkpoints").exists()
    done = launch(tmp_path / "b", "train.find_unused_parameters=true")
    assert done.returncode == 0, done.stderr
    assert summary(tmp_path / "b")["steps"] == 3
    # A frozen parameter (requires_grad=False, as a fine-tune leaves most) is DDP's to leave out.
    frozen = launch(tmp_path / "d", "model.name=gpt_frozen")
    assert frozen.returncode == 0 and summary(tmp_path / "d")["steps"] == 3, frozen.stderr


@pytest.mark.slow
def test_processes_with_different_data_exit_2_naming_what_differs(tmp_path, cache):
    # Each node reads its own copy of the data: with rank 1's one sample shorter, DDP would train
    # each rank on another sample order without a word, and FSDP hang at its first evaluation.
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/more_models.py", f"run.out_dir={out}", *TINY, cache, "train.max_steps=3",
                           "data.name=text_per_node"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "exitcode  : 2 " in proc.stderr, proc.stderr
    said = re.search(r"error: the data differs between processes: rank 1 has len\(train\)=(\d+), "
                     r"meta\.train_tokens=(\d+) where rank 0 has len\(train\)=(\d+), meta\.train_tokens=(\d+);",
                     proc.stderr)
    assert said, proc.stderr
    mine, theirs = map(int, said.groups()[:2]), map(int, said.groups()[2:])
    assert [a + 1 for a in mine] == list(theirs) and not out.exists()


def test_the_data_check_compares_plain_meta_values_only():
    # A builder may put anything in Data.meta: an object's text holds its address and a set's its
    # process's hash order, so comparing them would refuse runs whose data is the same; a key that
    # is not a string must not break a one-process run.
    from loop.config.runtime import check_same_data
    from loop.data.bundle import Data

    class Rank(Dist):
        def __init__(self, rank, sent=None):
            self.rank, self.world, self.sent = rank, 2, sent

        def from_main(self, obj):
            if self.rank == 0:
                self.sent = obj
            return self.sent

        def sum_host(self, values):
            return values  # rank 0 adds nothing: it holds the facts compared with

    def data(n, **meta):
        return Data(list(range(n)), list(range(3)), vocab_size=5, seq_len=1,
                    meta={"obj": object(), "nan": float("nan"), (0, 1): {3, 4}, **meta})

    check_same_data(data(10), Dist())  # one process: nothing to compare
    main, mine = Rank(0), data(10, sha256="a")
    check_same_data(mine, main)
    check_same_data(data(10, sha256="a"), Rank(1, main.sent))  # the same data, other objects
    for other, said in ((data(11, sha256="a"), "len(train)=11 where rank 0 has len(train)=10"),
                        (data(10, sha256="b"), "meta.sha256='b' where rank 0 has meta.sha256='a'")):
        with pytest.raises(BadInput, match=re.escape(f"the data differs between processes: rank 1 has {said};")):
            check_same_data(other, Rank(1, main.sent))


def test_a_rank_that_starts_fresh_at_a_resume_draws_a_stream_no_rank_drew():
    # A rank the checkpoint has no RNG file for (more processes than saved it) is seeded from the
    # run's seed, its rank and the step (loop/checkpoint/state.py): with the step left out, rank 1
    # resumed at step 20 would replay the dropout masks every rank 1 draws from step 1, which no
    # end-to-end test notices.
    seeds = {rank_seed(1337, r, s) for r in range(4) for s in (0, 1, 20, 40)}  # rank 1 at step 0, rank 0 at 1
    assert len(seeds) == 16 and 1337 not in seeds


def test_a_rank_the_checkpoint_has_no_streams_for_is_seeded_for_its_rank_and_step(tmp_path, cache):
    # In one process: the checkpoint of a one-process run restored as rank 1 of 2 (no rng_rank1.pt).
    # Its streams must start from rank_seed(seed, 1, step), not go on from wherever this process is.
    import random
    from types import SimpleNamespace

    import numpy as np

    from conftest import build_trainer, load_config
    from loop.checkpoint import state
    from loop.config.load import DEFAULT_CONFIG
    from loop.rng import seed_everything

    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=2",
                                       "train.eval_every=0"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.run()
    rank1 = SimpleNamespace(rank=1, world=2, say=lambda *a, **k: None)
    state.restore(tmp_path / "run" / "checkpoints" / "step_00000002", t.parts, cfg, rank1, t.metadata)
    drawn = (torch.rand(4), random.random(), np.random.rand(2))
    seed_everything(rank_seed(cfg.run.seed, 1, 2))
    expected = (torch.rand(4), random.random(), np.random.rand(2))
    assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1] and (drawn[2] == expected[2]).all()


@pytest.mark.slow
def test_processes_with_different_configs_exit_2_naming_the_keys(tmp_path, cache):
    # Each node reads its own config file, overrides and .env: with optim.lr apart the replicas
    # would train apart without a word (only rank 0's weights are saved), and with train.max_steps
    # apart the run would hang at rank 0's end.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH}
    procs = [subprocess.Popen(train_cmd(out, cache, "train.max_steps=3", f"optim.lr={lr}"), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**clean, **LAUNCH, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_PORT": str(port)})
             for r, lr in ((0, "1e-3"), (1, "5e-3"))]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    tail = "; expected the same config on every process (the same config file, overrides and .env on every node).\n"
    assert errs[0].endswith("error: the config differs between processes: 1 process(es) have another one than "
                            "rank 0 (their messages name the keys)" + tail), errs[0]
    assert errs[1].endswith("error: the config differs between processes: rank 1 has optim.lr=0.005 where "
                            "rank 0 has optim.lr=0.001" + tail), errs[1]
    assert not out.exists()


def test_a_torchrun_worker_that_stopped_ignores_stop_signals_until_it_exits(monkeypatch):
    # torchrun sends SIGTERM to every worker once one exits 143: a worker whose checkpoint is
    # written and that is still closing must end 143 too, not -15. Not under plain python (a
    # notebook's next run keeps its handlers), nor for a run that did not stop.
    from loop.guards.preemption import STOP_SIGNALS, Preemption

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        for rank, stopped in ((None, True), ("1", False), ("1", True)):
            if rank is None:
                monkeypatch.delenv("RANK", raising=False)
            else:
                monkeypatch.setenv("RANK", rank)
            Preemption().close(stopped)
            ignored = rank is not None and stopped
            assert all((signal.getsignal(s) is signal.SIG_IGN) is ignored for s in STOP_SIGNALS), (rank, stopped)
            for s, handler in before.items():
                signal.signal(s, handler)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
