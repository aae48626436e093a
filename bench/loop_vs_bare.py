"""What the honest loop costs: the scaffold's full loop against a bare loop, side by side.

    make bench                                          # default config (CPU here), then ckpt_stall
    python -m bench.loop_vs_bare --steps 50 --warmup 10 --reps 3 [--config C] [key=value ...]
    python -m bench.loop_vs_bare --variant model.activation_checkpointing=true   # a third arm
    python -m bench.loop_vs_bare --variant "data.batch_size=32 train.compile=true"  # one arm, two keys

Each repetition runs every arm once, in fresh processes, the order alternating:
  scaffold  `train.py` as users run it (DataLoader, guards, metrics.jsonl, TensorBoard, telemetry),
            timed by its own interval clock over the steps after warm-up; no evaluation or
            checkpoint falls inside that window (both happen at the end, untimed).
  bare      this file with --bare: the same model, optimizer, schedule, precision, batch size and
            accumulation, on batches of the same dataset collated onto the device before timing;
            forward, backward, unscale, clip, step, zero_grad and nothing else.
  variant   the scaffold with more overrides (e.g. activation checkpointing, compile), one arm
            per --variant (its overrides separated by spaces); the bare loop runs without them.
            A NAME=VALUE whose name is in capitals is set in that arm's environment instead: a
            compiler setting with no config key, e.g. TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1.
The table shows medians: tokens/s, the ratio to bare (of the medians; and "paired", the median of
each repetition's own ratio: its arms run back to back, so the machine's drift between repetitions,
over 20% on a shared 2-core VM, cancels), the micro-batch each arm trained at (data.batch_size=auto's
pick, or what an out-of-memory split left), peak memory (CUDA: max allocated; CPU: the process's
max RSS), the scaffold's data wait, where the device's peak is known, MFU, and the warm-up's
seconds (its steps, compilation included: what a compile mode or compiler setting costs). The record
goes to bench/results/loop_vs_bare.jsonl. A variant arm that fails (its process exits non-zero) is
reported with its log's last lines and left out of the later repetitions; the others run on, the
record names it under "failed", its log is kept in runs/, and the command exits 1. A failed scaffold
or bare arm stops the run: the repetitions before it make the table and the record, and with none
there is no record. Ctrl-C or SIGTERM (a time limit) stops the arm that runs; the runs that finished
make the table and the record ("interrupted" names the arm), and the command exits 130.
A benchmark, not a test: figures depend on the machine and on what else runs on it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, append_result, check_results, command, device_label, sync_device
from data import DATASETS
from loop.build import build_data, build_model
from loop.compiler import check_cuda_graphs, check_options, compile_kwargs
from loop.config.arguments import at_least
from loop.config.load import DEFAULT_CONFIG, load_config
from loop.config.runtime import follow_global_batch
from loop.contract import loss_and_sums
from loop.data.sampler import collate, to_device
from loop.device import pick_device, use_attention_kernel, use_tf32
from loop.errors import EXIT_INTERRUPTED
from loop.optim import build_optimizer
from loop.precision import Precision
from loop.rng import seed_everything
from loop.schedule import build_scheduler
from model import MODELS

ROOT = Path(__file__).resolve().parents[1]
TAIL = 30  # lines of a failed arm's log shown: a traceback's end and the error it ends in
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")  # config keys are dotted and in lower case


def split_variant(tokens: list[str]) -> tuple[list[str], dict[str, str]]:
    """A variant's tokens: its config overrides, and its environment (NAME=VALUE, NAME in capitals)."""
    env = dict(t.split("=", 1) for t in tokens if "=" in t and ENV_NAME.fullmatch(t.split("=", 1)[0]))
    return [t for t in tokens if t.split("=", 1)[0] not in env], env


class ArmFailed(Exception):
    """An arm's process exited non-zero: its exit code, its log and the command that ran it."""

    def __init__(self, arm: str, code: int, log: Path, cmd: list[str]):
        super().__init__(f"{arm} failed (exit {code})")
        self.arm, self.code, self.log, self.cmd = arm, code, log, cmd


