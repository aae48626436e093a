"""A text file as a character-level data set (data.name=text): the Python docs that ship inside
CPython when data.path is empty (no download, the embedded default), or any UTF-8 text file.

    python train.py                                   # configs/default.yaml: data.name=text
    python train.py data.path=my_corpus.txt
"""
from __future__ import annotations

from dataclasses import dataclass

from data.corpus import CorpusOptions, prepare_text, text_and_source
from data.tokens import token_data
from loop.config.fields import opt
from loop.data.bundle import Data


@dataclass
class TextOptions(CorpusOptions):
    path: str = opt("", path=True)  # a UTF-8 text file; empty: the Python docs in CPython


def build_text(cfg: TextOptions) -> Data:
    text, source = text_and_source(cfg.path)
    data = token_data(prepare_text(text, source, cfg.cache_dir, cfg.val_fraction), cfg.seq_len)
    data.meta["source"] = source  # the cache's meta.json names the path that prepared it first
    return data
