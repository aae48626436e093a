"""MNIST (data.name=mnist): 28x28 handwritten digits, 60,000 to train on and 10,000 held out.

    python train.py --config configs/mnist.yaml
    python train.py --config configs/mnist.yaml data.path=/data/fashion-mnist   # your own IDX files

With `data.path` empty the four canonical files are downloaded once into `data.cache_dir/mnist`
(sha256 pinned, data/download.py), from PyTorch's mirror, then TensorFlow's, then the original site;
`data.url=<base>` replaces that list with one mirror (the checksums stay pinned). With `data.path` set,
that directory's four files of the same names (Fashion-MNIST, generated data, ...) are used as they
are: no checksum, but every file is validated (a `data.url` beside it is bad input). Sample i of a split is
{"x": (1, 28, 28) float32 normalised with MNIST's mean and std, "y": the label (int64), "idx": i}.
"""
from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from data.download import fetch
from loop.config.fields import opt
from loop.config.schema import DataSection
from loop.data.bundle import Data
from loop.errors import BadInput

FILES = {  # name -> sha256 of the canonical file (9,912,422, 28,881, 1,648,877 and 4,542 bytes)
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
BASE_URLS = ["https://ossci-datasets.s3.amazonaws.com/mnist/",  # PyTorch's mirror
             "https://storage.googleapis.com/cvdf-datasets/mnist/",  # TensorFlow's
             "http://yann.lecun.com/exdb/mnist/"]  # the original, often unreachable
SPLITS = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801  # IDX: unsigned bytes, 3 dims / 1 dim
SIDE, CLASSES = 28, 10
MEAN, STD = 0.1307, 0.3081  # of MNIST's training pixels in [0, 1]: inputs near zero mean, unit std


class Digits(Dataset):
    """Images (N, 28, 28) uint8 and labels (N,) uint8, kept as bytes in memory (47 MB for 60k) and
    normalised per sample."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        x = torch.from_numpy(self.images[i].astype(np.float32))  # (28, 28), a writable copy
        x = (x / 255 - MEAN) / STD
        return {"x": x[None], "y": torch.tensor(int(self.labels[i])), "idx": i}  # x: (1, 28, 28)


def read_idx(path: Path, magic: int, dims: tuple[int, ...]) -> np.ndarray:
    """A gzipped IDX file as a uint8 array (n, *dims): big-endian header (magic, then one uint32 per
    dimension), then the bytes. BadInput names the file and what was expected on any mismatch."""
    items = f"items of shape {dims}" if dims else "one byte per item"
    what = f"a gzipped IDX file with magic 0x{magic:08x} and {items}"
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:  # EOFError: the gzip stream is cut short
        raise BadInput(f"data: {path}: cannot decompress it ({e}); expected {what}.")
    header = 4 * (2 + len(dims))
    if len(raw) < header:
        raise BadInput(f"data: {path}: {len(raw)} bytes, shorter than its header; expected {what}.")
    got, n, *shape = np.frombuffer(raw, ">u4", count=2 + len(dims)).tolist()
    if got != magic:
        raise BadInput(f"data: {path}: magic number 0x{got:08x}; expected {what}.")
    if tuple(shape) != dims:
        raise BadInput(f"data: {path}: items of shape {tuple(shape)}; expected {what}.")
    size = header + n * int(np.prod(dims))
    if len(raw) != size:
        raise BadInput(f"data: {path}: {len(raw)} bytes after decompression; its header promises "
                       f"{n} items, {size} bytes (truncated or padded?); expected {what}.")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(n, *dims)


def load_split(root: Path, images_name: str, labels_name: str) -> Digits:
    images = read_idx(root / images_name, IMAGES_MAGIC, (SIDE, SIDE))
    labels = read_idx(root / labels_name, LABELS_MAGIC, ())
    if len(images) != len(labels) or len(labels) == 0:
        raise BadInput(f"data: {root / labels_name} holds {len(labels)} labels and {root / images_name} "
                       f"{len(images)} images; expected one label per image, and at least one.")
    if (bad := np.flatnonzero(labels >= CLASSES)).size:
        raise BadInput(f"data: {root / labels_name}: label {labels[bad[0]]} at item {bad[0]} "
                       f"({bad.size} such); expected labels 0-{CLASSES - 1}.")
    return Digits(images, labels)


@dataclass
class MnistOptions(DataSection):
    path: str = opt("", path=True)  # a directory of your own four IDX files; empty: the canonical ones
    url: str = ""  # a mirror's base URL to download from instead
    cache_dir: str = opt("data/cache", path="dir")  # downloads go to its mnist/


def build_mnist(cfg: MnistOptions) -> Data:
    """Digit images and their labels: one target per sample, 10 classes, nothing to decode."""
    train, val, meta = mnist_splits(cfg)
    return Data(train, val, vocab_size=CLASSES, seq_len=1, decode=None, meta=meta)


def mnist_splits(cfg: MnistOptions) -> tuple[Digits, Digits, dict]:
    """(train, val, meta) from data.path's own files, or from the verified download in the cache."""
    if cfg.path:
        if cfg.url:  # ignored, it trained on data.path's files as if it had read the URL's
            raise BadInput(f"config keys data.path={cfg.path} and data.url={cfg.url} (data.name=mnist): "
                           f"data.path's own files are read, nothing is downloaded; expected one of "
                           f"the two (the other empty).")
        root = Path(cfg.path)
        missing = [n for n in FILES if not (root / n).is_file()]
        if missing:
            raise BadInput(f"config key data.path: {root} (data.name=mnist): expected a directory with "
                           f"the four IDX files {', '.join(FILES)}; missing {', '.join(missing)}.")
        source = str(root)
    else:
        root = Path(cfg.cache_dir) / "mnist"
        bases = [cfg.url] if cfg.url else BASE_URLS
        for name, sha256 in FILES.items():
            try:
                fetch(name, [f"{base.rstrip('/')}/{name}" for base in bases], sha256, root,
                      origin=BASE_URLS[0] + name)
            except BadInput as e:  # placing files by hand: say that all four go there
                raise BadInput(f"{e} MNIST needs all four files in {root.resolve()}: "
                               f"{', '.join(FILES)}, from the same place.") from None
        source = f"MNIST ({root}, sha256 verified)"
    train, val = (load_split(root, *SPLITS[s]) for s in ("train", "val"))
    meta = {"kind": "images", "source": source, "classes": CLASSES, "train_images": len(train),
            "val_images": len(val)}
    return train, val, meta
