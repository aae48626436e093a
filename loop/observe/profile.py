"""Where a step's time goes: `torch.profiler` over a few steps after warm-up.

    make profile                                  # the default config, 3 warm-up + 5 profiled steps
    python train.py train.profile=true ...

The loop marks its regions with `record_function`: data (waiting for the DataLoader), forward,
backward, optimizer (unscale, clip, finite check, step, zero_grad), and between steps eval and
checkpoint (at train.eval_every and train.ckpt_every: those after steps 3-7 fall in the profiled
steps 4-8). After the profiled steps this prints the fraction of their time in each and the rest
as "other" (logging, Python overhead, idle),
and writes to <out_dir>/profile/: `breakdown.json` and `trace.json`, a Chrome trace that opens in
Perfetto (ui.perfetto.dev) or chrome://tracing. Times are host wall times of the regions; on a GPU,
kernels run asynchronously (the host waits where it first reads a result: the optimizer's finite
check), so on CUDA it also prints the GPU's side from the trace, and writes it to `gpu.json`: how
busy the GPU was, its kernel time a step by kind of kernel, and the kernels that take the most.
"""
from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

REGIONS = ("data", "forward", "backward", "optimizer", "eval", "checkpoint")  # the last two at their intervals


def breakdown(prof: profile, wall_us: float) -> dict[str, float]:
    """Fraction of the profiled steps' wall time in each region, plus `other`; sums to 1. The wall
    time is the loop's own clock: the profiler's own step events can sum to nothing in its averages
    with CUDA activity on (torch 2.11 on an H100). A region's host time is summed over its rows: the
    averages keep, as a row of its own, the GPU-side twin of a region that launches GPU work, with
    no host time (taken alone, forward, backward and optimizer would read 0.0% on a GPU)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages():
        totals[e.key] += e.cpu_time_total
    out = {r: totals[r] / wall_us for r in REGIONS}
    out["other"] = max(0.0, 1.0 - sum(out.values()))
    return out


# Kinds of GPU kernel, by words in their names (first match; lower case): cuBLAS's and cuDNN's
# kernel names, and torch.compile's Triton kernels named for the ops they fuse (triton_tem_: its
# autotuned matmul templates, max-autotune's).
KINDS = (("attention", ("flash", "fmha", "sdpa", "attention", "compute_dot_do_o", "convert_dq")),
         ("convolution", ("convolution", "convolve", "implicit_gemm", "winograd", "dgrad", "wgrad")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "triton_tem")),
         ("softmax, loss", ("softmax", "nll_loss", "cross_entropy")),
         ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
         ("norm", ("layer_norm", "rms_norm", "batch_norm")),
         ("activation", ("gelu", "silu", "relu", "sigmoid", "tanh")))
TOP = 10  # the kernels that take the most time, each by its name, in gpu.json and printed


def gpu_time(trace: dict, steps: int) -> dict | None:
    """The GPU's side of a Chrome trace of `steps` steps: kernel (and copy) ms a step by kind, the
    TOP kernels by name (ms and calls a step), and the share of the time from the first kernel to
    the last that some kernel ran (what is left is the GPU waiting for the host). None for a trace
    with no GPU activity."""
    events = [e for e in trace["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return None
    per_kind: dict[str, float] = collections.defaultdict(float)
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])  # ms, calls
    for e in events:
        name = e["name"].lower()
        kind = "copy" if e["cat"] != "kernel" else next(
            (k for k, words in KINDS if any(w in name for w in words)),
            "other fused (torch.compile)" if name.startswith("triton_") else "other")
        per_kind[kind] += e["dur"] / 1e3 / steps
        per_name[e["name"]][0] += e["dur"] / 1e3 / steps
        per_name[e["name"]][1] += 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals (streams overlap)
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        busy, end = busy + max(0.0, stop - max(start, end)), max(end, stop)
    span = end - min(e["ts"] for e in events)
    return {"ms_per_step": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
            "busy": busy / span if span > 0 else 1.0, "span_ms_per_step": span / 1e3 / steps,
            "top": [{"name": name, "ms_per_step": ms, "calls_per_step": calls / steps}
                    for name, (ms, calls) in top]}


class StepProfiler:
    def __init__(self, out_dir: Path, warmup: int = 3, active: int = 5):
        self.out_dir = out_dir
        self.cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities, on_trace_ready=self._ready,
                            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1))
        self.prof.start()
        self.result: dict[str, float] | None = None
        self.window, self.taken = (warmup + 1, warmup + active), 0  # the profiled steps; steps seen
        self.started = self.ended = time.perf_counter()  # of the profiled steps (set as they go)

    def step(self) -> None:
        """Call once per optimizer step; stops itself after the profiled steps."""
        if self.result is None:
            self.taken += 1
            self.ended = time.perf_counter()  # before the profiler stops and reads its trace
            self.prof.step()  # calls _ready at the end of the window
            if self.taken == self.window[0] - 1:
                self.started = time.perf_counter()

    def _ready(self, prof: profile) -> None:
        if self.taken < self.window[1]:  # stopped early: the steps profiled so far plus the run's end
            return
        self.result = breakdown(prof, 1e6 * (self.ended - self.started))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        (self.out_dir / "breakdown.json").write_text(json.dumps(self.result, indent=1))
        print("step time breakdown (profiled steps):")
        for name, frac in self.result.items():
            print(f"  {name:<10} {100 * frac:5.1f}%")
        print(f"  trace: {self.out_dir / 'trace.json'} (open in ui.perfetto.dev)")
        # The trace as written: the kernels' names and times as a viewer shows them.
        gpu = self.cuda and gpu_time(json.loads((self.out_dir / "trace.json").read_text()),
                                     self.window[1] - self.window[0] + 1)
        if gpu:
            (self.out_dir / "gpu.json").write_text(json.dumps(gpu, indent=1))
            self.print_gpu(gpu)

    @staticmethod
    def print_gpu(gpu: dict) -> None:
        print(f"GPU (profiled steps): {gpu['span_ms_per_step']:.1f} ms a step from the first kernel to the "
              f"last, {100 * gpu['busy']:.1f}% of it busy; kernel time a step by kind:")
        for kind, ms in gpu["ms_per_step"].items():
            print(f"  {kind:<28}{ms:8.2f} ms")
        print(f"the {len(gpu['top'])} kernels that take the most time, ms and calls a step:")
        for k in gpu["top"]:  # a C++ kernel's name runs to its template arguments: its start names it
            print(f"  {k['ms_per_step']:8.2f} ms {k['calls_per_step']:6g} x  {k['name'][:100]}")

    def close(self) -> None:
        if self.result is None:  # the run ended before the profiled steps did: nothing whole to show
            self.prof.stop()
            print(f"note: train.profile: the run ended {self.taken} step(s) in, before the profiled "
                  f"steps did ({self.window[0]}-{self.window[1]} since this start); nothing to report. "
                  f"Raise train.max_steps, or, if it resumed near its end (make profile run twice "
                  f"with the same run.out_dir), give a new run.out_dir.")
