"""Uniform random tokens (data.name=random): a throughput workload at any vocabulary size, nothing
downloaded; the best possible loss is ln(vocab_size).

    python train.py --config configs/gpt2_124m.yaml       # data.name=random, 50,304 tokens
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.corpus import CorpusOptions, generating, room_for, write_tokens
from data.tokens import token_data
from loop.config.fields import opt
from loop.data.bundle import Data
from loop.errors import BadInput


@dataclass
class SyntheticConfig:
    vocab_size: int = opt(50304, min=2)
    tokens: int = opt(2_000_000, min=1000)
    seed: int = opt(0, min=0)


@dataclass
class RandomOptions(CorpusOptions):
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


def build_random(cfg: RandomOptions) -> Data:
    s = cfg.synthetic
    if s.vocab_size > 2**16:  # token files hold uint16 ids
        raise BadInput(f"config key data.synthetic.vocab_size: expected at most 65536; got {s.vocab_size}.")
    out = Path(cfg.cache_dir) / f"random-v{s.vocab_size}-n{s.tokens}-s{s.seed}-val{cfg.val_fraction!r}"
    if not (out / "meta.json").exists():
        room_for("data.synthetic.tokens", s.tokens, out)
        with generating("data.synthetic.tokens", s.tokens):
            ids = np.random.default_rng(s.seed).integers(0, s.vocab_size, s.tokens, dtype=np.uint16)
            meta = {"kind": "random", "source": f"random(vocab={s.vocab_size}, seed={s.seed})",
                    "vocab_size": s.vocab_size, "optimal_loss": math.log(s.vocab_size)}
            write_tokens(out, ids, cfg.val_fraction, meta)
    return token_data(out, cfg.seq_len)
