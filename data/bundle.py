"""`Data`: what every dataset builder returns and the loop consumes (its only view of a task).

    from data.bundle import Data
    def build_mine(cfg) -> Data:          # cfg: the data section (data/config.py)
        return Data(MyDataset("train"), MyDataset("val"), vocab_size=10, seq_len=1)

The datasets are addressable by index (`len`, `[i]`); item i is a dict with at least `x` (the
model's input), `y` (targets; -100 = not counted) and `idx` (= i, so audits can see which samples
a step trained on). The loop never looks inside a sample beyond counting the targets of `y`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch.utils.data import Dataset


@dataclass
class Data:
    train: Dataset
    val: Dataset
    vocab_size: int  # classes a target can take: tokens of a vocabulary, or labels
    seq_len: int  # targets per sample: a text window's length, 1 for a classifier
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, for text samples
    meta: dict = field(default_factory=dict)  # e.g. optimal_loss of a synthetic task
