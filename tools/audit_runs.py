"""make verify's run audits: real train.py jobs on the user's config, compared record by record.

    A  N steps straight                              the reference
    B  the same command again                        determinism: B == A
    R  the same, SIGKILLed at a random step once a   resume: every step's loss, grad norm, lr, val_*,
       checkpoint is complete, and rerun             params_sha256, the final checkpoint's state
                                                     data: the same sample ids at every step, none
                                                     twice within an epoch
    E  A with evaluation only at the end             eval: the training losses equal A's
    P  --nproc n processes under torchrun vs one process with n times the micro-batch (dropout 0,
       since each rank has its own random streams)   ddp

Every run gets a checkpoint and an evaluation every `every` steps, logs every step and its sample
ids (`data.log_ids`), no early stopping (runs that evaluate differently must train as long) and no
mirror (the config's holds another run's checkpoints).
"""
from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from loop.checkpoint import store
from loop.errors import EXIT_BAD_INPUT, BadInput
from loop.observe.jsonl import read_records
from tools import jobs
from tools.audit_grads import Result

# Why a check's comparison usually fails. Not given when a run did not finish: then nothing was
# compared, and the run's own log (named in the result) is the lead.
HINTS = {
    "resume": "a piece of state is not saved or not restored: RNG streams, the data position, the "
              "GradScaler, the scheduler, the optimizer; or a random generator your Dataset or model "
              "keeps itself (np.random.default_rng(), random.Random()), which starts over at a "
              "resume: draw from the global streams, which the loop saves and seeds per sample",
    "determinism": "nondeterministic kernels (set run.deterministic=true), or randomness not seeded "
                   "from run.seed (e.g. a DataLoader worker seeding itself from the clock)",
    "data": "the sampler does not resume from the saved position (or counts prefetched batches as "
            "consumed)",
    "eval": "evaluation draws from a training random stream (random validation batches from the "
            "global generator, dropout left on)",
    "ddp": "gradients or losses averaged per rank with local target counts, or each rank reading the "
           "same samples",
}


@dataclass
class Plan:
    config: str
    overrides: list[str]  # the user's
    steps: int
    every: int  # checkpoint and evaluation cadence
    kill_at: int
    nproc: int
    root: Path  # one directory per run below it
    timeout: float


def _args(plan: Plan, name: str, *extra: str) -> list[str]:
    return ["--config", plan.config, *plan.overrides, f"train.max_steps={plan.steps}",
            f"train.ckpt_every={plan.every}", f"train.eval_every={plan.every}", "train.log_every=1",
            "data.log_ids=true", "report.plots=false", "train.keep_last=1",
            "train.early_stop_patience=0", "train.profile=false", "run.resume=auto",
            "run.mirror=",  # the config's mirror is another run's: never resumed from, never pruned
            *extra, f"run.out_dir={plan.root / name}"]


def run(plan: Plan, name: str, *extra: str, nproc: int = 0) -> str | None:
    """Run a job to its end; None if it succeeded, else why not. Run A (the config as given) that
    exits 2 is bad input: BadInput with its error line."""
    print(f"verify: run {name} ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen(jobs.train_cmd(_args(plan, name, *extra), nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=plan.timeout)
    except KeyboardInterrupt:  # Ctrl-C: the run goes too (a `kill -INT` reaches this process only)
        jobs.kill_tree(proc)
        raise
    except subprocess.TimeoutExpired:  # a hang is a failed check, and leaves no worker behind
        jobs.kill_tree(proc)
        out, err = proc.communicate()
        (plan.root / f"{name}.log").write_text(out + err)
        return f"run {name} did not finish within --timeout {plan.timeout:g} s and was killed ({name}.log)"
    (plan.root / f"{name}.log").write_text(out + err)
    if proc.returncode != 0:
        tail = _said(err or out)
        if name == "A" and proc.returncode == EXIT_BAD_INPUT:  # the first run of the config: its input is bad
            raise BadInput(tail)
        return f"run {name} exited {proc.returncode} ({name}.log): {tail}"
    return None


def _said(printed: str) -> str:
    """What a failed run said: its error line (torchrun's summary follows it), or its last lines."""
    lines = printed.strip().splitlines()
    said = [line for line in lines if line.startswith("error: ")]
    return said[0][len("error: "):] if said else " | ".join(lines[-3:])


def _records(plan: Plan, name: str) -> list[dict]:
    return read_records(plan.root / name / "metrics.jsonl")


def _summary(plan: Plan, name: str) -> dict:
    return json.loads((plan.root / name / "summary.json").read_text())


def _first_difference(a: list[dict], b: list[dict], keys=("loss", "grad_norm", "lr"), val: bool = False
                      ) -> str | None:
    """The first step whose `keys` (and with `val`, its validation metrics: state that only
    evaluation reads, such as a normalisation's running statistics) differ between two logs."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return f"steps logged differ ({len(a)} vs {len(b)} records)"
    for x, y in zip(a, b):
        for k in [*keys, *sorted({k for k in (*x, *y) if val and k.startswith("val_")})]:
            if not _same(x.get(k), y.get(k)):
                return f"step {x['step']}: {k} {x.get(k)!r} vs {y.get(k)!r}"
    return None


def _same(a, b) -> bool:
    """Equal, NaN as NaN: a step with no target logs a NaN loss in every run."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def state_diff(a, b, path: str = "") -> list[str]:
    """Where two checkpoint states differ (aside from wall time, metadata and the run directory,
    which differ between any two runs)."""
    if path in ("progress.train_s", "metadata", "config.run.out_dir", "config_sha256"):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys(), key=str)
                for d in (state_diff(a[k], b[k], f"{path}.{k}".lstrip(".")) if k in a and k in b
                          else [f"{path}.{k} (in one only)"])]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_diff(x, y, f"{path}.{i}")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        return [] if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) else [path]
    return [] if a == b else [f"{path} ({a!r} vs {b!r})"]


