"""Determinism mode (`run.deterministic=true`): the same inputs give the same bits, run after run.

What it sets, before CUDA initialises: `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS needs it for
deterministic matmuls), `torch.use_deterministic_algorithms(True)` (an op with no deterministic
kernel raises instead of silently varying), `cudnn.benchmark=False` and `cudnn.deterministic=True`,
and cuDNN's attention kernel off (its backward has no deterministic mode; torch skips it under the
flag anyway). The fused FlashAttention and memory-efficient kernels stay: under the flag torch runs
their backward passes deterministically (FlashAttention's deterministic mode; no split keys), where
the math kernel would write every T x T score matrix to memory. torch's flag also puts
torch.compile's inductor in its own deterministic mode (`torch._inductor.config.deterministic`): no
kernel is chosen by timing where the choice changes the numbers (a reduction's block size,
coordinate descent on reductions, the max-autotune modes' matmul choice, padding a matmul), so a
run with a cold compile cache builds the kernels a warm one does; `train.compile_options` that
tune those tune less in this mode. A Dataset's random draws need nothing from it: each training
sample is fetched with the streams seeded from its position (loop/data/seeded.py), in workers or
not.

What that guarantees: identical results on the same machine, with the same versions of everything
and the same world size. Not across GPU models, driver/CUDA/torch versions, or process counts.
On the CPU, the loop is already deterministic for a fixed thread count; this mode makes it so on
CUDA too, at some cost in speed.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from loop.device import attention_kernels
from loop.errors import BadInput


def enable() -> Callable[[], None]:
    """Turn determinism mode on. Call before anything touches the GPU. Returns what puts every
    setting back as it was: the flags are the process's, so a notebook calling train.main again
    with the mode off would get it still on (no cuDNN attention, and an error from any op without a
    deterministic kernel)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise BadInput("run.deterministic=true must be applied before CUDA initialises.")
    had_workspace = "CUBLAS_WORKSPACE_CONFIG" in os.environ
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if os.environ["CUBLAS_WORKSPACE_CONFIG"] not in (":4096:8", ":16:8"):
        raise BadInput(f"run.deterministic=true needs CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8; "
                       f"the environment has {os.environ['CUBLAS_WORKSPACE_CONFIG']!r}.")
    cudnn, cuda = torch.backends.cudnn, torch.backends.cuda
    from torch._inductor import config as inductor  # torch's flag sets inductor's: both put back

    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), inductor.deterministic, cudnn.benchmark,
             cudnn.deterministic, cuda.cudnn_sdp_enabled())
    torch.use_deterministic_algorithms(True)
    cudnn.benchmark, cudnn.deterministic = False, True
    cuda.enable_cudnn_sdp(False)

    def restore() -> None:
        on, warn_only, compiler, benchmark, deterministic, cudnn_sdp = saved
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
        inductor.deterministic = compiler
        cudnn.benchmark, cudnn.deterministic = benchmark, deterministic
        cuda.enable_cudnn_sdp(cudnn_sdp)
        if not had_workspace:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

    return restore


def in_effect() -> dict:
    """The settings that decide determinism, as they are now (for metadata.json)."""
    return {"deterministic": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "sdpa_kernels": attention_kernels(),  # in the order torch tries them
            "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF")}
