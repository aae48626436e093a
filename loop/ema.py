"""EMA of the weights: a copy in a `torch.optim.swa_utils.AveragedModel`, averaged by `update`.

The decay warms up as min(decay, (1+n)/(warmup+n)) after n updates, so early averages are not
dominated by the random initial weights. It is updated only after optimizer steps actually taken.
Its state goes into the checkpoint as plain weights (no `module.` prefix) plus the update count;
with FSDP the weights are sharded like the model's and saved with its shards (loop/distributed/fsdp.py).

`build_ema` copies the model before it is wrapped (an FSDP module cannot be deep-copied);
`loop.distributed.wrap.wrap` then gives the copy rank 0's weights and, with FSDP, the model's sharding.

Weights the model keeps in 16 bits are averaged in float32: in bfloat16, the default decay 0.999
rounds to 1.0 and the average never moved from its first value (its validation loss stayed the
initial model's, and early stopping stopped a run that was learning); at 0.99 it rounds to 0.988,
and each step's small update mostly rounds away. The float32 copy costs twice the 16-bit weights'
memory; it is what is validated, checkpointed and exported.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

from loop.distributed import fsdp


def build_ema(model: nn.Module, cfg, shapes_only: bool = False) -> AveragedModel | None:
    """The average, a copy of `model` (weights of under 32 bits in float32); with `shapes_only` a
    copy on the meta device (no memory), which FSDP sharding fills with rank 0's weights
    (loop/distributed/fsdp.py::shard). Updated by `update`; AveragedModel is its container (the copy and the
    update counter, kept in host memory, so reading it is no device sync)."""
    if not cfg.enabled:
        return None
    ema = AveragedModel(meta_copy(model) if shapes_only else model, use_buffers=True)
    for t in [*ema.module.parameters(), *ema.module.buffers()]:
        if t.is_floating_point() and torch.finfo(t.dtype).bits < 32:
            t.data = t.data.float()  # in place: tied weights stay one tensor
    return ema


def update(ema: AveragedModel, model: nn.Module, cfg) -> None:
    """Average `model`'s weights and floating buffers into `ema`, after an optimizer step taken.
    Not AveragedModel.update_parameters: it pairs a float32 average with bfloat16 weights but
    refuses float16 ones, and computes (1 - d) * w in the weights' dtype, rounded the same way each
    step (a bf16 average settled up to half a bf16 step off). One foreach update per device and
    dtype (FSDP: this rank's shards); the decay stays a device tensor (no host read)."""
    averages = [fsdp.local(t).detach() for t in (*ema.module.parameters(), *ema.module.buffers())]
    groups: dict[tuple, tuple[list, list]] = {}
    for a, w in zip(averages, (*model.parameters(), *model.buffers())):
        avg, new = groups.setdefault((a.device, a.dtype), ([], []))
        avg.append(a)
        new.append(fsdp.local(w).detach().to(a.dtype))
    first = bool(ema.n_averaged == 0)
    for (device, dtype), (avg, new) in groups.items():
        if first or not dtype.is_floating_point:  # counters (batch norm's) are copied, not averaged
            torch._foreach_copy_(avg, new)
            continue
        n = ema.n_averaged.to(device)
        d = torch.clamp((1 + n) / (cfg.warmup + n), max=cfg.decay).to(dtype)
        torch._foreach_mul_(avg, d)
        torch._foreach_add_(avg, torch._foreach_mul(new, 1 - d))
    ema.n_averaged += 1


def meta_copy(model: nn.Module) -> nn.Module:
    """`model` deep-copied with every parameter and buffer replaced by a meta tensor of its shape:
    the structure, tied weights (one tensor, one copy) and compilation are kept, no memory taken."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def ema_state(ema: AveragedModel, sharded: bool) -> dict:
    """For state.pt; sharded (FSDP) weights are not in it but in the checkpoint's DCP shards."""
    return {"weights": None if sharded else ema.module.state_dict(), "n_averaged": ema.n_averaged}


def load_ema_state(ema: AveragedModel, state: dict, path: Path) -> None:
    if state["weights"] is None:  # FSDP: from the shards in checkpoint `path`
        fsdp.load_weights(ema.module, path, "ema")
    else:
        ema.module.load_state_dict(state["weights"])
    ema.n_averaged.copy_(state["n_averaged"])
