"""Datasets, one builder per `data.name`, each returning a `Data` bundle the loop consumes.

To add a task: write a builder that returns `Data` (datasets whose items are dicts with at least
`x`, `y` and `idx`), and add it to BUILDERS. The loop never looks inside a sample.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch.utils.data import Dataset

from data.markov import prepare_markov
from data.prepare import embedded_text, prepare_text, read_text
from data.tokens import TokenWindows
from loop.errors import BadInput


@dataclass
class Data:
    train: Dataset
    val: Dataset
    vocab_size: int
    seq_len: int
    decode: Callable[[list[int]], str]
    meta: dict = field(default_factory=dict)


def _token_data(root: Path, seq_len: int) -> Data:
    meta = json.loads((root / "meta.json").read_text())
    train, val = TokenWindows(root / "train.bin", seq_len), TokenWindows(root / "val.bin", seq_len)
    for name, ds in (("train", train), ("val", val)):
        if len(ds) == 0:
            raise BadInput(f"data: the {name} split of {meta['source']} is shorter than "
                           f"data.seq_len={seq_len} + 1 tokens; use a smaller data.seq_len.")
    if meta["kind"] == "chars":
        chars = meta["chars"]
        decode = lambda ids: "".join(chars[i] for i in ids)  # noqa: E731
    else:
        decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    return Data(train, val, meta["vocab_size"], seq_len, decode, meta)


def build_text(cfg) -> Data:
    text, source = (read_text(cfg.path), cfg.path) if cfg.path else (embedded_text(), "pydoc_data.topics")
    return _token_data(prepare_text(text, source, cfg.cache_dir, cfg.val_fraction), cfg.seq_len)


def build_markov(cfg) -> Data:
    m = cfg.markov
    root = prepare_markov(m.vocab_size, m.branching, m.tokens, m.seed, cfg.cache_dir, cfg.val_fraction)
    return _token_data(root, cfg.seq_len)


BUILDERS = {"text": build_text, "markov": build_markov}


def build_data(cfg) -> Data:
    if cfg.name not in BUILDERS:
        raise BadInput(f"config key data.name: expected one of {', '.join(BUILDERS)}; got {cfg.name!r}.")
    return BUILDERS[cfg.name](cfg)
