"""Datasets, one builder per `data.name`, each returning a `Data` bundle (loop/data/bundle.py) that the
loop consumes.

To add a task: write a builder `build_mine(cfg) -> Data` in a module of its own, import it and add
it to BUILDERS (`from data.mine import build_mine`, `BUILDERS["mine"] = build_mine`), and its
options, if any, to data/config.py.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from data.corpus import embedded_text, prepare_text, read_text, write_tokens
from data.markov import prepare_markov
from data.mnist import CLASSES, mnist_splits
from data.shakespeare import prepare_shakespeare
from data.tokens import TokenWindows
from loop.data.bundle import Data, check_samples
from loop.errors import BadInput


def _token_data(root: Path, seq_len: int, prepared: bool = True) -> Data:
    """`prepared`: written by this project into data.cache_dir (else data.name=tokens's own dir)."""
    try:
        meta = {"kind": "tokens", "source": str(root), **json.loads((root / "meta.json").read_text())}
        given = meta["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"data: {root}: expected a meta.json holding vocab_size ({e}).")
    # A string of digits as another tool may write it. uint16 ids: 1e10 built an embedding of
    # 1.28 TB (a traceback), and 103.5 passed as 103.
    vocab = int(given) if isinstance(given, str) and given.isdigit() else given
    if type(vocab) is not int or not 1 <= vocab <= 2**16:
        raise BadInput(f"data: {root / 'meta.json'} says vocab_size {given!r}; expected an integer "
                       f"from 1 to 65536 (the files hold uint16 token ids).")
    meta["vocab_size"] = vocab
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
    _check_files(root, meta, again)
    if meta["kind"] == "chars":
        decode = lambda ids: "".join(chars[i] for i in ids)  # noqa: E731
    else:
        decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    return Data(train, val, meta["vocab_size"], seq_len, decode, meta)


def _check_files(root: Path, meta: dict, again: str) -> None:
    """The token files against their meta.json. A prepared cache cut short trained on what was left
    without a word, and one overwritten (or another tokenizer's files) held an id past the
    vocabulary: an IndexError traceback at whichever step drew it (on CUDA, a device-side assert);
    one edited in place (same size, valid ids) trained on other tokens: where meta.json holds the
    files' tokens_sha256 (this project's caches), they are hashed too. Two passes over each file:
    the maximum, about 0.1 s a GB from the page cache, and sha256 (1.7 GB/s on this 2-core VM)."""
    for name in ("train.bin", "val.bin"):
        f, want = root / name, meta.get(f"{name[:-4]}_tokens")
        if isinstance(want, int) and (size := f.stat().st_size) != 2 * want:
            raise BadInput(f"data: {f} has {size} bytes, but {root / 'meta.json'} says {want} tokens "
                           f"({2 * want} bytes): cut short or replaced since{again}.")
        top = int(np.memmap(f, dtype=np.uint16, mode="r").max())
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


def build_text(cfg) -> Data:
    text, source = (read_text(cfg.path), cfg.path) if cfg.path else (embedded_text(), "pydoc_data.topics")
    data = _token_data(prepare_text(text, source, cfg.cache_dir, cfg.val_fraction), cfg.seq_len)
    data.meta["source"] = source  # the cache's meta.json names the path that prepared it first
    return data


def build_markov(cfg) -> Data:
    m = cfg.markov
    root = prepare_markov(m.vocab_size, m.branching, m.tokens, m.seed, cfg.cache_dir, cfg.val_fraction)
    return _token_data(root, cfg.seq_len)


def build_random(cfg) -> Data:
    s = cfg.synthetic
    if s.vocab_size > 2**16:  # token files hold uint16 ids
        raise BadInput(f"config key data.synthetic.vocab_size: expected at most 65536; got {s.vocab_size}.")
    out = Path(cfg.cache_dir) / f"random-v{s.vocab_size}-n{s.tokens}-s{s.seed}-val{cfg.val_fraction!r}"
    if not (out / "meta.json").exists():
        ids = np.random.default_rng(s.seed).integers(0, s.vocab_size, s.tokens, dtype=np.uint16)
        meta = {"kind": "random", "source": f"random(vocab={s.vocab_size}, seed={s.seed})",
                "vocab_size": s.vocab_size, "optimal_loss": math.log(s.vocab_size)}
        write_tokens(out, ids, cfg.val_fraction, meta)
    return _token_data(out, cfg.seq_len)


def build_tokens(cfg) -> Data:
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
    return _token_data(root, cfg.seq_len, prepared=False)


def build_shakespeare(cfg) -> Data:
    """TinyShakespeare, downloaded once and verified (data/shakespeare.py), character level."""
    return _token_data(prepare_shakespeare(cfg), cfg.seq_len)


def build_mnist(cfg) -> Data:
    """Digit images and their labels: one target per sample, 10 classes, nothing to decode."""
    train, val, meta = mnist_splits(cfg)
    return Data(train, val, vocab_size=CLASSES, seq_len=1, decode=None, meta=meta)


BUILDERS = {"text": build_text, "markov": build_markov, "random": build_random, "tokens": build_tokens,
            "shakespeare": build_shakespeare, "mnist": build_mnist}


# The keys each built-in data set does not read. One set there was meant for another data set:
# `data.path=DIR` with configs/gpt2_124m.yaml (data.name=random, where data.name=tokens reads DIR)
# trained on random tokens without a word. A builder of your own is not checked.
UNREAD = {"text": ("url",), "markov": ("path", "url"), "random": ("path", "url"), "tokens": ("url",),
          "shakespeare": ("path",)}


def build_data(cfg) -> Data:
    if cfg.name not in BUILDERS:
        raise BadInput(f"config key data.name: expected one of {', '.join(BUILDERS)}; got {cfg.name!r}.")
    for key in UNREAD.get(cfg.name, ()):
        if value := getattr(cfg, key):
            readers = ", ".join(n for n in BUILDERS if key not in UNREAD.get(n, ()))
            raise BadInput(f"config key data.{key}={value}: data.name={cfg.name} does not read it "
                           f"(data.{key} is for {readers}); set data.name to the data set it is "
                           f"for, or data.{key}= (empty).")
    data = BUILDERS[cfg.name](cfg)
    check_samples(data, cfg.name)
    return data
