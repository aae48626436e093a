"""One code path for one or many processes, detected from the torchrun environment.

    python train.py ...                            world size 1, no process group
    torchrun --nproc_per_node=8 train.py ...       RANK / LOCAL_RANK / WORLD_SIZE set by torchrun

With CUDA each process takes GPU LOCAL_RANK (`set_device` before `init_process_group`) and talks
nccl; otherwise gloo. Small host-side agreements (target counts, which checkpoint to load) go
through a gloo group on the CPU, so they never wait on the GPU stream. `close()` runs on every
exit path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loop.device import pick_device


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    cpu_group: object = None  # gloo group for host-side values

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum_host(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a few host numbers (CPU collective, no GPU sync)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.cpu_group)
        return t.tolist()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a device tensor."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def from_main(self, obj):
        """rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_to_main(self, obj) -> list | None:
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.cpu_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init(device_name: str) -> tuple[Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), pick_device(device_name)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        cpu_group = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo")
        cpu_group = dist.group.WORLD
    return Dist(rank, local, world, cpu_group), device
