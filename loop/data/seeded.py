"""Each training sample's random draws (a crop, a mask, noise) seeded from its place in the order.

A Dataset that augments draws from the global random streams of whichever process fetches the
sample. In DataLoader workers those streams restart from the loader's seed at every iterator start
and the batches are dealt to workers round-robin from there, so a resumed run would draw other crops
than the uninterrupted one, and so would another `data.num_workers`. Seeding torch (CPU), `random`
and NumPy from `(run.seed, global sample position)` before each sample makes its draws a property
of its place in the global order: resume, workers and process count cannot change them.
The fetching process's own streams are put back after each batch, so with `num_workers=0` the
training streams (dropout) go on exactly as if nothing had been fetched.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch
from torch.utils.data import Dataset


def sample_seed(seed: int, position: int) -> int:
    """A 64-bit seed for global sample `position`, unrelated to its neighbours'."""
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SeededSamples(Dataset):
    """`ds` indexed by `(position, index)` pairs (loop/data/sampler.py::StreamSampler): sample `index`,
    fetched with every CPU random stream seeded for `position`."""

    def __init__(self, ds: Dataset, seed: int):
        self.ds, self.seed = ds, seed

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:  # the DataLoader's per-batch call
        py, npy = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):  # the CPU stream only: CUDA's are the training's
            try:
                out = []
                for position, index in keys:
                    s = sample_seed(self.seed, position)
                    torch.default_generator.manual_seed(s >> 1)  # not torch.manual_seed: it seeds CUDA too
                    random.seed(s)
                    np.random.seed(s & 0xFFFFFFFF)  # NumPy's global seed is 32 bits
                    out.append(self.ds[index])
                return out
            finally:
                random.setstate(py)
                np.random.set_state(npy)
