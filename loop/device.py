"""Which device to train on: `train.device=auto` picks cuda > mps > cpu."""
from __future__ import annotations

import torch

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
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = \
            "tf32" if on else "ieee"
