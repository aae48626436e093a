"""Out of memory: the CUDA allocator's setting, and a step that ran out retried in smaller
micro-batches (train.oom_policy=split) where no collective over the ranks was under way.
"""
from __future__ import annotations

import gc
import os
import sys

import torch

from loop.distributed.wrap import ddp, is_ddp
from loop.errors import GaveUp
from model.gpt import GPT


# ---------------------------------------------------------------------------- out of memory
def configure_allocator() -> str:
    """Turn on expandable segments (less fragmentation, so fewer OOMs after a batch-size change)
    in both spellings of the allocator variable, keeping whatever else the user set. Must run
    before CUDA initialises; returns the setting in effect."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        current = os.environ.get(var, "")
        if "expandable_segments" not in current:
            os.environ[var] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return os.environ["PYTORCH_ALLOC_CONF"]


def oom_in_collectives(t, where: str) -> None:
    """Out of memory while collectives over the ranks were under way: the other ranks are waiting
    in (or have gone past) a collective this one will never join, and DDP's reducer cannot resume
    a reduction left halfway. No retry can put that right, so this rank gives up (exit 3) and
    torchrun stops the others; rerunning resumes from the newest checkpoint."""
    p, b = t.progress, t.cfg.data.batch_size
    raise GaveUp(f"rank {t.dist.rank}: step {p.step + 1}: out of memory {where} (micro-batch "
                 f"{-(-b // p.micro_split)}). Collectives over the ranks were under way, so it cannot "
                 f"be retried in place. Rerun with a smaller data.batch_size and a larger "
                 f"train.grad_accum (the same global batch)"
                 f"{', or model.activation_checkpointing=true' if isinstance(t.raw, GPT) else ''}.")


def recover_from_oom(t) -> None:
    """train.oom_policy: halve the micro-batch (the same batches are retried), or give up."""
    p, b = t.progress, t.cfg.data.batch_size
    size = -(-b // p.micro_split)
    t.optimizer.zero_grad(set_to_none=True)
    if t.device.type == "cuda":
        torch.cuda.empty_cache()
    if t.cfg.train.oom_policy == "abort" or size <= 1:
        raise GaveUp(f"step {p.step + 1}: out of memory at micro-batch {size} "
                     f"(train.oom_policy={t.cfg.train.oom_policy}); use a smaller "
                     f"data.batch_size or model, or activation checkpointing.")
    p.micro_split *= 2
    if is_ddp(t.model):
        # A rank that finished the last micro-batch's forward has set DDP's reducer to reduce in
        # the next backward, which would now be a retried micro-batch's (and a lone process may
        # have run out of memory halfway through that reduction): a fresh DDP starts clean (every
        # rank is here; the weights are unchanged, the optimizer holds the same tensors).
        t.model = None
        gc.collect()  # the old reducer and its hooks on the parameters go first, even in a cycle
        t.model = ddp(t.raw, t.device, t.cfg.train.find_unused_parameters)
    t.dist.say(f"step {p.step + 1}: out of memory; micro-batch {size} -> {-(-b // p.micro_split)}, "
               f"accumulation x{p.micro_split} (same global batch), retrying", file=sys.stderr)