def _final_state_diff(plan: Plan, a: str, b: str) -> list[str]:
    final = f"checkpoints/step_{plan.steps:08d}"
    return [f"{name}: {d}" for name in ("state.pt", "rng_rank0.pt")
            for d in state_diff(store.load(plan.root / a / final, name),
                                store.load(plan.root / b / final, name))]


def resume(plan: Plan) -> Result:
    cmd = jobs.train_cmd(_args(plan, "R"))
    print(f"verify: run R, killed at step {plan.kill_at} ...", file=sys.stderr, flush=True)
    # Not before a checkpoint is complete: an async write (train.async_save) may still be in flight
    # at the step after it, and a rerun with nothing to resume from proves nothing about resuming.
    latest = plan.root / "R" / "checkpoints" / "latest"
    code, printed = jobs.run_until(cmd, plan.kill_at, timeout=plan.timeout, ready=latest.exists)
    (plan.root / "R.killed.log").write_text(printed)  # the rerun's goes to R.log
    if jobs.TIMED_OUT in printed:  # its SIGKILL was the watchdog's, not the kill at a step
        return Result("resume", False, f"run R did not reach step {plan.kill_at} with a checkpoint complete "
                      f"within --timeout {plan.timeout:g} s and was killed (R.killed.log)")
    if code != -signal.SIGKILL:
        return Result("resume", False, f"run R was to be killed at step {plan.kill_at} but exited "
                      f"{code} (R.killed.log): {_said(printed)}")
    if why := run(plan, "R"):
        return Result("resume", False, why)
    # The path may hold spaces (a --out or project path on macOS).
    m = re.search(r"^resumed from .+ at step (\d+)$", (plan.root / "R.log").read_text(), re.M)
    if not m:
        return Result("resume", False, "the rerun did not resume from a checkpoint", HINTS["resume"])
    killed = max(filter(None, map(jobs.reported_step, printed.splitlines())))
    where = f"killed at step {killed}, resumed at step {m.group(1)}"
    diff = _first_difference(_records(plan, "A"), _records(plan, "R"), val=True)
    if diff:
        return Result("resume", False, f"{where}; first difference: {diff}", HINTS["resume"])
    state = _final_state_diff(plan, "A", "R")
    same_params = _summary(plan, "A")["params_sha256"] == _summary(plan, "R")["params_sha256"]
    if state or not same_params:
        return Result("resume", False, f"{where}; losses identical, but the final state differs in: "
                      f"{', '.join(state[:4]) or 'params_sha256'}", HINTS["resume"])
    return Result("resume", True, f"{where}: all {plan.steps} steps' loss, grad norm, lr and validation "
                  f"identical, params_sha256 identical, final checkpoint state identical")