class Bare:
    """The bare loop: the run's model, optimizer, schedule and precision built as train.py builds
    them (the same weights from the same seed), and an optimizer step that does the scaffold's
    maths with nothing around it. tests/test_bench.py proves it trains what the scaffold trains.
    One difference, in time nothing: on an fp16 overflow the scaffold holds the LR schedule back
    (it reads the finite check anyway); this loop advances it, as the usual AMP recipe does."""

    def __init__(self, cfg, total_steps: int):
        self.cfg, self.device = cfg, pick_device(cfg.train.device)
        check_cuda_graphs(cfg, self.device)  # as the scaffold: no accumulation over CUDA graphs
        use_tf32(self.device, cfg.train.tf32)
        use_attention_kernel(cfg.train.attention_kernel, self.device)  # the same kernels as the scaffold's
        seed_everything(cfg.run.seed)
        self.data = build_data(cfg.data, DATASETS)
        self.model = build_model(cfg.model, self.data, MODELS).to(self.device)
        if cfg.train.compile:
            self.model.compile(**compile_kwargs(cfg.train))
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, total_steps)
        self.precision = Precision(cfg.train.precision, self.device)

    def step(self, batches: list[dict]) -> int:
        """One optimizer step over a step's micro-batches (on the device); its target count."""
        scaler, clip = self.precision.scaler, self.cfg.train.clip_grad
        n_targets = sum(m["n_targets"] for m in batches)
        for m in batches:
            with self.precision.autocast():
                loss = loss_and_sums(self.model(m))[0]  # a model may return a dict of sums
            scaler.scale(loss * (1 / n_targets)).backward()
        scaler.unscale_(self.optimizer)
        if clip > 0:  # 0 means no clipping, as in the scaffold (clipping to 0 zeroes the gradients)
            # Over the optimizer's parameters in its order, as the scaffold: the norm's sum in
            # another order can differ in its last bit, and then so do the clipped gradients.
            torch.nn.utils.clip_grad_norm_([q for g in self.optimizer.param_groups for q in g["params"]], clip)
        scaler.step(self.optimizer)
        scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return n_targets


def bare(config: str, overrides: list[str], warmup: int, steps: int) -> dict:
    """The bare loop in this process; tokens/s over `steps` steps after `warmup`."""
    cfg = load_config(config, overrides, DATASETS, MODELS)
    follow_global_batch(cfg, 1)  # one process, as the scaffold's arm
    b, k = cfg.data.batch_size, cfg.train.grad_accum
    loop = Bare(cfg, warmup + steps)
    train = loop.data.train
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.run.seed)).tolist()
    # Around the order again where a small dataset has fewer samples, as the scaffold's epochs do.
    micro = [collate([train[order[i % len(train)]] for i in range(j * b, (j + 1) * b)]) for j in range(2 * k)]
    micro = [to_device(m, loop.device) for m in micro]
    two = [micro[:k], micro[k:]]  # two fixed steps' worth, alternating
    w0 = time.perf_counter()
    for n in range(warmup):
        loop.step(two[n % 2])
    sync_device(loop.device)
    tokens, t0 = 0, time.perf_counter()
    for n in range(steps):
        tokens += loop.step(two[n % 2])
    sync_device(loop.device)
    out = {"tokens_per_s": tokens / (time.perf_counter() - t0), "data_wait_pct": 0.0, "micro_batch": b,
           "warmup_s": t0 - w0}
    if loop.device.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(loop.device) / 1e9
    return out


def scaffold_figures(records: list[dict], warmup: int, steps: int, every: int) -> dict:
    """Steady-state figures from a run's metrics.jsonl: the intervals inside (warmup, warmup+steps]."""
    by_step = {r["step"]: r for r in records}
    ends = [by_step[s] for s in range(warmup + every, warmup + steps + 1, every)]
    seconds = sum(r["ms_per_step"] * every for r in ends) / 1000
    tokens, samples = (by_step[warmup + steps][k] - (by_step[warmup][k] if warmup else 0)
                       for k in ("tokens", "samples"))
    data_ms = sum(by_step[s]["data_ms"] for s in range(warmup + 1, warmup + steps + 1))
    # The micro-batch the window ended at: data.batch_size=auto's pick, or smaller after an
    # out-of-memory split, which would make the arm another setting than the one asked for.
    # The warm-up's intervals: from the loop's start, so the first holds the compilation.
    warmup_s = sum(by_step[s]["ms_per_step"] * every for s in range(every, warmup + 1, every)) / 1000
    out = {"tokens_per_s": tokens / seconds, "data_wait_pct": 100 * data_ms / (1000 * seconds),
           "micro_batch": by_step[warmup + steps]["micro_batch"], "warmup_s": warmup_s}
    if "mfu" in ends[-1]:  # MFU is linear in samples/s: rescale one interval's to the whole window
        out["mfu"] = ends[-1]["mfu"] * samples / seconds / ends[-1]["samples_per_s"]
    if "cuda_max_alloc_gb" in ends[-1]:
        out["peak_gb"] = ends[-1]["cuda_max_alloc_gb"]
    return out


