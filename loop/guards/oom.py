"""Out of memory: a step that runs out is retried in smaller micro-batches (train.oom_policy=split)
where nothing crossed the ranks yet, and the allocator is set up to run out less.

Up to the last micro-batch's backward, DDP ranks run no collective that an out of memory could
leave waiting (DDP's broadcast of a model's buffers comes first in a step's first forward, before
anything is allocated): each gets that far, and there all agree whether any ran out
(`Attempt.agree`) before any rank starts reducing gradients. Then
every rank retries the same samples with the micro-batch halved: the same global batch, the same
maths. Out of memory inside a collective (that last backward with other ranks, or any forward or
backward under FSDP, which gathers each block's weights from all ranks) cannot be undone: the
others wait in a collective this rank never joins. That rank gives up (exit 3) and torchrun stops
the others; rerunning resumes from the newest checkpoint.
"""
from __future__ import annotations

import gc
import os
import sys
from contextlib import contextmanager

import torch

from loop.compiler import WITHOUT_GRAPHS
from loop.distributed.group import Dist
from loop.distributed.wrap import ddp, is_ddp
from loop.errors import GaveUp
from loop.progress import Progress

UNDER_FSDP = "in forward or backward under FSDP, which gathers each block's weights from all ranks"
LAST_BACKWARD = "in the last micro-batch's backward, where gradients are reduced over the ranks"


def configure_allocator() -> str:
    """Turn on expandable segments (less fragmentation, so fewer OOMs after a batch-size change)
    in both spellings of the allocator variable, keeping whatever else the user set. Must run
    before CUDA initialises; returns the setting in effect."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        current = os.environ.get(var, "")
        if "expandable_segments" not in current:
            os.environ[var] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return os.environ["PYTORCH_ALLOC_CONF"]


def out_of_memory(e: BaseException) -> bool:
    """torch's own out-of-memory error, or a CUDA library's failure to allocate outside torch's
    allocator, a RuntimeError: cuBLAS creating the backward thread's handle at the first backward
    pass (`CUBLAS_STATUS_ALLOC_FAILED`), with the forward's activations filling the card. A smaller
    micro-batch leaves it room, as for any out-of-memory."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError)
                                                     and "_ALLOC_FAILED" in str(e))


def beyond_split(e: torch.OutOfMemoryError) -> str:
    """Exit 3's message for an out-of-memory error outside a step's forward and backward (AdamW's
    first step making its two moments, evaluation), where a smaller micro-batch cannot retry it."""
    first = (str(e).strip().splitlines() or ["OutOfMemoryError"])[0]
    return (f"out of memory outside a training step's forward and backward ({first}); a smaller "
            f"micro-batch cannot retry it. The checkpoints are whole: rerun with a smaller model or "
            f"data.batch_size, or shard the model's state (train.strategy=fsdp), to continue.")


def release_memory(device: torch.device) -> None:
    """After an out-of-memory error, before a smaller try: free what a reference cycle through the
    dropped error's traceback still holds of the failed try (its activations, up to a whole GPU,
    until the collector runs), then hand torch's cache back to the driver, where CUDA libraries
    allocate (cuBLAS's handles)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def resplit(progress: Progress, was: int, now: int) -> str | None:
    """A resume with another data.batch_size than the checkpoint's run, whose split (Progress.
    micro_split) was for its own size: cut the new size so that no micro-batch is larger than the
    one known to fit, and none smaller than that needs (whole, where it fits). What it did, for a
    note; None where there was no split or the size is the same."""
    if was == now or progress.micro_split == 1:
        return None
    if type(was) is not int or was < 1:  # an edited checkpoint's: no split would ever make it fit
        raise ValueError(f"its config's data.batch_size is {was!r}; expected a positive integer")
    fits, split = -(-was // progress.micro_split), 1
    while -(-now // split) > fits:
        split *= 2
    progress.micro_split = split
    return (f"the checkpoint's run trained data.batch_size={was} in micro-batches of {fits} after running "
            f"out of memory; data.batch_size={now} now trains in micro-batches of {-(-now // split)}")


class _OtherRank(Exception):
    """Another rank ran out of memory: this one skips its last backward and retries too."""


class Attempt:
    """One try at a step's forward and backward passes (`OutOfMemory.attempt`)."""

    def __init__(self, dist: Dist):
        self.dist, self.at_last_backward, self.failed = dist, False, False

    def agree(self) -> None:
        """Before the last backward, where gradients cross ranks: did any rank run out of memory?"""
        self.at_last_backward = True
        if self.dist.sum_host([0.0])[0]:
            raise _OtherRank


