"""Validation loss and text samples, both without touching any training random stream.

Validation runs in eval mode under `no_grad` on a fixed set of batches (drawn once by their own
generator), and returns the mean loss over all their real targets with one host read. The sample
uses its own `torch.Generator`.
"""
from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def val_loss(model: nn.Module, batches: list[dict], precision, device: torch.device, dist) -> float:
    """Mean loss over the real targets of every rank's validation batches."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for batch in batches:
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        with precision.autocast():
            total += model(batch).float()
        count += batch["n_targets"]
    model.train(was_training)
    total, count = dist.sum_(torch.stack([total, torch.tensor(float(count), device=device)])).tolist()
    return total / count


@torch.no_grad()
def text_sample(model: nn.Module, prompt: torch.Tensor, n: int, seed: int, decode) -> str | None:
    """`n` tokens after `prompt` (1, T), decoded; None for models without `generate`."""
    if not hasattr(model, "generate") or n == 0:
        return None
    was_training = model.training
    model.eval()
    g = torch.Generator(prompt.device).manual_seed(seed)
    ids = model.generate(prompt, n, g)[0].tolist()
    model.train(was_training)
    return decode(ids)
