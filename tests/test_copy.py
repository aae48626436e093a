"""A project of your own: `make new-project` makes one with no example in it that trains, passes its
own fast tests (a SIGKILLed run rerun bit-identical among them) and `make verify`; models and data
sets registered beside its own break none of that, and the examples come only on request."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from tools.new_project import project_name

pytestmark = pytest.mark.slow

MODEL = '''"""An MLP classifier with batch norm, as many users' models have: buffers beside the weights."""
from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from loop.config.fields import opt
from loop.config.schema import ModelSection


@dataclass
class MLPOptions(ModelSection):
    width: int = opt(32, min=1)
    depth: int = opt(2, min=1)
    dropout: float = 0.1


class MLP(nn.Module):
    def __init__(self, d_in, width, depth, classes, dropout):
        super().__init__()
        layers = []
        for i in range(depth):
            layers += [nn.Linear(d_in if i == 0 else width, width), nn.BatchNorm1d(width), nn.ReLU(),
                       nn.Dropout(dropout)]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))

    def forward(self, batch):
        logits, y = self.net(batch["x"]), batch["y"]
        return {"loss": F.cross_entropy(logits, y, ignore_index=-100, reduction="sum"),
                "accuracy": ((logits.argmax(-1) == y) & (y != -100)).sum().float()}


def build_mlp(cfg: MLPOptions, data):
    return MLP(data.train[0]["x"].numel(), cfg.width, cfg.depth, data.vocab_size, cfg.dropout)
'''

DATASET = '''"""Points scattered around four centres, labelled by their centre."""
import numpy as np
import torch
from torch.utils.data import Dataset

from loop.config.schema import DataSection
from loop.data.bundle import Data


class Blobs(Dataset):
    def __init__(self, n, seed):
        rng = np.random.default_rng(seed)
        self.y = rng.integers(0, 4, n)
        centres = np.array([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])
        self.x = (centres[self.y] + rng.normal(size=(n, 2))).astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": torch.from_numpy(self.x[i]), "y": torch.tensor(int(self.y[i])), "idx": i}


def build_blobs(cfg: DataSection) -> Data:
    return Data(Blobs(4000, seed=0), Blobs(500, seed=1), vocab_size=4, seq_len=1)