def run_arm(arm: str, name: str, extra: list[str], args, workdir: Path) -> dict:
    """One arm in a fresh process, its files under `name` in workdir; adds its max RSS (GB).
    ArmFailed if it exits non-zero."""
    every = math.gcd(args.warmup, args.steps)
    extra, arm_env = split_variant(extra)
    if arm == "bare":
        cmd = [sys.executable, "-m", "bench.loop_vs_bare", "--bare", "--config", args.config,
               "--warmup", str(args.warmup), "--steps", str(args.steps), *args.overrides]
    else:
        out = workdir / name
        shutil.rmtree(out, ignore_errors=True)
        # One interval past the window: a run's last step evaluates (one batch: it is not measured)
        # and checkpoints, which the timed window must not hold (the bare loop does neither).
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", args.config, *args.overrides, *extra,
               f"run.out_dir={out}", "run.resume=never", f"train.max_steps={args.warmup + args.steps + every}",
               f"train.log_every={every}", "train.eval_every=0", "train.eval_batches=1", "train.ckpt_every=0",
               "train.sample_tokens=0", "report.plots=false",
               "run.mirror="]  # the config's mirror holds a real run's checkpoints: never pruned here
    log = workdir / f"{name}.log"
    with open(log, "w") as f:  # files, not pipes, so wait4 can reap it and report its memory
        # In the user's directory, as the config and its paths were checked there; ROOT importable.
        env = {**os.environ, **arm_env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # Ctrl-C, or a signal to the bench: the arm (a GPU's run) stops with it
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise ArmFailed(arm, proc.returncode, log, cmd)
    if arm == "bare":
        figures = json.loads(log.read_text().strip().splitlines()[-1])
    else:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        figures = scaffold_figures(records, args.warmup, args.steps, every)
    return {**figures, "max_rss_gb": usage.ru_maxrss / 1e6}  # Linux reports kB


def run_reps(arms: dict, names: dict, args, workdir: Path, runs: dict, failed: dict, current: list) -> None:
    """Every arm once a repetition, in fresh processes, the order alternating; figures into `runs`,
    failures into `failed`; `current` names the arm that runs."""
    for rep in range(args.reps):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]  # drift hits every arm alike
        for arm in (a for a in order if a not in failed):  # a failure repeats: its time for nothing
            current[:] = [f"{arm} in rep {rep + 1}/{args.reps}"]
            try:
                runs[arm].append(run_arm(arm, names[arm], arms[arm], args, workdir))
            except ArmFailed as e:
                failed[arm] = e
                e.log = e.log.replace(workdir.parent / f"{workdir.name}-{e.log.name}")  # kept after the run
                tail = "\n".join(e.log.read_text(errors="replace").splitlines()[-TAIL:])
                print(f"rep {rep + 1}/{args.reps} {arm}: failed (exit {e.code}): {' '.join(e.cmd)}\n"
                      f"{tail}\n(the whole log: {e.log})", file=sys.stderr, flush=True)
                if arm in ("scaffold", "bare"):  # every figure is a ratio of the two: stop here
                    return
                continue
            print(f"rep {rep + 1}/{args.reps} {arm}: {runs[arm][-1]['tokens_per_s']:,.0f} tok/s", flush=True)
        current.clear()


