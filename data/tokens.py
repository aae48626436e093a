"""Fixed-length windows over a uint16 token file, read through `np.memmap`.

Sample i is tokens [i*seq_len, i*seq_len + seq_len + 1): inputs x are the first seq_len tokens,
targets y the same shifted by one. Windows do not overlap, so an epoch sees every token once.
Each sample carries its index so audits can check that no sample is repeated or skipped.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class TokenWindows(Dataset):
    def __init__(self, path: Path, seq_len: int):
        self.path, self.seq_len = Path(path), seq_len
        self.n = max(0, (self.path.stat().st_size // 2 - 1) // seq_len)  # an empty file: none
        self._tokens = None  # opened lazily so each DataLoader worker maps the file itself

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = i * self.seq_len
        chunk = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"x": chunk[:-1], "y": chunk[1:], "idx": i}  # x, y: (seq_len,)
