"""Which device to train on (`train.device=auto` picks cuda > mps > cpu), and the process-wide
kernel choices made for it: TF32 matmuls (`train.tf32`), the attention kernel tried first
(`train.attention_kernel`).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend

from loop.errors import BadInput


def pick_device(name: str, key: str = "config key train.device") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):  # xpu, meta: a traceback later
        raise BadInput(f"{key}: expected auto, cpu, cuda, cuda:N or mps; got {name!r}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"{key}: {name!r} asked for, but this machine has no CUDA.")
    if device.type == "cuda" and (device.index or 0) >= (n := torch.cuda.device_count()):
        raise BadInput(f"{key}: {name!r} asked for, but this machine has {cuda_devices(n)}.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise BadInput(f"{key}: {name!r} asked for, but this machine has no MPS.")
    return device


def cuda_devices(n: int) -> str:
    """e.g. '2 visible CUDA devices (cuda:0 to cuda:1)': what an index out of range is told."""
    return f"{n} visible CUDA device{'s' if n != 1 else ''} (cuda:0{f' to cuda:{n - 1}' if n > 1 else ''})"


def use_tf32(device: torch.device, on: bool) -> None:
    """CUDA (Ampere and later): float32 matmuls and convolutions on TF32 tensor cores, several
    times the plain FP32 rate, with products rounded to a 10-bit mantissa (sums stay float32)."""
    if device.type == "cuda":
        # The global setting too: inductor's autotuning (train.compile_mode=max-autotune...) reads it,
        # and reading it raises where it disagrees with the CUDA one (pytorch/pytorch#196728). It
        # sets the CPU's (mkldnn) matmuls as well, which keep theirs.
        cpu = torch.backends.mkldnn.matmul.fp32_precision
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.mkldnn.matmul.fp32_precision = cpu
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = \
            "tf32" if on else "ieee"


# The fused kernels behind `scaled_dot_product_attention`, by the names the config uses.
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
TORCH_ORDER = tuple(torch._C._get_sdp_priority_order())  # as the process started, before any change


def torch_order(device: torch.device) -> tuple[int, ...]:
    """torch's own order of the attention kernels: on CUDA, as torch settles it at its first
    attention call, replacing any order set before (cuDNN's first on sm90 and sm100 cards, the
    H100, H200 and B200, with cuDNN above 9.15, as torch 2.11's CUDA 13 build has it); else as the
    process started. Choosing a kernel for a tiny input makes torch settle it now."""
    return _settled(device) if device.type == "cuda" else TORCH_ORDER


@functools.cache
def _settled(device: torch.device) -> tuple[int, ...]:
    q = torch.zeros(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
    torch._fused_sdp_choice(q, q, q)
    return tuple(torch._C._get_sdp_priority_order())


def use_attention_kernel(name: str, device: torch.device) -> None:
    """Put one attention kernel first in the order torch tries them on CUDA (`auto`: torch's own
    order). Where the first cannot run (a head size, a dtype, a mask, or determinism mode turning
    it off) torch falls back to the next. Set for the process, as TF32 is: torch's public way,
    `sdpa_kernel(..., set_priority=True)`, is a context manager, and the run, its compilation and
    its evaluations all need the one order. The CPU has one fused kernel, which it picks whatever
    the order."""
    order = list(torch_order(device))
    if name != "auto":
        first = int(SDPA[name])
        order = [first, *(b for b in order if b != first)]
    torch._C._set_sdp_priority_order(order)


def attention_kernels() -> list[str]:
    """The attention kernels torch may pick on CUDA, in the order it tries them."""
    cuda, names = torch.backends.cuda, {int(b): n for n, b in SDPA.items()}
    enabled = {"flash": cuda.flash_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled(),
               "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}
    return [names[b] for b in torch._C._get_sdp_priority_order() if b in names and enabled[names[b]]]
