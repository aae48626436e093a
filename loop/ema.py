"""EMA of the weights via `torch.optim.swa_utils.AveragedModel`.

The decay warms up as min(decay, (1+n)/(warmup+n)) after n updates, so early averages are not
dominated by the random initial weights. It is updated only after optimizer steps actually taken.
Its state goes into the checkpoint as plain weights (no `module.` prefix) plus the update count;
with FSDP the weights are sharded like the model's and saved with its shards (loop/fsdp.py).

`build_ema` copies the model before it is wrapped (an FSDP module cannot be deep-copied);
`loop.distributed.wrap` then gives the copy rank 0's weights and, with FSDP, the model's sharding.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

from loop import fsdp


def build_ema(model: nn.Module, cfg, shapes_only: bool = False) -> AveragedModel | None:
    """The average, a copy of `model`; with `shapes_only` a copy on the meta device (no memory),
    which FSDP sharding fills with rank 0's weights (loop/fsdp.py::shard)."""
    if not cfg.enabled:
        return None
    if shapes_only:
        model = meta_copy(model)

    def update(ema_params: list[torch.Tensor], params: list[torch.Tensor], n: torch.Tensor) -> None:
        # One foreach update for all tensors (FSDP: this rank's shards); the decay stays a device
        # tensor (no host read).
        ema_params, params = [fsdp.local(t) for t in ema_params], [fsdp.local(t) for t in params]
        d = torch.clamp((1 + n) / (cfg.warmup + n), max=cfg.decay).to(ema_params[0].dtype)
        torch._foreach_mul_(ema_params, d)
        torch._foreach_add_(ema_params, torch._foreach_mul(params, 1 - d))

    # AveragedModel keeps its update counter n_averaged on the CPU (no device given), so its own
    # `if n_averaged == 0` checks read host memory, not the GPU.
    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


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
