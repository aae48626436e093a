"""A small image classifier (model.name=cnn): two conv blocks, then a hidden layer.

    python train.py --config configs/mnist.yaml

conv 3x3 (in -> c) ReLU maxpool2 -> conv 3x3 (c -> 2c) ReLU maxpool2 -> flatten -> dropout ->
linear (-> hidden) ReLU -> dropout -> linear (-> classes), with c = model.cnn.channels. The input's
channels and size come from the data. No BatchNorm on purpose: its train-mode statistics are those
of each micro-batch, so k accumulated micro-batches would not give one big batch's gradients, which
the project audits. `forward(batch)` returns sums over the real targets (labels != -100): the
cross-entropy ("loss") and the number predicted right ("accuracy"); validation divides both by the
target count, giving val_loss and val_accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from loop.config.fields import opt
from loop.config.schema import ModelSection
from loop.data.bundle import IGNORE_INDEX, Data
from loop.errors import BadInput


@dataclass
class CnnConfig:
    """Two conv blocks (channels, then 2 x channels) and a hidden layer."""
    channels: int = opt(16, min=1)
    hidden: int = opt(64, min=1)


@dataclass
class CNNOptions(ModelSection):
    dropout: float = opt(0.1, min=0.0, max=1.0)
    cnn: CnnConfig = field(default_factory=CnnConfig)


def build_cnn(cfg: CNNOptions, data: Data) -> "CNN":
    shape = tuple(data.train[0]["x"].shape)  # one sample's (channels, height, width)
    if len(shape) != 3 or min(shape[1:]) < 4:
        raise BadInput(f"config key model.name=cnn: expected data whose samples are images (channels, "
                       f"height, width), height and width at least 4 (two 2x poolings); got x of "
                       f"shape {shape}.")
    return CNN(shape, data.vocab_size, cfg.cnn.channels, cfg.cnn.hidden, cfg.dropout)


class CNN(nn.Module):
    def __init__(self, in_shape: tuple[int, int, int], classes: int, channels: int, hidden: int,
                 dropout: float):
        super().__init__()
        c_in, height, width = in_shape
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, c, H/2, W/2)
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 2c, H/4, W/4)
            nn.Flatten())
        self.head = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(2 * c * (height // 4) * (width // 4), hidden), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(hidden, classes))

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W) -> (B, classes)
        return self.head(self.features(x))

    def forward(self, batch: dict) -> dict[str, torch.Tensor]:
        logits, y = self.logits(batch["x"]).float(), batch["y"]  # y: (B,)
        loss = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((logits.argmax(-1) == y) & (y != IGNORE_INDEX)).sum().float()
        return {"loss": loss, "accuracy": correct}
