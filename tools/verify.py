"""make verify: a one-command proof that a training setup (yours: your model, data and config) is
honest. It runs short audits on the config as given and prints a table of check, result, numbers.

    make verify                                           # the default config
    make verify ARGS="--config configs/mnist.yaml"        # another config; overrides apply to every run
    python -m tools.verify [--config PATH] [--steps 20] [--nproc 2] [--checks resume,data] [--keep]
                          [section.key=value ...]

    resume        N steps straight vs the same run SIGKILLed at a random step and rerun: every
                  step's loss, grad norm and lr, params_sha256 and the final checkpoint identical
    determinism   two identical runs give identical losses and weights
    accumulation  grad_accum k x micro-batch b vs 1 x k*b: the gradient handed to the optimizer
    clipping      that gradient vs a plain float32 reference, clipped by hand
    data          no sample repeated or skipped across the resume
    eval          evaluating in between does not change training
    ddp           (--nproc n) n processes vs one process with n times the micro-batch

Exit codes: 0 every check passed; 1 a check failed (the table names it, and the usual cause where
its runs finished and differ, or the log of the run that did not finish);
2 bad input (the config); 130 Ctrl-C. The runs go to runs/verify/<time>/, deleted when every check passes
unless --keep (and runs/verify too, if this made it and it is left empty). tools/audit_runs.py and tools/audit_grads.py say how each check works.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from data import DATASETS
from loop import determinism
from loop.build import build_data, build_model
from loop.compiler import WITHOUT_GRAPHS, cuda_graphs
from loop.config.load import DEFAULT_CONFIG, OnlyOnce, load_config
from loop.config.paths import writable_dir
from loop.config.runtime import check_with_world, refuse_auto
from loop.device import pick_device
from loop.distributed.group import Dist
from loop.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, BadInput
from loop.lab import banner
from loop.precision import resolve
from model import MODELS
from tools import audit_runs
from tools.audit_grads import TOLERANCE, Result, arithmetic, gradient_audits

CHECKS = ("resume", "determinism", "accumulation", "clipping", "data", "eval", "ddp")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, action=OnlyOnce)  # as train.py: a second is refused
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (at least 8)")
    p.add_argument("--nproc", type=int, default=0, help="also check n processes against one (ddp)")
    p.add_argument("--checks", help=f"comma-separated subset of {', '.join(CHECKS)} (default: all; ddp with --nproc)")
    p.add_argument("--kill-at", type=int, help="the step to kill at (default: random)")
    p.add_argument("--out", default="runs/verify", help="where the audit runs go")
    p.add_argument("--keep", action="store_true", help="keep the runs even when every check passes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. optim.lr=3e-4")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the options


def chosen(a: argparse.Namespace) -> list[str]:
    if a.checks is None:
        names = [c for c in CHECKS if c != "ddp" or a.nproc > 1]
    elif not (names := [c for c in a.checks.split(",") if c]):  # `--checks $EMPTY` is no "all"
        raise BadInput(f"--checks: empty; expected some of {', '.join(CHECKS)} (or no --checks, for "
                       f"all).")
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        raise BadInput(f"--checks: unknown check {', '.join(unknown)}; expected some of {', '.join(CHECKS)}.")
    if a.nproc and a.nproc < 2:  # else taken silently, as no ddp check at all
        raise BadInput(f"--nproc: expected 2 or more processes to compare with one; got {a.nproc}.")
    if "ddp" in names and a.nproc < 2:
        raise BadInput("--checks ddp: needs --nproc 2 (or more) processes to compare with one.")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        raise BadInput(f"--timeout: expected a number of seconds > 0, got {a.timeout}.")
    if a.steps < 8:
        raise BadInput(f"--steps: expected at least 8 (a checkpoint, then a kill after it); got {a.steps}.")
    if a.kill_at is not None and not ckpt_every(a.steps) < a.kill_at < a.steps:  # else no kill, or no resume
        raise BadInput(f"--kill-at: expected a step after the first checkpoint (step "
                       f"{ckpt_every(a.steps)}) and before the last ({a.steps}); got {a.kill_at}.")
    return names


def ckpt_every(steps: int) -> int:
    return max(steps // 4, 2)  # a few checkpoints in a run


def audit(a: argparse.Namespace, checks: list[str], root: Path) -> list[Result]:
    cfg = load_config(a.config, a.overrides, DATASETS, MODELS)  # bad input stops here, before anything runs
    check_with_world(cfg, Dist())  # every check runs one process (a fault on rank 1: exit 2, not a FAIL)
    refuse_auto(cfg)
    if cfg.lab.break_:
        print(banner(cfg.lab.break_), flush=True)
    if cfg.run.deterministic:
        determinism.enable()
    checks = without_accumulation_under_cuda_graphs(cfg, checks, asked=a.checks is not None)
    every = ckpt_every(a.steps)
    kill_at = a.kill_at if a.kill_at is not None else random.Random().randint(every + 1, a.steps - 1)
    plan = audit_runs.Plan(a.config, a.overrides, a.steps, every, kill_at, a.nproc, root, a.timeout)
    results = gradient_audits(a.config, a.overrides, set(checks))
    results += single_process_runs(plan, cfg, checks)
    if "ddp" in checks:  # its own runs: it does not need run A
        precision = resolve(cfg.train.precision, pick_device(cfg.train.device))
        quiet = ["model.dropout=0"] if hasattr(cfg.model, "dropout") else []  # each rank draws its own masks
        # The model as the check runs it: a dropout left on then is one no key turns off.
        built = load_config(a.config, [*a.overrides, *quiet], DATASETS, MODELS)
        model = build_model(built.model, build_data(built.data, DATASETS), MODELS)
        results.append(audit_runs.ddp(plan, cfg.data.batch_size, TOLERANCE[arithmetic(precision, model)],
                                      audit_runs.batch_norms(model), quiet, audit_runs.dropouts(model)))
    return sorted(results, key=lambda r: CHECKS.index(r.check))


def without_accumulation_under_cuda_graphs(cfg, checks: list[str], asked: bool) -> list[str]:
    """A run whose CUDA graphs train every step in one micro-batch has no accumulation to audit
    (loop/compiler.py): left out with a word, or bad input where --checks
    names it."""
    if "accumulation" not in checks or not (setting := cuda_graphs(cfg, pick_device(cfg.train.device))):
        return checks
    why = f"{setting} replays CUDA graphs, which train each step in one micro-batch"
    if asked:
        raise BadInput(f"--checks accumulation: {why}; expected the checks without it, or "
                       f"{WITHOUT_GRAPHS} to audit the accumulation.")
    print(f"accumulation: not run: {why}", flush=True)
    return [c for c in checks if c != "accumulation"]


def single_process_runs(plan: audit_runs.Plan, cfg, checks: list[str]) -> list[Result]:
    """resume, determinism, data and eval: each compares its run(s) with the reference run A."""
    wanted = [c for c in ("resume", "determinism", "data", "eval") if c in checks]
    if not wanted:
        return []
    if why := audit_runs.run(plan, "A"):
        return [Result(c, False, why) for c in wanted]
    results = []
    if "resume" in wanted or "data" in wanted:
        resumed = audit_runs.resume(plan)
        results += [resumed] if "resume" in wanted else []
        if "data" in wanted:
            results.append(audit_runs.data(plan, len(build_data(cfg.data, DATASETS).train))
                           if (plan.root / "R" / "summary.json").exists() else  # R ran to its end
                           Result("data", False, f"no resumed run to compare: {resumed.numbers}"))
    if "determinism" in wanted:
        results.append(audit_runs.determinism(plan))
    if "eval" in wanted:
        results.append(audit_runs.evaluation(plan))
    return results


def table(results: list[Result]) -> str:
    lines = [f"{'check':<13} {'result':<6} numbers", "-" * 100]
    lines += [f"{r.check:<13} {'PASS' if r.ok else 'FAIL':<6} {r.numbers}" for r in results]
    hints = [f"  {r.check}: usual cause: {r.hint}" for r in results if not r.ok and r.hint]
    return "\n".join(lines + (["", "failed:", *hints] if hints else []))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        checks = chosen(a)
        writable_dir("option --out", a.out)
        made = [d for d in (Path(a.out), *Path(a.out).parents) if not d.exists()]  # deepest first
        Path(a.out).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=a.out))
        results = audit(a, checks, root)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        if "root" in locals():
            shutil.rmtree(root, ignore_errors=True)
            remove_if_empty(made)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the run under way is stopped with it; what ran so far stays to read
        kept = "root" in locals() and not drop_if_empty(root, made)  # Ctrl-C in the gradient audits: no runs yet
        print(f"\ninterrupted{f': runs so far kept in {root}' if kept else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # a bug in the model or data: its traceback, as train.py gives, and no empty dirs
        if "root" in locals():
            drop_if_empty(root, made)
        raise
    print(table(results), flush=True)
    (root / "verify.json").write_text(json.dumps(
        {"argv": sys.argv, "results": [vars(r) for r in results]}, indent=1))
    failed = [r.check for r in results if not r.ok]
    if failed or a.keep:
        print(f"runs kept in {root}")
    else:
        shutil.rmtree(root)
        remove_if_empty(made)
    return 1 if failed else 0


def drop_if_empty(root: Path, made: list[Path]) -> bool:
    """Remove `root` if nothing was written in it, and the directories main made for --out with it;
    whether it went."""
    if any(root.iterdir()):
        return False
    root.rmdir()
    remove_if_empty(made)
    return True


def remove_if_empty(made: list[Path]) -> None:
    """The directories main made for --out, deepest first, where nothing else was put in them."""
    for d in made:
        with contextlib.suppress(OSError):
            d.rmdir()


if __name__ == "__main__":
    sys.exit(main())
