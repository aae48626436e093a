"""The forward and backward passes of one optimizer step, over its micro-batches, and what happens
when one runs out of memory. Functions of the trainer (`t`: loop.trainer.Trainer), like
loop/checkpoint/state.py's.
"""
from __future__ import annotations

import torch
from torch.profiler import record_function

from loop.data.sampler import split_batch
from loop.distributed import fsdp
from loop.distributed.wrap import grad_sync
from loop.evaluate import loss_and_sums
from loop.guards.faults import fire_once, forward_oom, injected_oom
from loop.guards.oom import oom_in_collectives

UNDER_FSDP = "in forward or backward under FSDP, which gathers each block's weights from all ranks"


def forward_backward(t, micro: list[dict], n_targets: int) -> torch.Tensor | None:
    """Summed loss of each micro-batch, (n,) on the device; None if a rank ran out of memory
    before gradients crossed ranks (every rank then retries the same batches in smaller pieces).

    Up to the last micro-batch's backward, DDP ranks run no collective: each gets that far and
    all agree there whether anyone ran out of memory, before any rank starts syncing gradients.
    With other ranks, out of memory inside a collective phase (that backward, where DDP
    all-reduces gradients; any forward or backward under FSDP, which gathers each block's
    weights) cannot be undone (`oom_in_collectives`)."""
    parts = [b for m in micro for b in split_batch(m, t.progress.micro_split)]
    losses, oom, scaled = [], False, None
    try:
        for i, batch in enumerate(parts):
            last = i == len(parts) - 1
            with grad_sync(t.model, last):
                loss, scaled = _forward(t, batch, i, n_targets, len(parts))
                losses.append(loss.detach().float())
                if not last:
                    with record_function("backward"):
                        scaled.backward()
    except torch.OutOfMemoryError:
        oom = True  # recover outside the except block: its traceback pins the tensors
    if oom and t.sharded:
        oom_in_collectives(t, UNDER_FSDP)
    if t.dist.sum_host([float(oom)])[0]:  # anyone: all retry, before gradients cross ranks
        return None
    try:
        with grad_sync(t.model, True), record_function("backward"):
            scaled.backward()
    except torch.OutOfMemoryError:
        oom = True
    if oom and (t.sharded or t.dist.world > 1):  # alone, a fresh DDP starts clean
        oom_in_collectives(t, UNDER_FSDP if t.sharded else "in the last micro-batch's backward, "
                              "where gradients are reduced over the ranks")
    return None if oom else torch.stack(losses)


def _forward(t, batch: dict, i: int, n_targets: int, n_parts: int):
    """Micro-batch i of n_parts: its loss summed over its targets, and that loss scaled for
    backward."""
    p, faults = t.progress, t.cfg.faults
    batch = {k: v.to(t.device, non_blocking=True) if torch.is_tensor(v) else v
             for k, v in batch.items()}
    oom = i == 0 and fire_once(t.fired, "oom", p.step + 1 == faults.oom_at_step
                               and faults.oom_rank in (-1, t.dist.rank))
    if t.sharded:
        fsdp.sync_buffers(t.raw)
    with t.precision.autocast(), record_function("forward"), \
            forward_oom(t.raw, oom and faults.oom_in == "forward"):
        loss = loss_and_sums(t.model(batch))[0]
    if i == 0 and fire_once(t.fired, "nan", p.step + 1 == faults.nan_at_step
                            and faults.nan_rank in (-1, t.dist.rank)):
        loss = loss * float("nan")
    # Divide by the step's target count over all ranks (times world: DDP averages gradients
    # over ranks): the gradients then equal one big batch's. Lab: each micro-batch's own mean / k.
    per = batch["n_targets"] * n_parts if t.lab == "mean_loss_per_microbatch" else n_targets
    scaled = t.scaler.scale(loss * (t.dist.world / per))
    if oom and faults.oom_in == "backward":
        scaled.register_hook(injected_oom)  # fires as backward starts
    return loss, scaled
