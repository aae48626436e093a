"""Which device to train on: `train.device=auto` picks cuda > mps > cpu."""
from __future__ import annotations

import torch

from loop.errors import BadInput


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadInput(f"config key train.device: expected auto, cpu, cuda, cuda:N or mps; got {name!r}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"config key train.device: {name!r} asked for, but this machine has no CUDA.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise BadInput(f"config key train.device: {name!r} asked for, but this machine has no MPS.")
    return device
