"""MFU (model FLOPs utilisation): achieved model FLOP/s over the device's peak dense FLOP/s.

A model that can count its training FLOPs per token has a `flops_per_token()` method (the example GPT
counts PaLM's 6N + attention); for others no MFU is reported. Peaks are vendor datasheet numbers,
dense (the "with sparsity" figures halved), per GPU, TFLOPS. Use per-GPU tokens/s with a per-GPU
peak (or global tokens/s with peak * world size).
"""
from __future__ import annotations

import re

# Matching: keys are lower-case words that must ALL occur as whole words in the lower-cased
# `torch.cuda.get_device_name()` string; the first key that matches wins, so specific parts (PCIe,
# NVL) come before the generic name, and "l4" does not match "NVIDIA L40S", nor "h200" "GH200".
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper (table "H100 PCIe"); datasheet: 1513*/756*
    "h100 pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column: BF16/FP16 1671*, TF32 835*, FP32 60
    "h100 nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column: same figures as H100 NVL
    "h200 nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # H100 whitepaper, "H100 SXM5": FP16/BF16 989.4, TF32 494.7, FP32 66.9 (torch: "NVIDIA H100 80GB HBM3")
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    # NVIDIA H200 datasheet, H200 SXM column (1979*, 989*, 67), and GH200 Grace Hopper datasheet:
    # the same Hopper tensor throughput as H100 SXM
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    # NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe columns identical): 312, 156, 19.5
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # NVIDIA L40S datasheet: BF16/FP16 362.05 | 733*, TF32 183 | 366*, FP32 91.6
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # NVIDIA L4 Tensor Core GPU datasheet: BF16/FP16 242*, TF32 120*, FP32 30.3
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
}
PRECISIONS = ("bf16", "fp16", "fp32", "tf32")


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak dense FLOP/s of one device for `precision`; None when the device is not in the table.

    "fp32" means plain FP32 (CUDA cores); pass "tf32" when TF32 matmuls are enabled."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    name = device_name.lower()
    for key, peaks in PEAK_TFLOPS.items():
        if all(re.search(rf"\b{re.escape(word)}\b", name) for word in key.split()):
            return peaks[precision] * 1e12
    return None


def mfu(per_s: float, flops_each: float, peak: float | None) -> float | None:
    """Fraction of peak (0..1): per_s * flops_each / peak (tokens/s and FLOPs per token, or samples/s
    and FLOPs per sample); None when peak is unknown."""
    if peak is None:
        return None
    return per_s * flops_each / peak
