"""Your data set (data.name=mine): a small regression task to start from. Replace it with yours.

Sample i is {"x": 8 features, "y": 4 targets, "idx": i}, drawn once from `seed`: y is a fixed linear
map of x plus noise. What the loop needs of a data set (loop/data/bundle.py):
- each split is map-style (`len`, `[i]`), item i holding `idx` = i;
- `y` holds the targets; one the loss must not count is -100 (IGNORE_INDEX), a float here as for
  token ids: every 10th sample misses its last target, a measurement not taken;
- `Data(train, val, vocab_size, seq_len)`: seq_len is the targets per sample (4); vocab_size is the
  classes a target can take, which means nothing for a regression: 1, and the model does not read it.
Random draws per sample (augmentation) come from torch, numpy or random's global streams, which
the loop seeds from the sample's place in the order: a resume sees the same draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from loop.config.fields import opt
from loop.config.schema import DataSection
from loop.data.bundle import IGNORE_INDEX, Data

FEATURES, TARGETS = 8, 4


@dataclass
class MineOptions(DataSection):  # data.name=mine reads these keys beside the loop's (data.batch_size, ...)
    train_samples: int = opt(4000, min=1)
    val_samples: int = opt(500, min=1)
    noise: float = opt(0.1, min=0.0)
    seed: int = opt(0, min=0)


class Measurements(Dataset):
    def __init__(self, n: int, noise: float, seed: int, weights: np.ndarray):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        self.y = (self.x @ weights + noise * rng.normal(size=(n, TARGETS))).astype(np.float32)
        self.y[::10, -1] = IGNORE_INDEX  # every 10th sample: its last target not measured

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.from_numpy(self.x[i]), "y": torch.from_numpy(self.y[i]), "idx": i}  # x: (8,), y: (4,)


def build_mine(cfg: MineOptions) -> Data:
    weights = np.random.default_rng(cfg.seed).normal(size=(FEATURES, TARGETS))  # the map to learn
    return Data(Measurements(cfg.train_samples, cfg.noise, cfg.seed + 1, weights),
                Measurements(cfg.val_samples, cfg.noise, cfg.seed + 2, weights),
                vocab_size=1, seq_len=TARGETS, meta={"kind": "regression", "source": f"mine(seed={cfg.seed})"})
