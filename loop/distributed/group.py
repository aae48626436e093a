"""One code path for one or many processes, detected from the torchrun environment.

    python train.py ...                            world size 1, no process group
    torchrun --nproc_per_node=8 train.py ...       RANK / LOCAL_RANK / WORLD_SIZE set by torchrun

Under torchrun the process group and the DDP/FSDP wrapping are set up even for one process, so
`torchrun --nproc_per_node=1` runs the distributed path (nccl on one GPU) and can resume a
sharded checkpoint written by any number of processes.

With CUDA each process takes GPU LOCAL_RANK (`set_device` before `init_process_group`) and talks
nccl; otherwise gloo. Small host-side agreements (target counts, which checkpoint to load) go
through a gloo group on the CPU, so they never wait on the GPU stream. `close()` on every exit.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loop.device import cuda_devices, pick_device
from loop.errors import BadInput


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

    def on_main(self, fn):
        """Run `fn` on rank 0 only and hand its result, or its BadInput, to every rank."""
        out = None
        if self.main:
            try:
                out = ("ok", fn())
            except BadInput as e:
                out = ("bad", str(e))
        kind, value = self.from_main(out)
        if kind == "bad":
            raise BadInput(value)
        return value

    def say(self, *args, **kwargs) -> None:
        """print on rank 0 only."""
        if self.main:
            print(*args, **kwargs, flush=True)

    def sync_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers on every rank, as DDP does before a step's first forward: a buffer a forward
        updates (BatchNorm's running statistics) moves with each rank's own data, and a checkpoint
        keeps one copy of it. A model without buffers (the GPT) costs nothing."""
        if self.world > 1:
            for buf in module.buffers():
                dist.broadcast(buf, src=0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.cpu_group)

    def for_thread(self) -> Dist:
        """The same ranks on a gloo group of their own (a collective: every rank calls it), for a
        background thread's collectives, which must not interleave with the training thread's."""
        if self.world == 1:
            return self
        return Dist(self.rank, self.local_rank, self.world, dist.new_group(backend="gloo"))


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # torchrun sets them


def init(device_name: str, cpu_offload: bool = False) -> tuple[Dist, torch.device]:
    """`cpu_offload`: gloo beside nccl, for the offloaded gradients' norm (pytorch#148532)."""
    if "RANK" not in os.environ:  # not launched by torchrun
        return Dist(), pick_device(device_name)
    missing = [k for k in LAUNCH_VARS if not os.environ.get(k)]
    if missing:
        raise BadInput(f"environment variable RANK is set, so this is a multi-process launch, but "
                       f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not; expected all of "
                       f"{', '.join(LAUNCH_VARS)}, as torchrun sets them. Launch with `torchrun "
                       f"--nproc_per_node=N train.py ...` (scripts/slurm.sbatch under SLURM), or unset "
                       f"RANK to train in one process.")
    try:
        rank, local, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        got = ", ".join(f"{k}={os.environ[k]!r}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        raise BadInput(f"environment variables RANK, LOCAL_RANK and WORLD_SIZE: expected integers; "
                       f"got {got}.") from None
    if not (0 <= rank < world and local >= 0):  # RANK 3 of 2 would wait forever for its peers
        raise BadInput(f"environment variables RANK={rank}, LOCAL_RANK={local}, WORLD_SIZE={world}: "
                       f"expected 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0.")
    if not (port := os.environ["MASTER_PORT"]).isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"environment variable MASTER_PORT: expected a port from 1 to 65535; got {port!r}.")
    # Before any process group exists: importing torch._dynamo (building the optimizer does) takes
    # references to every group that exists then, which destroy_process_group does not drop: their
    # gloo threads would outlive close() into interpreter shutdown (see close).
    import torch._dynamo  # noqa: F401

    device = pick_device(device_name)
    if device.type == "cuda":
        if local >= (n := torch.cuda.device_count()):  # else "invalid device ordinal" from set_device
            raise BadInput(f"LOCAL_RANK={local}, but this machine has {cuda_devices(n)}: one process per "
                           f"GPU, so expected at most {n} processes per node (torchrun "
                           f"--nproc_per_node={n}).")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl" if cpu_offload else "nccl", device_id=device)
        cpu_group = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo")
        cpu_group = dist.group.WORLD
    return Dist(rank, local, world, cpu_group), device


def close() -> None:
    """Tear the process groups down; safe to call on every exit path, with or without one.

    A group's gloo worker threads stop only when the last reference to the group goes. FSDP's
    DeviceMeshes hold their groups (`_pg_registry`), and DTensor's sharding and redistribution
    caches hold the meshes for the life of the process, so without the clearing below those threads
    outlive destroy_process_group into interpreter shutdown. A worker still letting go of its last
    collective's tensors then needs the GIL, and taking it during shutdown ends the thread in a way
    C++ answers with std::terminate: the rank aborts ("terminate called without an active
    exception") after a run that finished, and torchrun reports the job failed. tests/exit_threads.py
    shows the threads gone."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # a trainer in a reference cycle still holds its model's meshes and groups
    for obj in gc.get_objects():
        # By type, not isinstance: DeviceMesh's metaclass answers isinstance by reading the
        # object's attributes, and torch.distributed.reduce_op's warn that they are deprecated.
        if issubclass(type(obj), DeviceMesh):
            obj._pg_registry.clear()  # the meshes are unusable from here on anyway
