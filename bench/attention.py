"""Attention kernels at one shape: what each costs, and whether its backward repeats bit for bit.

    python -m bench.attention                      # GPT-2 124M's shape: B 16, 12 heads, T 1024, head 64
    python -m bench.attention --batch 32 --reps 20

For each scaled-dot-product attention kernel (flash, cudnn, efficient, math), with torch's
deterministic flag off and on (`run.deterministic=true` sets it): the milliseconds of one causal
forward + backward in bf16 (median of --reps after warm-up), and whether --repeats backward passes
on the same inputs gave the same dq, dk and dv bit for bit. "refused": torch would not run that
kernel in that mode. FlexAttention (a causal block mask, compiled) is measured the same way.
The table goes to the console, the record to bench/results/attention.jsonl. CUDA only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import RESULTS, append_result, command, device_label
from loop.config.arguments import at_least

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def flex():
    """FlexAttention with a causal block mask, compiled (its kernels are generated for the shape)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled, masks = torch.compile(flex_attention), {}

    def attend(q, k, v):
        T = q.shape[-2]
        if T not in masks:
            masks[T] = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device)
        return compiled(q, k, v, block_mask=masks[T])
    return attend


def measure(attend, q, k, v, grad, reps: int, repeats: int) -> dict:
    """ms per forward + backward (median), and whether the backward repeats bit for bit."""
    def once():
        return torch.autograd.grad(attend(q, k, v), (q, k, v), grad)

    first = once()  # warm-up (and compilation), and the reference
    same = all(all(torch.equal(a, b) for a, b in zip(first, once())) for _ in range(repeats - 1))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "repeats": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=at_least(1), default=16)
    p.add_argument("--heads", type=at_least(1), default=12)
    p.add_argument("--seq", type=at_least(1), default=1024)
    p.add_argument("--head-dim", type=at_least(1), default=64)
    p.add_argument("--reps", type=at_least(1), default=10, help="timed calls (default: %(default)s)")
    p.add_argument("--repeats", type=at_least(2), default=5,
                   help="backward passes compared (default: %(default)s)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.attention measures CUDA kernels: no CUDA GPU here.", file=sys.stderr)
        return 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the math kernel's matmuls, flag on
    g = torch.Generator("cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rows = {}
    for flag in (False, True):
        torch.use_deterministic_algorithms(flag)
        for name, backend in [*KERNELS.items(), ("flex", None)]:
            try:
                if backend is None:
                    row = measure(flex(), q, k, v, grad, args.reps, args.repeats)
                else:
                    with sdpa_kernel(backend):
                        row = measure(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                      q, k, v, grad, args.reps, args.repeats)
            except RuntimeError as e:  # "No available kernel", or an op without a deterministic kernel
                row = {"refused": str(e).splitlines()[0][:200]}
            rows[f"{name} deterministic={flag}"] = row
            print(f"{name:10} deterministic={flag!s:5} " + (f"{row['ms']:8.3f} ms  repeats bit for bit: "
                  f"{row['repeats']}" if "ms" in row else f"refused: {row['refused']}"), flush=True)
    torch.use_deterministic_algorithms(False)
    append_result(RESULTS / "attention.jsonl", "bench.attention", argv,
                  {"device": device_label(torch.device("cuda")), "cuda": torch.version.cuda,
                   "shape_bhtd": list(shape), "dtype": "bf16", "causal": True, "reps": args.reps,
                   "repeats": args.repeats, "kernels": rows})
    return 0


if __name__ == "__main__":
    command(main)
