"""AdamW with decay / no-decay parameter groups, fused kernel on CUDA and CPU.

Matrices (embeddings, linear weights) are decayed; biases and norm gains are not, since shrinking
them toward zero only fights the normalisation. The fused kernel is faster, and unlike the
per-tensor path it never reads its step counter back to Python, so the step adds no host syncs.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def build_optimizer(model: nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=device.type in ("cuda", "cpu"))


def config_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's settings as built from the config (all but its params): taken before a
    checkpoint's optimizer state is loaded over them, for `reapply`."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def reapply(optimizer: torch.optim.Optimizer, scheduler, groups: list[dict]) -> None:
    """After a resume: the config's settings again (optim.lr, weight_decay, betas, eps, the kernel
    choice), where load_state_dict put the checkpoint's, so a run resumed with a new optim.lr uses
    it from the resumed step on, as the schedule does. The moments and step counts stay the
    checkpoint's; with the config unchanged every value is the same, bit for bit."""
    for g, h in zip(optimizer.param_groups, groups):
        g.update(h)
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]  # optim.lr (LambdaLR)
    for g, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        g["lr"] = base * factor(scheduler.last_epoch)  # what LambdaLR.step set at the saved step
