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

