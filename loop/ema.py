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

    def avg(ema_p: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        d = torch.clamp((1 + n) / (cfg.warmup + n), max=cfg.decay)  # a tensor: no host sync
        return ema_p + (1 - d) * (p - ema_p)

    return AveragedModel(model, avg_fn=avg, use_buffers=True)


def ema_state(ema: AveragedModel) -> dict:
    return {"weights": ema.module.state_dict(), "n_averaged": ema.n_averaged}


def load_ema_state(ema: AveragedModel, state: dict) -> None:
    ema.module.load_state_dict(state["weights"])
    ema.n_averaged.copy_(state["n_averaged"])
