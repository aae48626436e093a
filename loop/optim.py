"""AdamW with decay / no-decay parameter groups, fused kernel on CUDA and CPU.

Matrices (embeddings, linear weights) are decayed; biases and norm gains are not, since shrinking
them toward zero only fights the normalisation. The fused kernel is faster, and unlike the
per-tensor path it never reads its step counter back to Python, so the step adds no host syncs.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class AdamW(torch.optim.AdamW):
    """torch's AdamW, resumed the way a config reads: the moments and step counts come from the
    checkpoint, the settings (optim.lr, weight_decay, betas, eps, the kernel choice) from this run's
    config, so a run resumed with a new optim.lr uses it from the resumed step on (the LR schedule
    then sets each step's lr: loop/schedule.py::Schedule). With the config unchanged every value
    is the checkpoint's, bit for bit."""

    def load_state_dict(self, state_dict: dict) -> None:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mine in zip(self.param_groups, settings):
            group.update(mine)


def build_optimizer(model: nn.Module, cfg, device: torch.device) -> AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                 fused=device.type in ("cuda", "cpu"))
