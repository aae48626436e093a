"""Shared helpers for end-to-end tests: run train.py as a real subprocess (or its main in this
process, where no kill, signal or torchrun is involved), kill it, read its files."""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tools import jobs

# One intra-op thread for every torch in the whole test run: this process's (conftest is imported
# before any test module imports torch) and every train.py, torchrun and make verify it starts. On a
# 2-core box, two torchrun processes (or make test's two pytest workers) each spinning two
# OpenMP threads fight over the cores: 3x the wall time here, 10x for MNIST. And runs compared bit
# for bit then split their float sums the same way, whoever launched them.
os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parents[1]
# The default config, shrunk so a 40-step run takes about a second after startup. On the CPU even
# on a GPU machine: what these tests pin (bit-exactness, 2 processes) is proved on the CPU, and
# tests/test_cuda.py proves the CUDA paths.
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "data.seq_len=32",
        "data.batch_size=4", "train.log_every=1", "train.eval_every=10", "train.eval_batches=2",
        "train.sample_tokens=16", "report.plots=false",  # plots: tests/test_report.py
        "train.device=cpu"]


@pytest.fixture(scope="session", autouse=True)
def children_temp_dir(tmp_path_factory) -> None:
    """Every process the tests start keeps its temp files under pytest's own temp directory, which
    pytest prunes: torchrun leaves an empty torchelastic_* directory in the temp dir at each launch
    (its default log dir), 30-odd of them in /tmp per make test otherwise."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))


@pytest.fixture(autouse=True)
def hang_guard():
    """A test that hangs (a loop a bug keeps from ending) ends after 10 minutes with every thread's
    traceback, its worker reported crashed, instead of stalling the suite past CI's limit."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """One data cache for the whole test run, so the corpus is prepared once."""
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


class Mapped:
    """A dataset (map-style: len and [i]) whose items go through `fn(i, item)`: a user's data gone
    wrong in one way. `fn` at module level, so DataLoader workers can take it by any start method."""

    def __init__(self, ds, fn):
        self.ds, self.fn = ds, fn

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.fn(i, dict(self.ds[i]))


def augment(i: int, item: dict) -> dict:
    """Random augmentation as users write it, drawing from all three global streams: each input
    token is masked to 0 with probability 0.2 (torch) or 0.1 (NumPy), the first one half the time
    (`random`)."""
    import random

    import numpy as np
    import torch  # here, not at the top: torch must start after OMP_NUM_THREADS is set

    x = item["x"].clone()
    drop = (torch.rand(x.shape) < 0.2) | torch.from_numpy(np.random.rand(*x.shape) < 0.1)
    drop[0] |= random.random() < 0.5
    item["x"] = x.masked_fill(drop, 0)
    return item


def load_config(path, overrides=()):
    """loop.config.load.load_config with this project's data sets and models (train.py's)."""
    from data import DATASETS
    from loop.config.load import load_config as load
    from model import MODELS

    return load(path, list(overrides), DATASETS, MODELS)


def build_trainer(cfg, dist, device):
    """loop.build.build_trainer with this project's data sets and models (train.py's)."""
    from data import DATASETS
    from loop.build import build_trainer as build
    from model import MODELS

    return build(cfg, dist, device, DATASETS, MODELS)


def data_options(name: str, **keys):
    """The options of data set `name` (its builder's dataclass), `keys` set."""
    from data import DATASETS
    from loop.config.builders import options_of

    return options_of("data", name, DATASETS[name])(name=name, **keys)


def model_options(name: str, **keys):
    """The options of model `name` (its builder's dataclass), `keys` set."""
    from loop.config.builders import options_of
    from model import MODELS

    return options_of("model", name, MODELS[name])(name=name, **keys)


def gpt_then(change):
    """A model builder: the GPT's, then `change(model)` (which returns the model to train); it reads
    the GPT's keys (model.n_layer, ...), as a model of yours built on it would."""
    from model.gpt import GPTOptions, build_gpt

    def build(cfg: GPTOptions, data):
        return change(build_gpt(cfg, data))

    build.__annotations__["cfg"] = GPTOptions  # the class, not its name: imported here, not at the top
    return build


def token_data(vocab_size: int, seq_len: int):
    """What a model builder reads of a token data set (loop/data/bundle.py::Data), without one."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(vocab_size=vocab_size, seq_len=seq_len,
                           train=[{"x": torch.zeros(seq_len, dtype=torch.long)}])


def build_data(opts):
    """loop.build.build_data with this project's data sets."""
    from data import DATASETS
    from loop.build import build_data as build

    return build(opts, DATASETS)


def build_model(opts, data):
    """loop.build.build_model with this project's models."""
    from loop.build import build_model as build
    from model import MODELS

    return build(opts, data, MODELS)


