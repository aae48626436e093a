"""The `data` section of the config: options of every builder in data/BUILDERS.

A new dataset adds its options here (a field, or a sub-section like `markov`), next to its builder;
nothing in loop/ changes. Bounds and choices are checked at load time (loop/config/fields.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loop.config.fields import opt


@dataclass
class MarkovConfig:
    """Synthetic data with a known answer: a random Markov chain whose entropy rate is the best loss."""
    # The chain is a dense vocab x vocab matrix: 1024 takes ~20 s to prepare on a laptop core, and
    # beyond a few thousand minutes and gigabytes (100000 was numpy's ValueError, after the checks).
    vocab_size: int = opt(32, min=2, max=1024)
    branching: int = opt(4, min=1)  # next-token support per state
    tokens: int = opt(200_000, min=1000)
    seed: int = opt(0, min=0)


@dataclass
class SyntheticConfig:
    """Uniform random tokens (data.name=random): a throughput workload at any vocabulary size,
    nothing downloaded; the best possible loss is ln(vocab_size)."""
    vocab_size: int = opt(50304, min=2)
    tokens: int = opt(2_000_000, min=1000)
    seed: int = opt(0, min=0)


@dataclass
class DataConfig:
    name: str = "text"  # a key of data.BUILDERS: text, markov, random, tokens, shakespeare, mnist
    # text: a local text file (empty = the Python docs in CPython); tokens: a directory;
    # mnist: a directory of your own IDX files (empty = download the canonical ones)
    path: str = ""
    url: str = ""  # shakespeare, mnist: download from this base URL (a mirror) instead
    cache_dir: str = "data/cache"  # prepared corpora, and downloads (shakespeare/, mnist/)
    seq_len: int = opt(128, min=1)
    batch_size: int = opt(16, min=1)  # per micro-step, per process
    num_workers: int = opt(0, min=0)
    prefetch_factor: int = opt(2, min=1)
    pin_memory: bool = True  # only takes effect on CUDA
    val_fraction: float = opt(0.1, min=0.0)
    log_ids: bool = False  # write each step's sample ids into metrics.jsonl (make verify's data audit)
    markov: MarkovConfig = field(default_factory=MarkovConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
