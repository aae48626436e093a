"""Your model (model.name=mine): an MLP for data/mine.py's regression. Replace it with yours.

What the loop needs of a model: `forward(batch)` returns the loss SUMMED over the batch's real
targets (never their mean: the loop divides by the whole step's target count, which makes gradient
accumulation and several processes exact), as a tensor of shape (); or a dict of such sums with
the loss under "loss" (each is reported divided by the target count, as val_<name>). Targets equal
to -100 are not counted: mask them, as below (F.mse_loss and F.l1_loss count every target;
F.cross_entropy's ignore_index=-100 leaves them out). Optional: `generate` (text samples), `flops_per_token` (MFU),
`set_activation_checkpointing` (model.activation_checkpointing); see model/gpt.py in the scaffold.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from loop.config.fields import opt
from loop.config.schema import ModelSection
from loop.data.bundle import IGNORE_INDEX, Data


@dataclass
class MineOptions(ModelSection):  # model.name=mine reads these keys beside the loop's
    width: int = opt(64, min=1)
    depth: int = opt(2, min=1)
    dropout: float = opt(0.1, min=0.0, max=1.0)


class MLP(nn.Module):
    def __init__(self, inputs: int, outputs: int, width: int, depth: int, dropout: float):
        super().__init__()
        layers = []
        for i in range(depth):
            layers += [nn.Linear(inputs if i == 0 else width, width), nn.GELU(), nn.Dropout(dropout)]
        self.net = nn.Sequential(*layers, nn.Linear(width, outputs))

    def forward(self, batch: dict) -> torch.Tensor:
        pred, y = self.net(batch["x"]), batch["y"]  # (B, 4) each
        counted = y != IGNORE_INDEX
        return ((pred - y) ** 2).masked_fill(~counted, 0.0).sum()  # squared error summed over real targets


def build_mine(cfg: MineOptions, data: Data) -> MLP:
    sample = data.train[0]
    return MLP(sample["x"].numel(), sample["y"].numel(), cfg.width, cfg.depth, cfg.dropout)