@contextlib.contextmanager
def terminate_as_interrupt():
    """A time limit's SIGTERM (`timeout`, a GPU lease, a scheduler) taken as Ctrl-C: the arm that
    runs is killed (run_arm), and the arms that finished still make the table and the record."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML preset (default: %(default)s)")
    p.add_argument("--steps", type=at_least(1), default=50, help="timed steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=at_least(0), default=10, help="untimed steps first (default: %(default)s)")
    p.add_argument("--reps", type=at_least(1), default=3, help="runs of each arm (default: %(default)s)")
    p.add_argument("--variant", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="also run the scaffold with these overrides (repeatable: an arm each); NAME=VALUE "
                        "with NAME in capitals: an environment variable of that arm")
    p.add_argument("--results", type=Path, default=RESULTS / "loop_vs_bare.jsonl")
    p.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # one bare run (internal)
    p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. data.batch_size=8")
    args = p.parse_args(argv)
    if args.bare:
        print(json.dumps(bare(args.config, args.overrides, args.warmup, args.steps)))
        return 0
    cfg = load_config(args.config, args.overrides, DATASETS, MODELS)  # bad input fails here, before any run
    device = pick_device(cfg.train.device)  # no CUDA context yet: the runs' processes have the GPU
    check_options(cfg.train)
    for v in args.variant:
        arm = load_config(args.config, [*args.overrides, *split_variant(v.split())[0]], DATASETS, MODELS)
        pick_device(arm.train.device)
        check_options(arm.train)
    check_results(args.results)
    arms = {"scaffold": [], "bare": [], **{v: v.split() for v in args.variant}}
    # Files named by place, not by overrides, whose values may be paths or longer than a file name
    names = {arm: arm if i < 2 else f"variant{i - 1}" for i, arm in enumerate(arms)}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    Path("runs").mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-loop-vs-bare-", dir="runs"))
    failed: dict[str, ArmFailed] = {}
    current: list[str] = []  # the arm running: the one a Ctrl-C or a time limit stops
    interrupted = ""
    try:
        with terminate_as_interrupt():
            run_reps(arms, names, args, workdir, runs, failed, current)
    except KeyboardInterrupt:
        interrupted = current[0] if current else "between arms"
        print(f"interrupted: {interrupted}; the runs that finished make the table and the record",
              file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not (runs["scaffold"] and runs["bare"]):
        missing = " and ".join(a for a in ("scaffold", "bare") if not runs[a])
        print(f"error: the {missing} arm {'did not finish' if interrupted else 'failed at'} its first run: no "
              f"ratio to bare without it, so no table and no record. "
              f"{'Run again' if interrupted else 'Fix what its log says, then run again'}.", file=sys.stderr)
        return EXIT_INTERRUPTED if interrupted else 1
    runs = {arm: rs for arm, rs in runs.items() if rs}  # an arm that failed at its first run has none
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    bare_tps = med["bare"]["tokens_per_s"]
    paired = {arm: statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, runs["bare"]))
              for arm, rs in runs.items()}
    device = device_label(device)
    print(f"\n{device} | torch {torch.__version__} | {os.cpu_count()} CPUs | {args.config} "
          f"{' '.join(args.overrides)} | medians of {args.reps} runs, {args.steps} steps after "
          f"{args.warmup} warm-up")
    print(f"{'arm':<40}{'tokens/s':>11}{'vs bare':>9}{'paired':>8}{'micro':>7}{'peak GB':>9}"
          f"{'max RSS GB':>11}{'data wait':>10}{'MFU':>7}{'warm-up s':>10}")
    for arm, m in med.items():
        mfu = f"{100 * m['mfu']:.1f}%" if "mfu" in m else "-"
        peak = f"{m['peak_gb']:.2f}" if "peak_gb" in m else "-"
        print(f"{arm:<40}{m['tokens_per_s']:>11,.0f}{m['tokens_per_s'] / bare_tps:>9.3f}{paired[arm]:>8.3f}"
              f"{m['micro_batch']:>7g}{peak:>9}"
              f"{m['max_rss_gb']:>11.2f}{m['data_wait_pct']:>9.2f}%{mfu:>7}{m['warmup_s']:>10.1f}")
    for arm, e in failed.items():
        print(f"failed: {arm} (exit {e.code}), {len(runs.get(arm, []))} of its {args.reps} runs in the table; "
              f"its log: {e.log}")
    if interrupted:
        print(f"interrupted: {interrupted}; the table holds the runs that finished")
    append_result(args.results, "bench.loop_vs_bare", argv, {
        "device": device, "config": args.config, "overrides": args.overrides, "steps": args.steps,
        "warmup": args.warmup, "reps": args.reps, "median": med,
        "ratio_to_bare": {arm: m["tokens_per_s"] / bare_tps for arm, m in med.items()},
        "paired_ratio_to_bare": paired, "runs": runs,
        "failed": {arm: e.code for arm, e in failed.items()}, "interrupted": interrupted or None})
    return EXIT_INTERRUPTED if interrupted else 1 if failed else 0


if __name__ == "__main__":
    command(main)
