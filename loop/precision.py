"""Numeric precision: which autocast dtype, and whether fp16 needs a GradScaler.

    auto -> bf16 on CUDA cards that compute in it (Ampere on), else fp16 (+ GradScaler) on CUDA,
            else fp32.
    bf16 -> autocast to bfloat16 (also works on CPU). fp16 -> autocast float16 + GradScaler.
    fp32 -> no autocast.
The GradScaler object always exists (disabled outside fp16) so the loop has one code path; its
`state_dict()` goes into the checkpoint, so the loss scale survives a resume.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from loop.errors import BadInput

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve(precision: str, device: torch.device) -> str:
    if precision != "auto":
        return precision
    if device.type == "cuda":
        # torch also says yes where bf16 is only emulated (before Ampere), slower than fp16 there
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
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


def check_weights(model: torch.nn.Module, precision: Precision, asked: str) -> None:
    """Weights the model keeps in 16 bits, under autocast: bf16 ones under bf16 compute as they are;
    any other pairing fails inside PyTorch: fp16's GradScaler refuses to unscale float16 gradients (at
    the first step, after the run directory is written), and autocast to one 16-bit type over
    weights of the other breaks layers such as LayerNorm (on CPU, in the first forward). A frozen
    parameter has no gradient to unscale: float16 ones train under fp16 (a frozen base, LoRA-style)."""
    for name, p in model.named_parameters():
        if p.dtype in (torch.float16, torch.bfloat16) and precision.dtype is not None \
                and (p.dtype != precision.dtype or (precision.scaler.is_enabled() and p.requires_grad)):
            key = asked if asked == precision.name else f"{asked} ({precision.name} on this device)"
            why = "its GradScaler does not unscale float16 gradients" if p.dtype == precision.dtype \
                else f"autocast to {precision.dtype} does not mix with {p.dtype} weights"
            raise BadInput(f"config key train.precision={key}: the model keeps {name} in {p.dtype}, and "
                           f"{why}; expected float32 weights (autocast computes in {precision.name} "
                           f"where it pays), or train.precision=fp32 to train them in their own dtype.")
