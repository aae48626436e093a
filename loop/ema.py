"""EMA of the weights via `torch.optim.swa_utils.AveragedModel`.

The decay warms up as min(decay, (1+n)/(warmup+n)) after n updates, so early averages are not
dominated by the random initial weights. It is updated only after optimizer steps actually taken.
Its state goes into the checkpoint as plain weights (no `module.` prefix) plus the update count.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel


def build_ema(model: nn.Module, cfg) -> AveragedModel | None:
    if not cfg.enabled:
        return None

    def update(ema_params: list[torch.Tensor], params: list[torch.Tensor], n: torch.Tensor) -> None:
        # One foreach update for all tensors; the decay stays a device tensor (no host read).
        d = torch.clamp((1 + n) / (cfg.warmup + n), max=cfg.decay).to(ema_params[0].dtype)
        torch._foreach_mul_(ema_params, d)
        torch._foreach_add_(ema_params, torch._foreach_mul(params, 1 - d))

    # AveragedModel keeps its update counter n_averaged on the CPU (no device given), so its own
    # `if n_averaged == 0` checks read host memory, not the GPU.
    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def ema_state(ema: AveragedModel) -> dict:
    return {"weights": ema.module.state_dict(), "n_averaged": ema.n_averaged}


def load_ema_state(ema: AveragedModel, state: dict) -> None:
    ema.module.load_state_dict(state["weights"])
    ema.n_averaged.copy_(state["n_averaged"])
