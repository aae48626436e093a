"""Turn text (or a synthetic token stream) into `train.bin` / `val.bin` (uint16 ids) + `meta.json`.

`train.py` does this on first use of a corpus; `python -m data.prepare` (data/prepare.py) does it
ahead of time. The output directory is named after the content's sha256, so preparing twice is
free and two corpora never collide. Files are written into a temp directory and renamed into
place, so a kill mid-prepare leaves nothing half-written. Readers use `np.memmap`, so a corpus far
larger than RAM works the same way.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loop.checkpoint.atomic import fsync_dir, write_synced
from loop.config.fields import opt
from loop.config.paths import writable_dir
from loop.config.schema import DataSection
from loop.errors import BadInput


@dataclass
class CorpusOptions(DataSection):
    """The options of a data set prepared into token files in a cache (text, markov, random, shakespeare)."""
    cache_dir: str = opt("data/cache", path="dir")  # prepared corpora, and downloads
    seq_len: int = opt(128, min=1)  # tokens of context: targets per sample
    val_fraction: float = opt(0.1, min=0.0)  # the last part of the tokens, held out for validation


def text_and_source(path: str) -> tuple[str, str]:
    """The text of file `path` and its name; with no path, the CPython reference docs
    (`pydoc_data.topics`): ~460k characters, present everywhere."""
    if path:
        return read_text(path), path
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics"


def read_text(path: str) -> str:
    """The file's characters as they are: read_text's newline translation turns \r\n and \r into
    \n, and the model would train on other text than the file's, under a sha256 no file has."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"data.path {path}: cannot read it as UTF-8 text ({e}).")


def held_out(n: int, val_fraction: float) -> int:
    """How many of `n` tokens the last `val_fraction` holds for validation; BadInput unless each
    side gets at least 2."""
    if val_fraction >= 1:  # else "splits 60 tokens into -30 for training" (python -m data.prepare too)
        raise BadInput(f"data: data.val_fraction={val_fraction}: expected a fraction below 1, the "
                       f"share of the data held out for validation.")
    n_val = int(n * val_fraction)
    if n_val < 2 or n - n_val < 2:
        fix = "raise it" if n_val < 2 else "lower it"
        raise BadInput(f"data: data.val_fraction={val_fraction} splits {n} tokens into "
                       f"{n - n_val} for training and {n_val} for validation; expected at "
                       f"least 2 in each (every run validates, at its end at least): {fix}, or "
                       f"give more data.")
    return n_val


def sized(n: float) -> str:
    """A byte count for a message: 20.0 TB, 512.0 MB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}"
        n /= 1000


def room_for(key: str, tokens: int, out_dir: Path) -> None:
    """Refuse `tokens` generated tokens (config key `key`) whose token files the free space of
    data.cache_dir cannot hold, before generating them: the write would fail only after the
    generation, and a count far past any disk (2**63) is NumPy's ValueError, a traceback."""
    there = out_dir.parent.absolute()
    while not there.exists():  # the nearest part of data.cache_dir that exists: made when written
        there = there.parent
    need, free = 2 * tokens, shutil.disk_usage(there).free  # train.bin + val.bin: uint16 ids
    if need > free:
        raise BadInput(f"config key {key}={tokens}: its token files take {sized(need)} (2 bytes a "
                       f"token), and {there} has {sized(free)} free; expected fewer tokens: lower it, "
                       f"or free space in data.cache_dir.")


@contextmanager
def generating(key: str, tokens: int):
    """Generating `tokens` tokens (config key `key`) into arrays this machine cannot allocate is exit 2
    naming the key, not NumPy's MemoryError traceback; nothing is in the cache yet (write_tokens
    allocates before it writes, and removes its temp dir on any error)."""
    try:
        yield
    except MemoryError as e:  # NumPy's names the size of the array it could not allocate
        raise BadInput(f"config key {key}={tokens}: more tokens than this machine can hold in memory to "
                       f"generate ({e}; their token files alone take {sized(2 * tokens)}); expected "
                       f"fewer tokens: lower it.") from None


def write_tokens(out_dir: Path, ids: np.ndarray, val_fraction: float, meta: dict) -> Path:
    """Split `ids` (last `val_fraction` is validation) and write the three files atomically."""
    if (out_dir / "meta.json").exists():
        return out_dir
    n_val = held_out(len(ids), val_fraction)
    writable_dir("config key data.cache_dir", str(out_dir.parent))  # a read-only one: prepared only
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    train, val = ids[:-n_val].astype(np.uint16).tobytes(), ids[-n_val:].astype(np.uint16).tobytes()
    meta = {**meta, "train_tokens": len(ids) - n_val, "val_tokens": n_val,
            "tokens_sha256": hashlib.sha256(train + val).hexdigest()}  # data/tokens.py checks it
    # A name no other process has: processes in other PID namespaces (containers sharing a cache
    # on network storage) have the same PIDs, and each would write into, or delete, the other's.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    tmp.mkdir()
    try:
        write_synced(tmp / "train.bin", train)
        write_synced(tmp / "val.bin", val)
        write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    except BaseException:  # a full disk, Ctrl-C: no half-written corpus is left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process prepared the same corpus first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "meta.json").exists():  # not a race: a cache damaged by hand is in the way
            raise BadInput(f"data: {out_dir} holds no meta.json, so it is no prepared cache; delete "
                           f"it and it is prepared again.") from None
    fsync_dir(out_dir.parent)
    return out_dir


def prepare_text(text: str, source: str, cache_dir: str, val_fraction: float) -> Path:
    """Character-level tokens: the vocabulary is the sorted set of characters in the text."""
    sha = hashlib.sha256(text.encode()).hexdigest()
    out = Path(cache_dir) / f"text-{sha[:16]}-val{val_fraction!r}"
    if (out / "meta.json").exists():
        return out
    if not text:  # else named as a split of 0 tokens, blaming data.val_fraction
        raise BadInput(f"data: {source} is empty; expected text to train on.")
    held_out(len(text), val_fraction)  # a split that cannot work is refused before "preparing"
    chars = sorted(set(text))
    if len(chars) > 2**16:  # ids 0-65535
        raise BadInput(f"data: {source} has {len(chars):,} distinct characters; expected at most "
                       f"65,536 (a token file holds uint16 ids).")
    print(f"preparing {source}: {len(text):,} characters, vocabulary {len(chars)} -> {out}")
    lut = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lut[c] for c in text), dtype=np.uint16, count=len(text))
    meta = {"kind": "chars", "source": source, "sha256": sha, "vocab_size": len(chars),
            "chars": "".join(chars)}
    return write_tokens(out, ids, val_fraction, meta)
