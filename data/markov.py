"""Synthetic tokens with a known answer: a fixed random first-order Markov chain.

A model that sees the previous token can do no better than the chain's entropy rate
H = -sum_s pi(s) sum_t P(s,t) log P(s,t) (nats per token), so "did it learn?" has a number to
hit. The chain always contains the cycle s -> s+1, so it is irreducible and pi is unique.

    python train.py data.name=markov data.markov.vocab_size=64
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.corpus import CorpusOptions, generating, held_out, room_for, write_tokens
from data.tokens import token_data
from loop.config.fields import opt
from loop.data.bundle import Data


def transition_matrix(vocab: int, branching: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    P = np.zeros((vocab, vocab))
    for s in range(vocab):
        others = rng.permutation([t for t in range(vocab) if t != (s + 1) % vocab])
        support = [(s + 1) % vocab, *others[: branching - 1]]
        P[s, support] = rng.dirichlet(np.ones(len(support)))
    return P


def entropy_rate(P: np.ndarray) -> float:
    pi = np.full(len(P), 1.0 / len(P))
    for _ in range(10_000):  # power iteration to the stationary distribution
        pi = pi @ P
    with np.errstate(divide="ignore", invalid="ignore"):
        h_rows = -np.nansum(np.where(P > 0, P * np.log(P), 0.0), axis=1)
    return float(pi @ h_rows)


def prepare_markov(vocab: int, branching: int, tokens: int, seed: int, cache_dir: str,
                   val_fraction: float) -> Path:
    out = Path(cache_dir) / f"markov-v{vocab}-b{branching}-n{tokens}-s{seed}-val{val_fraction!r}"
    if (out / "meta.json").exists():
        return out
    held_out(tokens, val_fraction)  # a split that cannot work is refused before the chain is made
    room_for("data.markov.tokens", tokens, out)
    P = transition_matrix(vocab, min(branching, vocab), seed)
    cum, rng = np.cumsum(P, axis=1), np.random.default_rng(seed + 1)
    u, ids, s = rng.random(tokens), np.empty(tokens, dtype=np.uint16), 0
    for i in range(tokens):
        ids[i] = s
        s = min(int(np.searchsorted(cum[s], u[i], side="right")), vocab - 1)
    meta = {"kind": "markov", "source": f"markov(vocab={vocab}, branching={branching}, seed={seed})",
            "vocab_size": vocab, "optimal_loss": entropy_rate(P)}
    return write_tokens(out, ids, val_fraction, meta)


@dataclass
class MarkovConfig:
    """The chain: a random Markov chain whose entropy rate is the best loss."""
    # A dense vocab x vocab matrix: 1024 takes ~20 s to prepare on a laptop core, and beyond a few
    # thousand minutes and gigabytes (100000 is numpy's ValueError, after the checks).
    vocab_size: int = opt(32, min=2, max=1024)
    branching: int = opt(4, min=1)  # next-token support per state
    tokens: int = opt(200_000, min=1000)
    seed: int = opt(0, min=0)


@dataclass
class MarkovOptions(CorpusOptions):
    markov: MarkovConfig = field(default_factory=MarkovConfig)


def build_markov(cfg: MarkovOptions) -> Data:
    m = cfg.markov
    with generating("data.markov.tokens", m.tokens):  # its draws and ids: 10 bytes a token
        root = prepare_markov(m.vocab_size, m.branching, m.tokens, m.seed, cfg.cache_dir, cfg.val_fraction)
    return token_data(root, cfg.seq_len)