'''

CONFIG = """run: {out_dir: runs/blobs}
data: {name: blobs, batch_size: 32}
model: {name: mlp, width: 32}
ema: {enabled: true}
optim: {lr: 0.01}
train: {max_steps: 150, grad_accum: 2, eval_every: 50, eval_batches: 8, ckpt_every: 50,
        best_metric: val_accuracy, best_mode: max, log_every: 50}
report: {plots: false}
"""


def new_project(dest: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.new_project", str(dest), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def make(project: Path, target: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # Without the make this test runs under, which exports its command line's variables: this
    # suite's ARGS would reach the project's make (`make test ARGS="-k copy"`: all deselected).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")}
    return subprocess.run(["make", target, f"PYTHON={sys.executable}", *args], cwd=project,
                          capture_output=True, text=True, timeout=timeout, env=env)


def passed(stdout: str) -> set[str]:
    return {line.split()[0] for line in stdout.splitlines() if line.split()[1:2] == ["PASS"]}


def test_a_new_project_trains_passes_its_own_tests_and_make_verify_with_no_example(tmp_path):
    project = tmp_path / "myproj"
    made = new_project(project)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (project / "model").glob("*.py")) == ["__init__.py", "mine.py"]
    assert sorted(p.name for p in (project / "data").glob("*.py")) == ["__init__.py", "mine.py"]
    loop = "\n".join(p.read_text() for p in (project / "loop").rglob("*.py"))
    assert not re.search(r"model\.gpt|import GPT|from data[ .]|from model[ .]", loop)
    for path in ("pyproject.toml", "README.md", "Dockerfile", "scripts/slurm.sbatch"):  # named for DEST
        text = (project / path).read_text()
        assert "myproj" in text and "honest-loop" not in text, path

    tests = make(project, "test-fast", "JOBS=1")
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert re.search(r"\b[1-9]\d* passed", tests.stdout), tests.stdout
    verify = make(project, "verify", "ARGS=--steps 12")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert passed(verify.stdout) == {"resume", "determinism", "accumulation", "clipping", "data", "eval"}
    train = subprocess.run([sys.executable, "train.py"], cwd=project, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout + train.stderr
    s = json.loads((project / "runs" / "mine" / "summary.json").read_text())
    assert s["steps"] == 300 and s["val_loss"] < 0.1, s  # noise 0.1: its squared error is 0.01

    again = new_project(project)  # a second time over it: nothing of the first is touched
    assert again.returncode == 2 and "DEST" in again.stderr and str(project) in again.stderr


def test_a_dest_that_cannot_be_made_or_lies_in_the_scaffold_is_bad_input(tmp_path):
    # Not a traceback; not a copy of tools/ into tools/sub, which would copy itself until the disk
    # is full; not a project in tests/ (the scaffold's pytest then collects its tests twice) or
    # beside them (its runs would record the scaffold's git commit as theirs).
    (tmp_path / "a_file").write_text("kept")
    for dest, says in ((tmp_path / "a_file" / "proj", "cannot be made"), (ROOT / "tools" / "sub", f"inside {ROOT}"),
                       (ROOT / "tests" / "sub", f"inside {ROOT}"), (ROOT / "myproj", f"inside {ROOT}")):
        made = new_project(dest)
        assert made.returncode == 2 and f"DEST={dest}: {says}" in made.stderr, made.stderr
        assert not dest.exists()


def test_a_copy_that_fails_midway_is_bad_input_and_leaves_dest_as_it_was(tmp_path, monkeypatch, capsys):
    # A full disk, or an empty directory this user cannot write to: exit 2, and no half-made project
    # (a rerun would refuse it as a directory that is not empty).
    from tools import new_project as tool

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    new, empty = tmp_path / "a" / "b" / "new", tmp_path / "empty"
    empty.mkdir()
    # Each single file (after loop/ and the rest are copied), then every file copytree copies.
    for failing in ("copy2", "copyfile"):
        with monkeypatch.context() as m:
            m.setattr(shutil, failing, full)
            for dest in (new, empty):
                assert tool.main([str(dest)]) == 2
                err = capsys.readouterr().err
                assert f"DEST={dest}" in err and "No space left on device" in err and len(err) < 400, err
        assert not (tmp_path / "a").exists() and list(empty.iterdir()) == []


def test_a_dest_under_home_written_with_a_tilde_is_made_there(tmp_path):
    # make passes DEST=~/x on unexpanded; a directory named ~ in the scaffold was made.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    made = subprocess.run(["make", "new-project", "DEST=~/tilde proj", "EXAMPLES=0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**env, "HOME": str(tmp_path)})
    assert made.returncode == 0 and not (ROOT / "~").exists(), made.stderr
    assert sorted(p.name for p in (tmp_path / "tilde proj" / "model").glob("*.py")) == ["__init__.py", "mine.py"]


def test_a_dest_with_a_space_is_made_and_the_examples_come_only_from_the_scaffold(tmp_path):
    # The printed command pastes as it is; a project's own copy has no examples to give (it gave its
    # own data/ and model/ as examples, exit 0).
    project = tmp_path / "my proj"
    made = make(ROOT, "new-project", f"DEST={project}")
    assert made.returncode == 0 and f"cd '{project}' && make train" in made.stdout, made.stderr
    unset = make(ROOT, "new-project")  # the variable named, not the tool's positional "dest"
    assert unset.returncode == 2 and "DEST is not set" in unset.stderr, unset.stderr
    (project / "data" / "mine.py").rename(project / "data" / "reg.py")  # its own, as it tells one to
    again = subprocess.run([sys.executable, "-m", "tools.new_project", str(tmp_path / "q"), "--examples"],
                           cwd=project, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--examples" in again.stderr and not (tmp_path / "q").exists()


def test_a_project_made_from_a_project_named_like_a_common_word_is_named_where_names_are_said(tmp_path):
    # Its name is replaced only where a name is said: a project called "train" made from, its
    # train.py, trainer user and every "train" in the files stay as they are (a plain replace made
    # the Dockerfile start proj.py, and "test" renamed pytest and its settings).
    direct = tmp_path / "direct" / "proj"
    assert new_project(direct).returncode == 0
    source = ROOT
    for name in ("test", "train", "proj"):
        made = subprocess.run([sys.executable, "-m", "tools.new_project", str(tmp_path / name)], cwd=source,
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        source = tmp_path / name
    for path in ("pyproject.toml", "Dockerfile", "scripts/slurm.sbatch"):
        assert (source / path).read_text() == (direct / path).read_text(), path
    docker = (direct / "Dockerfile").read_text()
    assert "-t proj ." in docker and docker.count('" proj ') == 2 and "honest-loop" not in docker
    assert "--job-name=proj\n" in (direct / "scripts/slurm.sbatch").read_text()
    assert 'name = "proj"\n' in (direct / "pyproject.toml").read_text()


def test_a_project_is_named_for_its_directory_in_letters_digits_and_dashes():
    assert [project_name(Path(p)) for p in ("/x/My Proj_2", "/x/v1.0", "/x/--", "/x/ok")] == \
        ["my-proj-2", "v1-0", "my-project", "ok"]


def test_models_and_data_sets_registered_beside_ones_own_train_and_are_verified(tmp_path):
    # Bring your own model and data: a module each, one line each to register them, a config.
    project = tmp_path / "myproj"
    assert new_project(project).returncode == 0
    (project / "model" / "mlp.py").write_text(MODEL)
    (project / "data" / "blobs.py").write_text(DATASET)
    with open(project / "model" / "__init__.py", "a") as f:
        f.write('\nfrom model.mlp import build_mlp  # noqa: E402\n\nMODELS["mlp"] = build_mlp\n')
    with open(project / "data" / "__init__.py", "a") as f:
        f.write('\nfrom data.blobs import build_blobs  # noqa: E402\n\nDATASETS["blobs"] = build_blobs\n')
    (project / "configs" / "blobs.yaml").write_text(CONFIG)
    train = subprocess.run([sys.executable, "train.py", "--config", "configs/blobs.yaml"], cwd=project,
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout + train.stderr
    summary = json.loads((project / "runs" / "blobs" / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.9, summary  # four well-separated blobs: ~0.97 possible
    assert summary["best"]["metric"] == "val_accuracy"
    # Weights and buffers are hashed, the EMA averages them: both must take BatchNorm's 0-dim
    # integer num_batches_tracked, or the hash breaks at the end of every such run.
    assert len(summary["params_sha256"]) == len(summary["ema_params_sha256"]) == 64
    tests = make(project, "test-fast", "JOBS=1")
    assert tests.returncode == 0, tests.stdout + tests.stderr

    verify = make(project, "verify", "ARGS=--config configs/blobs.yaml --steps 12")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert passed(verify.stdout) == {"resume", "determinism", "accumulation", "clipping", "data", "eval"}
    # Two processes with batch norm cannot equal one with twice the batch: each rank normalises by
    # its own micro-batch. The check fails, as it should, naming the model's batch norm.
    ddp = subprocess.run([sys.executable, "-m", "tools.verify", "--config", "configs/blobs.yaml", "--steps",
                          "8", "--nproc", "2", "--checks", "ddp"], cwd=project, capture_output=True, text=True,
                         timeout=600)
    assert ddp.returncode == 1 and "ddp           FAIL" in ddp.stdout, ddp.stdout + ddp.stderr
    assert "ddp: usual cause: the model's batch norm (net.1, net.5) normalises by each rank's micro-batch " \
           "in training, so 2 processes cannot equal one with 2 times the batch" in ddp.stdout, ddp.stdout


def test_the_examples_come_on_request_beside_ones_own(tmp_path):
    project = tmp_path / "withexamples"
    assert new_project(project, "--examples").returncode == 0
    assert (project / "model" / "gpt.py").is_file() and (project / "configs" / "mnist.yaml").is_file()
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/text.yaml", "train.max_steps=2",
                          "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16",
                          "train.device=cpu", "report.plots=false", "train.eval_batches=1"], cwd=project,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    mine = subprocess.run([sys.executable, "train.py", "train.max_steps=2"], cwd=project, capture_output=True,
                          text=True, timeout=300)
    assert mine.returncode == 0, mine.stdout + mine.stderr
