"""TinyShakespeare (data.name=shakespeare): 1.1 MB of Shakespeare's plays, character level.

    python train.py --config configs/shakespeare_char.yaml

The file is downloaded once into `data.cache_dir/shakespeare/input.txt` (sha256 pinned, data/download.py)
and prepared like any text file (data/corpus.py): 65 distinct characters, the last
`data.val_fraction` of it held out. `data.url=<base>` fetches `<base>/input.txt` from a mirror instead;
the checksum stays pinned. Offline, place the file there by hand (the error message says where).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data.corpus import CorpusOptions, prepare_text, read_text
from data.download import fetch
from data.tokens import token_data
from loop.data.bundle import Data

URLS = ["https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "https://cdn.jsdelivr.net/gh/karpathy/char-rnn@master/data/tinyshakespeare/input.txt"]
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # 1,115,394 bytes


@dataclass
class ShakespeareOptions(CorpusOptions):
    url: str = ""  # a mirror's base URL serving input.txt; empty: GitHub, then jsDelivr


def build_shakespeare(cfg: ShakespeareOptions) -> Data:
    return token_data(prepare_shakespeare(cfg), cfg.seq_len)


def prepare_shakespeare(cfg: ShakespeareOptions) -> Path:
    """The prepared token directory (train.bin, val.bin, meta.json) of the verified download."""
    urls = [f"{cfg.url.rstrip('/')}/input.txt"] if cfg.url else URLS
    path = fetch("input.txt", urls, SHA256, Path(cfg.cache_dir) / "shakespeare", origin=URLS[0])
    return prepare_text(read_text(str(path)), f"tinyshakespeare ({path})", cfg.cache_dir, cfg.val_fraction)
