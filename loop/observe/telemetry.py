"""What the loop reads from the host at each log interval: CUDA memory, NVML readings (GPU
utilisation, memory, power, temperature, energy) and MFU. None of it touches the GPU stream:
memory counters and NVML are host calls, and MFU is arithmetic on the measured samples/s.

MFU = samples/s x the data's seq_len x the model's FLOPs per token (per unit of seq_len: a
classifier's seq_len is 1) / peak FLOP/s of all the run's devices: the model computes every
position, whether or not its target counts (-100), so targets/s would understate it. It is
reported only for models that count their FLOPs (`flops_per_token()`, loop/observe/mfu.py) on
devices in the peak table.
"""
from __future__ import annotations

import os

import torch

from loop.observe.gpu import GpuSampler
from loop.observe.mfu import mfu, peak_flops


def node_gpus(device: torch.device) -> dict[int, str] | None:
    """The GPUs this node's processes train on (torchrun: cuda:0 to cuda:LOCAL_WORLD_SIZE-1, one
    each), by CUDA index -> NVML UUID: summing every GPU NVML sees would count a shared machine's other jobs
    included. None for a run on the CPU (or MPS): no GPU of its own to read."""
    if device.type != "cuda":
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    indices = range(local) if local else [torch.cuda.current_device() if device.index is None else device.index]
    return {i: f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in indices}  # NVML's spelling


class Telemetry:
    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str, world: int,
                 positions: int = 1):
        """`positions`: the input positions of a sample (the data's seq_len)."""
        self.device = device
        gpus = node_gpus(device)  # the sampler says once that it is off without NVIDIA
        self.gpu = GpuSampler(devices=gpus) if gpus else None
        self.flops = model.flops_per_token() * positions if hasattr(model, "flops_per_token") else None  # a sample's
        if precision == "fp32" and device.type == "cuda" and torch.backends.cuda.matmul.fp32_precision == "tf32":
            precision = "tf32"
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        peak = peak_flops(name, precision)
        self.peak = peak * world if peak else None  # every process drives one such device

    def read(self, now: bool = False) -> dict:
        """The latest readings; `now`: NVML read first (the run's end: its energy to the last step,
        not the sampler's last tick, which a run shorter than its interval never saw)."""
        out = (self.gpu.sample_once() if now else self.gpu.read()) if self.gpu else {}
        if self.device.type == "cuda":
            gb = 1e9
            out.update({"cuda_alloc_gb": torch.cuda.memory_allocated(self.device) / gb,
                        "cuda_reserved_gb": torch.cuda.memory_reserved(self.device) / gb,
                        "cuda_max_alloc_gb": torch.cuda.max_memory_allocated(self.device) / gb})
        return out

    def mfu(self, samples_per_s: float) -> float | None:
        """None for a model that does not count its FLOPs, or a device without a known peak."""
        return None if self.flops is None else mfu(samples_per_s, self.flops, self.peak)

    def close(self) -> None:
        if self.gpu:
            self.gpu.close()
