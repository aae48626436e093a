"""`Data`: what every dataset builder returns and the loop consumes (its only view of a task).

    from loop.data.bundle import Data
    def build_mine(cfg) -> Data:          # cfg: the data section (loop/config/schema.py::DataSection)
        return Data(MyDataset("train"), MyDataset("val"), vocab_size=10, seq_len=1)

The datasets are addressable by index (`len`, `[i]`); item i is a dict with at least `x` (the
model's input), `y` (targets; -100 = not counted) and `idx` (= i, so audits can see which samples
a step trained on). The loop never looks inside a sample beyond counting the targets of `y`.
A model with more inputs takes each in a key of its own: the loop moves tensors to the device and
splits them (out-of-memory recovery) at the top level of a batch only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Number
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from loop.errors import BadInput

IGNORE_INDEX = -100  # targets equal to this are not counted (PyTorch's cross-entropy default)


@dataclass
class Data:
    train: Dataset
    val: Dataset
    vocab_size: int  # classes a target can take: tokens of a vocabulary, or labels
    seq_len: int  # targets per sample: a text window's length, 1 for a classifier
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, for text samples
    meta: dict = field(default_factory=dict)  # e.g. optimal_loss of a synthetic task
    unit: str = "targets"  # what the console and report.md call a target: "tokens" for a language model


def check_samples(data: Data, name: str) -> None:
    """Both splits hold samples, and their first and last keep the contract above: a slip is exit 2
    naming it at startup, not a KeyError deep in the loop (or, for a nested input, an error on a GPU
    only, where it is not moved to the device)."""
    for split, ds in (("train", data.train), ("val", data.val)):
        where = f"data.name={name}: the {split} split"
        stream = isinstance(ds, IterableDataset)  # has len() and [i] (raising) when it defines __len__
        if stream or not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            what = "an IterableDataset" if stream else "without len() and [i]"
            raise BadInput(f"{where} is a {type(ds).__name__}, {what}; expected a "
                           f"map-style dataset: a run resumes at a sample position and draws each "
                           f"epoch's order over every index (write a stream into token files, as the "
                           f"example data.name=tokens reads them, or index its shards).")
        if len(ds) == 0:
            raise BadInput(f"{where} is empty; expected samples in it.")
        for i in sorted({0, len(ds) - 1}):
            item = ds[i]
            if not isinstance(item, dict) or not {"x", "y", "idx"} <= item.keys():
                got = f"a dict with keys {', '.join(map(str, item))}" if isinstance(item, dict) \
                    else f"a {type(item).__name__}"
                raise BadInput(f"{where}'s sample {i} is {got}; expected a dict with x (the model's "
                               f"input), y (its targets, -100 = not counted) and idx (= {i}) "
                               f"(loop/data/bundle.py).")
            for key, value in item.items():
                if not isinstance(value, (torch.Tensor, np.ndarray, Number)):
                    raise BadInput(f"{where}'s sample {i} holds a {type(value).__name__} under {key!r}; "
                                   f"expected a tensor, array or number under each key (a model with "
                                   f"more inputs takes each in a key of its own; loop/data/bundle.py).")
            if np.ndim(item["idx"]) != 0 or int(item["idx"]) != i:
                raise BadInput(f"{where}'s sample {i} has idx {item['idx']!r}; expected its index, {i} "
                               f"(audits and data.log_ids name the samples a step trained on by it).")
        if why := unstackable([ds[0], ds[len(ds) - 1]]):  # e.g. a last window cut short
            raise BadInput(f"{where}'s {why}.")


def unstackable(items: list[dict]) -> str | None:
    """Why these samples cannot be stacked into one batch, if their keys or a key's shape differ."""
    first = items[0]
    for item in items[1:]:
        if item.keys() != first.keys():
            return (f"samples {int(first['idx'])} and {int(item['idx'])} have different keys: "
                    f"{', '.join(first)} and {', '.join(item)}; a batch stacks its samples key by key")
        for key in first:
            if (a := tuple(np.shape(first[key]))) != (b := tuple(np.shape(item[key]))):
                return (f"samples {int(first['idx'])} and {int(item['idx'])} differ in the shape of "
                        f"{key!r}: {a} and {b}; a batch stacks its samples, so each key needs one "
                        f"shape (pad to one length, with the padded targets -100)")
    return None