def tiny(overrides) -> list[str]:
    """TINY, but for a run with a config file of its own (--config): the keys of the default's
    model and data set go, which another data set or model need not read."""
    if "--config" not in overrides:
        return TINY
    return [k for k in TINY if not k.startswith(("model.", "data.seq_len"))]


def train_cmd(out: Path, *overrides: str, nproc: int = 0, restarts: int = 0) -> list[str]:
    """python train.py ...; or, with nproc, the same under torchrun with nproc processes."""
    return jobs.train_cmd([f"run.out_dir={out}", *tiny(overrides), *overrides], nproc, restarts)


# Multi-process test runs; data.log_ids: each step's global sample ids, to compare process layouts.
DIST = ["train.max_steps=20", "train.ckpt_every=5", "model.dropout=0", "data.log_ids=true"]


@pytest.fixture(scope="session")
def two_proc(tmp_path_factory, cache) -> Path:
    """A 2-process DDP run of DIST: the reference the multi-process tests compare with."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    run_train(out, cache, *DIST, nproc=2)
    return out


def run_train(out: Path, *overrides: str, check: bool = True, nproc: int = 0, restarts: int = 0
              ) -> subprocess.CompletedProcess:
    """train.py to the end (under torchrun with `nproc`)."""
    proc = subprocess.run(train_cmd(out, *overrides, nproc=nproc, restarts=restarts), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_here(out: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """train.py's main in this process, its console captured, returned as run_train returns it:
    for runs whose exit code, console and files are all a test reads. It saves the 2-3 s an
    interpreter takes to start (importing torch); kills, signals and torchrun need run_train."""
    import contextlib
    import io

    import train

    argv = [f"run.out_dir={out}", *tiny(overrides), *overrides]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = train.main(argv)
    proc = subprocess.CompletedProcess(["train.py", *argv], code, stdout.getvalue(), stderr.getvalue())
    if check and code != 0:
        raise AssertionError(f"train.main exited {code}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_and_signal(out: Path, at_step: int, *overrides: str, sig: int = signal.SIGKILL,
                   group: bool = False, repeat: int = 1, nproc: int = 0) -> tuple[int, str]:
    """Start a run; once it reports `at_step`, send `sig` (`repeat` times; to the whole process
    group, as SLURM does, if `group`). Return its exit code and everything it printed."""
    return jobs.run_until(train_cmd(out, *overrides, nproc=nproc), at_step, sig, group, repeat,
                          tree=bool(nproc), cwd=ROOT)


def watchdog(proc: subprocess.Popen, seconds: float = 240):
    """SIGKILL the process and its descendants after `seconds` unless cancelled."""
    return jobs.watchdog(proc, seconds)


def run_and_kill(out: Path, at_step: int, *overrides: str) -> str:
    """Start a run and SIGKILL it as soon as it reports `at_step`; return what it printed."""
    code, printed = run_and_signal(out, at_step, *overrides)
    assert code == -signal.SIGKILL, printed
    return printed


def small_card(trainer, fits: int) -> list[int]:
    """A card that holds `fits` samples at a time (a test double): the trainer's model runs out of
    memory on a larger batch. Returns the list of batch sizes its forward is given, as they come."""
    import torch

    forward, sizes = trainer.raw.forward, []

    def forward_on_the_card(batch):
        sizes.append(len(batch["idx"]))
        if sizes[-1] > fits:
            raise torch.OutOfMemoryError(f"test double: at most {fits} samples fit")
        return forward(batch)

    trainer.raw.forward = forward_on_the_card
    return sizes


def out_of_memory_in_a_cycle() -> None:
    """Raise an out-of-memory error from a frame that keeps it: error -> traceback -> this frame ->
    error, a reference cycle that holds every frame it passed through, and their tensors (one held a
    failed try's 139 GiB on an H200) until the collector runs."""
    import torch

    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as e:
        kept = e
        raise kept


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_wall_time_sums_the_steps(s: dict, recs: list[dict]) -> None:
    """summary.json's wall_s is every step's time added up (checkpoint writes left out): at most the
    metrics' time between log lines (log_every=1 here), which holds the writes too, and most of it
    (0.8 of it here: TINY's checkpoint writes take about as long as a few of its 20 ms steps; 0.2
    leaves room for a slow disk). The last step's time alone is 1/20 to 1/40 of it."""
    total = sum(r["ms_per_step"] for r in recs) / 1000
    assert 0.2 * total <= s["wall_s"] <= total, (s["wall_s"], total)


def ids(out: Path) -> list[list[int]]:
    """The global sample ids of each step, in order (runs with data.log_ids=true)."""
    return [r["ids"] for r in metrics(out)]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())