def determinism(plan: Plan) -> Result:
    if why := run(plan, "B"):
        return Result("determinism", False, why)
    diff = _first_difference(_records(plan, "A"), _records(plan, "B"), val=True)
    same = _summary(plan, "A")["params_sha256"] == _summary(plan, "B")["params_sha256"]
    if diff or not same:
        return Result("determinism", False, f"two identical runs differ: {diff or 'params_sha256'}",
                      HINTS["determinism"])
    return Result("determinism", True, f"two identical runs: all {plan.steps} steps identical, "
                  f"params_sha256 identical")


def data(plan: Plan, n_train: int) -> Result:
    ref, got = ([r["ids"] for r in _records(plan, name)] for name in ("A", "R"))
    flat = [i for ids in got for i in ids]
    windows = [flat[e:e + n_train] for e in range(0, len(flat), n_train)]  # one epoch each
    repeated = sum(len(w) - len(set(w)) for w in windows)
    skipped = len({i for ids in ref for i in ids} - set(flat))
    first = next((s for s, (x, y) in enumerate(zip(ref, got), 1) if x != y), None)
    if first or repeated or skipped:
        where = (f"step {first} is the first whose sample ids differ from the uninterrupted run's"
                 if first else "every step's sample ids are the uninterrupted run's")
        return Result("data", False, f"across the resume: {repeated} samples seen twice within an "
                      f"epoch, {skipped} never seen; {where}", HINTS["data"])
    return Result("data", True, f"{len(flat)} sample ids over {plan.steps} steps identical to the "
                  f"uninterrupted run's at every step; none twice within an epoch of {n_train}")


def evaluation(plan: Plan) -> Result:
    if why := run(plan, "E", "train.eval_every=0"):
        return Result("eval", False, why)
    diff = _first_difference(_records(plan, "A"), _records(plan, "E"))
    if diff:
        return Result("eval", False, f"evaluating every {plan.every} steps changed training: {diff}",
                      HINTS["eval"])
    return Result("eval", True, f"all {plan.steps} training steps identical with evaluation every "
                  f"{plan.every} steps and only at the end")


def batch_norms(model: torch.nn.Module) -> list[str]:
    """Modules that normalise by the batch in training (batch norm, not SyncBatchNorm): their
    statistics are each rank's micro-batch's, so n processes x b cannot equal 1 x n*b."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)]


def dropouts(model: torch.nn.Module) -> list[str]:
    """Dropout modules that drop (p > 0) in the model as the ddp check builds it: each rank draws
    its own masks, so n processes x b cannot equal 1 x n*b. No `model.dropout` key turns them off."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]


def ddp(plan: Plan, batch: int, tolerance: float, norms: list[str], quiet: list[str],
        drops: list[str] = ()) -> Result:
    """`norms`: the model's batch_norms, `drops`: its dropouts left on, which the hint names: the
    usual cause is then the model's. `quiet`: the overrides that take the model's randomness away
    (model.dropout=0, if it has one)."""
    n = plan.nproc
    why = run(plan, "P", *quiet, f"data.batch_size={batch}", nproc=n) or \
        run(plan, "P1", *quiet, f"data.batch_size={n * batch}")
    if why:
        return Result("ddp", False, why)
    a, b = _records(plan, "P1"), _records(plan, "P")
    same_ids = [r["ids"] for r in a] == [r["ids"] for r in b]
    worst = max((abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-30) for x, y in zip(a, b)
                 if not _same(x["loss"], y["loss"])), default=0.0)  # a step with no target: NaN in both
    ok = same_ids and len(a) == len(b) == plan.steps and worst <= tolerance
    hint = HINTS["ddp"]
    if norms and same_ids:
        hint = (f"the model's batch norm ({', '.join(norms)}) normalises by each rank's micro-batch in "
                f"training, so {n} processes cannot equal one with {n} times the batch (on GPUs, "
                f"torch.nn.SyncBatchNorm.convert_sync_batchnorm shares the statistics over ranks)")
    elif drops and same_ids:
        hint = (f"the model's dropout ({', '.join(drops)}) stays on, each rank drawing its own masks, "
                f"so {n} processes cannot equal one with {n} times the batch; give the model's options "
                f"a `dropout` key that sets it (this check sets model.dropout=0)")
    return Result("ddp", ok, f"{n} processes x micro-batch {batch} vs 1 x {n * batch} ({' '.join(quiet) or 'as configured'}): "
                  f"per-step losses within rel. {worst:.1e} (tolerance {tolerance:g}, sums over ranks "
                  f"add in another order); sample ids {'identical' if same_ids else 'DIFFER'}", hint)
