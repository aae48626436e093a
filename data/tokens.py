"""Token files: fixed-length windows over a uint16 token file, read through `np.memmap`, and a
directory of them as a data set (`token_data`): data.name=tokens reads one you wrote yourself; the
text, markov, random and shakespeare data sets prepare one in data.cache_dir first.

    python train.py data.name=tokens data.path=DIR        # DIR: train.bin, val.bin, meta.json

Sample i is tokens [i*seq_len, i*seq_len + seq_len + 1): inputs x are the first seq_len tokens,
targets y the same shifted by one. Windows do not overlap, so an epoch sees every token once.
Each sample carries its index so audits can check that no sample is repeated or skipped.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loop.config.fields import opt
from loop.config.schema import DataSection
from loop.data.bundle import Data
from loop.errors import BadInput


class TokenWindows(Dataset):
    def __init__(self, path: Path, seq_len: int):
        self.path, self.seq_len = Path(path), seq_len
        self.n = max(0, (self.path.stat().st_size // 2 - 1) // seq_len)  # an empty file: none
        self._tokens = None  # opened lazily so each DataLoader worker maps the file itself

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict:  # a worker started by spawn (macOS, Windows): not the whole file
        return {**self.__dict__, "_tokens": None}

    def __getitem__(self, i: int) -> dict:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = i * self.seq_len
        chunk = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"x": chunk[:-1], "y": chunk[1:], "idx": i}  # x, y: (seq_len,)


def token_data(root: Path, seq_len: int, prepared: bool = True) -> Data:
    """`prepared`: written by this project into data.cache_dir (else data.name=tokens's own dir)."""
    try:
        meta = {"kind": "tokens", "source": str(root), **json.loads((root / "meta.json").read_text())}
        given = meta["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"data: {root}: expected a meta.json holding vocab_size ({e}).")
    # A string of digits as another tool may write it. uint16 ids: 1e10 built an embedding of
    # 1.28 TB (a traceback), and 103.5 passed as 103.
    vocab = int(given) if isinstance(given, str) and given.isdecimal() else given
    if type(vocab) is not int or not 1 <= vocab <= 2**16:
        raise BadInput(f"data: {root / 'meta.json'} says vocab_size {given!r}; expected an integer "
                       f"from 1 to 65536 (the files hold uint16 token ids).")
    meta["vocab_size"] = vocab
    if meta.get("dtype", "uint16") != "uint16":  # read as uint16, each id would be two wrong ones
        raise BadInput(f"data: {root / 'meta.json'} says dtype {meta['dtype']!r}; expected uint16 "
                       f"token ids (write the files as uint16).")
    again = f" (a cache in data.cache_dir: delete {root} and it is prepared again)" if prepared else ""
    if missing := [n for n in ("train.bin", "val.bin") if not (root / n).is_file()]:
        raise BadInput(f"data: {root} has no {' or '.join(missing)}; expected train.bin, val.bin and "
                       f"meta.json{again}.")
    chars = meta.get("chars")
    if meta["kind"] == "chars" and not (isinstance(chars, str) and len(chars) == vocab):
        # a KeyError at the start, or an IndexError at the first text sample (no model.pt)
        raise BadInput(f"data: {root / 'meta.json'} says kind chars, so expected \"chars\": a string of "
                       f"its vocab_size {vocab} characters{again}.")
    train, val = TokenWindows(root / "train.bin", seq_len), TokenWindows(root / "val.bin", seq_len)
    for name, ds in (("train", train), ("val", val)):
        if len(ds) == 0:
            raise BadInput(f"data: the {name} split of {meta['source']} is shorter than "
                           f"data.seq_len={seq_len} + 1 tokens; use a smaller data.seq_len.")
    check_files(root, meta, again)
    for name, ds in (("train", train), ("val", val)):  # a meta.json that gives no counts: the files'
        # sizes, so metadata.json identifies the data and a resume onto files written again says so
        meta.setdefault(f"{name}_tokens", ds.path.stat().st_size // 2)
    if meta["kind"] == "chars":
        decode = lambda ids: "".join(chars[i] for i in ids)  # noqa: E731
    else:
        decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    return Data(train, val, meta["vocab_size"], seq_len, decode, meta, unit="tokens")


def check_files(root: Path, meta: dict, again: str) -> None:
    """The token files against their meta.json. A prepared cache cut short would train on what is left
    without a word, and one overwritten (or another tokenizer's files) could hold an id past the
    vocabulary: an IndexError traceback at whichever step drew it (on CUDA, a device-side assert);
    32-bit ids read as uint16 would train on each id and a 0; one edited in place (same size, valid
    ids) would train on other tokens: where meta.json holds the files' tokens_sha256 (this
    project's caches), they are hashed too. Two passes over each file: the maximum, about 0.1 s a
    GB from the page cache, and sha256 (1.7 GB/s on a 2-core VM)."""
    for name in ("train.bin", "val.bin"):
        f, want = root / name, meta.get(f"{name[:-4]}_tokens")
        want = int(want) if isinstance(want, str) and want.isdecimal() else want  # as another tool may write it
        if want is not None and type(want) is not int:  # "4000 tokens" would pass unchecked
            raise BadInput(f"data: {root / 'meta.json'} says {name[:-4]}_tokens {want!r}; expected an "
                           f"integer, the tokens in {name}.")
        if want is not None and (size := f.stat().st_size) != 2 * want:
            raise BadInput(f"data: {f} has {size} bytes, but {root / 'meta.json'} says {want} tokens "
                           f"({2 * want} bytes): cut short or replaced since{again}.")
        ids = np.memmap(f, dtype=np.uint16, mode="r")
        head = ids[: 1 << 20]
        if want is None and len(head) >= 64 and head[::2].any() and not head[1::2].any():
            # 32- or 64-bit ids of a vocabulary under 65536 read as uint16: every id then a 0, all
            # in range, so nothing else here would see it. Where meta.json gives the token count
            # the size check above tells them apart (uint16 text can alternate with id 0 too).
            raise BadInput(f"data: {f}: every second uint16 is 0, as in 32- or 64-bit token ids; "
                           f"expected uint16 ids (write the files as uint16; if they are, give "
                           f"{name[:-4]}_tokens in meta.json){again}.")
        top = int(ids.max())
        if top >= meta["vocab_size"]:
            raise BadInput(f"data: {f} holds token id {top}, but {root / 'meta.json'} says "
                           f"vocab_size {meta['vocab_size']}; expected every id below it{again}.")
    if want := meta.get("tokens_sha256"):  # the same size, ids in range, but other tokens
        h = hashlib.sha256()
        for name in ("train.bin", "val.bin"):  # one hash over both, as write_tokens made it
            with open(root / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        if h.hexdigest() != want:
            raise BadInput(f"data: {root}'s train.bin and val.bin do not match the tokens_sha256 in "
                           f"its meta.json: edited since they were written{again}.")


@dataclass
class TokensOptions(DataSection):
    """data.name=tokens: a directory of token files written by another tokenizer's prepare script."""
    path: str = opt("", path=True)  # the directory holding train.bin, val.bin and meta.json
    seq_len: int = opt(128, min=1)  # tokens of context: targets per sample


def build_tokens(cfg: TokensOptions) -> Data:
    """A directory already holding train.bin / val.bin (uint16 token ids) and meta.json (at least
    `vocab_size`), e.g. written by another tokenizer's prepare script."""
    if not cfg.path:  # Path("") is ".": a token directory there would be read without being named
        raise BadInput("config key data.path (data.name=tokens): expected the directory holding "
                       "train.bin, val.bin and meta.json; got ''.")
    root = Path(cfg.path)
    missing = [n for n in ("train.bin", "val.bin", "meta.json") if not (root / n).is_file()]
    if missing:
        raise BadInput(f"config key data.path: {root} (data.name=tokens): expected a directory with "
                       f"train.bin, val.bin and meta.json; missing {', '.join(missing)}.")
    for name in ("train.bin", "val.bin"):
        if (size := (root / name).stat().st_size) % 2:
            raise BadInput(f"data: {root / name} has {size} bytes, an odd number; expected uint16 "
                           f"token ids, 2 bytes each.")
    return token_data(root, cfg.seq_len, prepared=False)
