"""data.batch_size=auto: the largest micro-batch that fits the GPU. train.global_batch fixes the
samples of a step, and train.grad_accum makes up the rest (loop/config/runtime.py), so the step's
samples and maths are those of the global batch whatever the card.

A fresh run tries sizes before the model is compiled and wrapped: a forward and backward of the
model as it is (eager, which holds more than the compiled step), under the run's precision, on the
data set's first samples, from the whole per-process share of the global batch down its divisors.
A size fits when it runs with the optimizer's state, DDP's gradient buckets and the EMA copy
already held (a block the size of them). Each process tries its own GPU; all take the smallest.
The model's weights and buffers are put back as they were, and the GPU's peak-memory count
starts again (the run's figures are the run's).

A resumed run takes the micro-batch of the checkpoint it resumes (chosen as the run chooses it,
loop/checkpoint/resume.py): the same bits as a run never stopped. After a change of process
count it takes it where it still divides the per-process share (a process's memory hardly
depends on their number: DDP adds its gradient buckets, and the out-of-memory split is there for
the rest), and tries sizes where it does not.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed
import torch.nn as nn

from loop.checkpoint import resume
from loop.contract import loss_and_sums
from loop.data.bundle import Data
from loop.data.sampler import collate, to_device
from loop.distributed.group import Dist
from loop.errors import BadInput
from loop.guards.oom import out_of_memory, release_memory
from loop.precision import Precision

KEY = "config key data.batch_size=auto"
HELD = "held back for the optimizer state (and DDP's buckets, the EMA, where used)"  # held_beside


def check(cfg, world: int) -> None:
    """What auto needs, refused before anything runs."""
    if cfg.data.batch_size != "auto":
        return
    if not cfg.train.global_batch:
        raise BadInput(f"{KEY}: needs train.global_batch, the samples of a step, which the micro-batches "
                       f"then make up; expected train.global_batch > 0, or a number for data.batch_size.")
    if cfg.train.global_batch % world:
        raise BadInput(f"{KEY}: train.global_batch={cfg.train.global_batch} does not divide over {world} "
                       f"process(es); expected a multiple of {world}.")
    if cfg.train.strategy == "fsdp":
        raise BadInput(f"{KEY}: not under train.strategy=fsdp, where each process holds a shard of the "
                       f"weights, which a try of the whole model says nothing about; expected a number.")


def micro_batch(cfg, model: nn.Module, data: Data, device: torch.device, precision: Precision,
                dist: Dist) -> tuple[int, str]:
    """The micro-batch for data.batch_size=auto, and how it was found (for the console)."""
    share = cfg.train.global_batch // dist.world
    saved = dist.on_main(lambda: resumed_micro_batch(cfg.run, Path(cfg.run.out_dir)))  # one answer
    if saved and share % saved == 0:
        return saved, "the micro-batch of the checkpoint it resumes"
    if device.type != "cuda":
        raise BadInput(f"{KEY}: fits the micro-batch to a CUDA GPU's memory, and this run is on {device}; "
                       f"expected a number for data.batch_size.")
    sizes = divisors(share)
    # DDP wraps the model whenever there is a process group, one process under torchrun too.
    reserve = held_beside(model, torch.distributed.is_initialized(), cfg.ema.enabled)
    fits = largest_that_fits(model, data, sizes, device, precision, reserve)
    everyone = dist.gather_to_main(fits)  # rank 0's list; None on the others
    fits = dist.from_main(None if not everyone or None in everyone else min(everyone))
    if fits is None:
        raise BadInput(f"{KEY}: not even a micro-batch of {sizes[-1]} sample(s) fits on {device} with "
                       f"{reserve / 1e9:.2f} GB {HELD}; expected a smaller model "
                       f"(or model.activation_checkpointing=true where the model has it).")
    return fits, (f"the largest of {', '.join(map(str, sizes))} whose forward and backward fit on every "
                  f"process's GPU with {reserve / 1e9:.2f} GB {HELD}")


def held_beside(model: nn.Module, ddp: bool, ema: bool) -> int:
    """Bytes a training step holds beside the weights, the gradients and the activations (which a
    try makes itself): AdamW's two moments and DDP's gradient buckets, each the size of the
    trainable parameters (a frozen one has neither), and the EMA copy of every parameter and
    buffer, which keeps 16-bit ones in float32 (loop/ema.py)."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    average = sum(t.numel() * (max(t.element_size(), 4) if t.is_floating_point() else t.element_size())
                  for t in (*model.parameters(), *model.buffers()))
    return (2 + ddp) * trainable + ema * average


def divisors(share: int) -> list[int]:
    """The micro-batches that make up `share` exactly, largest first: 48 -> 48, 24, 16, 12, ..., 1."""
    return [d for d in range(share, 0, -1) if share % d == 0]


def largest_that_fits(model: nn.Module, data: Data, sizes: list[int], device: torch.device,
                      precision: Precision, reserve: int) -> int | None:
    """The first of `sizes` whose forward and backward run with `reserve` bytes held beside them;
    None if none does. The model ends where and as it was."""
    home = next(model.parameters()).device
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model.to(device).train()
        for size in sizes:
            fits = runs(model, data, size, device, precision, reserve)
            model.zero_grad(set_to_none=True)
            if fits:
                return size
            release_memory(device)  # what the failed try held, for the next
        return None
    except (torch.OutOfMemoryError, RuntimeError) as e:  # the weights alone do not fit
        if not out_of_memory(e):
            raise
        return None
    finally:
        model.to(home)
        model.load_state_dict(before)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def runs(model: nn.Module, data: Data, size: int, device: torch.device, precision: Precision,
         reserve: int) -> bool:
    """Whether a forward and backward of the data set's first `size` samples run without running out
    of memory, with `reserve` bytes held beside them (their tensors go when this returns)."""
    try:
        held = torch.empty(reserve, dtype=torch.uint8, device=device)
        batch = to_device(collate([data.train[i % len(data.train)] for i in range(size)]), device)
        with precision.autocast():
            loss = loss_and_sums(model(batch))[0]
        loss.backward()
        del held
        return True
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        return False


def resumed_micro_batch(run, out: Path) -> int | None:
    """data.batch_size of the checkpoint this run resumes, as loop/checkpoint/resume.py chooses it
    (and will again, when the run starts), with out_dir locked first: a second run on it stops
    before trying sizes on the GPU the first one uses, and a bad run.resume is named as such. One
    in run.mirror (out_dir's checkpoints gone) is fetched here, as the run would. None: a fresh start."""
    path = resume.choose_locked(out, run, say=lambda _: None)
    if path is None:
        return None
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True, mmap=True)  # verified
    size = state["config"]["data"]["batch_size"]
    return size if isinstance(size, int) else None
