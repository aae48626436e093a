"""Numeric precision: which autocast dtype, and whether fp16 needs a GradScaler.

    auto -> bf16 on CUDA cards that support it, else fp16 (+ GradScaler) on CUDA, else fp32.
    bf16 -> autocast to bfloat16 (also works on CPU). fp16 -> autocast float16 + GradScaler.
    fp32 -> no autocast.
The GradScaler object always exists (disabled outside fp16) so the loop has one code path; its
`state_dict()` goes into the checkpoint, so the loss scale survives a resume.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


class Precision:
    def __init__(self, precision: str, device: torch.device):
        self.name = resolve(precision, device)
        self.dtype = DTYPES[self.name]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.name == "fp16")

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