class OutOfMemory:
    def __init__(self, policy: str, batch_size: int, progress: Progress, dist: Dist, sharded: bool,
                 model: torch.nn.Module | None = None, global_batch: bool = False, graphs: str = ""):
        """`model`: as wrapped for the run. The guard keeps the module inside, never a DDP around it (one
        held here would outlive the split that replaces it), and names the module's own way to use less
        memory, if it has one, in the messages. `global_batch`: train.global_batch is set, so the
        accumulation follows data.batch_size. `graphs`: the setting whose CUDA graphs the run
        replays, which cannot accumulate over a split's micro-batches (loop/compiler.py)."""
        self.policy, self.batch_size, self.progress, self.graphs = policy, batch_size, progress, graphs
        self.dist, self.sharded = dist, sharded
        self.model = model.module if is_ddp(model) else model
        self.find_unused = is_ddp(model) and model.find_unused_parameters  # for rewrap()
        switch = hasattr(self.model, "set_activation_checkpointing")
        self.hint = ", or model.activation_checkpointing=true" if switch else ""
        self.smaller = ("a smaller data.batch_size (train.global_batch keeps the step), or "
                        "data.batch_size=auto" if global_batch else
                        "a smaller data.batch_size and a larger train.grad_accum (the same global batch)")

    def micro_batch(self) -> int:
        return -(-self.batch_size // self.progress.micro_split)

    @contextmanager
    def attempt(self):
        """Catches an out-of-memory error in the block, tells the other ranks (or ends the run where
        it cannot be retried), and sets `.failed` on every rank if any ran out. The error is dropped
        on leaving, with the tensors its traceback held."""
        a = Attempt(self.dist)
        try:
            yield a
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            if self.sharded:
                self.in_collectives(UNDER_FSDP)
            if a.at_last_backward and self.dist.world > 1:  # alone, a fresh DDP starts clean (split)
                self.in_collectives(LAST_BACKWARD)
            if not a.at_last_backward:
                self.dist.sum_host([1.0])  # what the others' agree() waits for
            a.failed = True
        except _OtherRank:
            a.failed = True

    def in_collectives(self, where: str) -> None:
        p = self.progress
        raise GaveUp(f"rank {self.dist.rank}: step {p.step + 1}: out of memory {where} (micro-batch "
                     f"{self.micro_batch()}). Collectives over the ranks were under way, so it cannot "
                     f"be retried in place. Rerun with {self.smaller}{self.hint}.")

    def split(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        """train.oom_policy: halve the micro-batch (the same samples are retried), or give up. Under
        DDP the caller then drops its model and takes rewrap()'s."""
        p, size = self.progress, self.micro_batch()
        optimizer.zero_grad(set_to_none=True)
        release_memory(device)
        if self.graphs:
            raise GaveUp(f"step {p.step + 1}: out of memory at micro-batch {size}, which cannot be split: "
                         f"{self.graphs} replays CUDA graphs, which cannot accumulate gradients over smaller "
                         f"micro-batches. Use {WITHOUT_GRAPHS}, which can, or a smaller model{self.hint}.")
        if self.policy == "abort" or size <= 1:
            raise GaveUp(f"step {p.step + 1}: out of memory at micro-batch {size} "
                         f"(train.oom_policy={self.policy}); use a smaller data.batch_size or model"
                         f"{self.hint}.")
        p.micro_split *= 2
        self.dist.say(f"step {p.step + 1}: out of memory; micro-batch {size} -> {self.micro_batch()}, "
                      f"accumulation x{p.micro_split} (same global batch), retrying; the samples and maths "
                      f"stay, random draws in the model (dropout) differ from an unsplit run's",
                      file=sys.stderr)

    def rewrap(self, device: torch.device) -> torch.nn.Module:
        """A fresh DDP around the module after a split: the old one's reducer waits for a backward
        that never comes. The caller drops the old one first; the collection here frees it where a
        reference cycle still holds it (a DDP that never ran a forward is one; the failed try's
        traceback can be another), its reducer's hooks on the parameters gone before the new one's."""
        gc.collect()
        return ddp(self.model, device, self.find_unused)
