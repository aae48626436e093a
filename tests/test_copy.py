"""Bring your own model and data, as README.md tells a user to: copy the scaffold into a new project,
add a model and a dataset (about 40 lines) in files of their own, one line each to register them,
and a config; nothing in loop/ changes. The new project trains and passes `make verify` (but for its
two-process check, which batch norm fails by nature: the table says so)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from conftest import ROOT

MODEL = '''"""An MLP classifier: forward(batch) returns sums over the real targets (loop/evaluate.py).
Batch norm, as many users' models have: buffers beside the weights, one an integer scalar."""
import torch.nn as nn
import torch.nn.functional as F


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


def build_mlp(cfg, data):
    return MLP(data.train[0]["x"].numel(), cfg.n_embd, cfg.n_layer, data.vocab_size, cfg.dropout)
'''

DATASET = '''"""Points scattered around four centres, labelled by their centre."""
import numpy as np
import torch
from torch.utils.data import Dataset

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


def build_blobs(cfg):
    return Data(Blobs(4000, seed=0), Blobs(500, seed=1), vocab_size=4, seq_len=1)
'''

CONFIG = """run: {out_dir: runs/blobs}
data: {name: blobs, batch_size: 32}
model: {name: mlp, n_layer: 2, n_embd: 32, dropout: 0.1}
ema: {enabled: true}
optim: {lr: 0.01}
train: {max_steps: 150, grad_accum: 2, eval_every: 50, eval_batches: 8, ckpt_every: 50,
        best_metric: val_accuracy, best_mode: max, sample_tokens: 0, log_every: 50}
report: {plots: false}
"""


def outputs_and_environments(directory: str, names: list[str]) -> list[str]:
    """What a copy leaves behind: history, the venv, runs, caches."""
    skip = {".git", ".venv", "runs", "__pycache__", ".pytest_cache"}
    return [n for n in names if n in skip or (n == "cache" and directory.endswith("/data"))]


def test_a_copied_project_with_its_own_model_and_data_passes_make_verify(tmp_path):
    project = tmp_path / "myproject"
    shutil.copytree(ROOT, project, ignore=outputs_and_environments)
    (project / "model" / "mlp.py").write_text(MODEL)
    (project / "data" / "blobs.py").write_text(DATASET)
    with open(project / "model" / "__init__.py", "a") as f:
        f.write('\nfrom model.mlp import build_mlp  # noqa: E402\nBUILDERS["mlp"] = build_mlp\n')
    with open(project / "data" / "__init__.py", "a") as f:
        f.write('\nfrom data.blobs import build_blobs  # noqa: E402\nBUILDERS["blobs"] = build_blobs\n')
    (project / "configs" / "blobs.yaml").write_text(CONFIG)
    assert len((MODEL + DATASET).splitlines()) <= 50

    train = subprocess.run([sys.executable, "train.py", "--config", "configs/blobs.yaml"], cwd=project,
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout + train.stderr
    summary = json.loads((project / "runs" / "blobs" / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.9, summary  # four well-separated blobs: ~0.97 possible
    assert summary["best"]["metric"] == "val_accuracy"
    # Weights and buffers are hashed, the EMA averages them: BatchNorm's 0-dim integer
    # num_batches_tracked broke the hash at the end of every such run.
    assert len(summary["params_sha256"]) == len(summary["ema_params_sha256"]) == 64

    verify = subprocess.run(["make", "verify", f"PYTHON={sys.executable}",
                             "ARGS=--config configs/blobs.yaml --steps 12"], cwd=project,
                            capture_output=True, text=True, timeout=600)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for check in ("resume", "determinism", "accumulation", "clipping", "data", "eval"):
        assert any(line.split()[:2] == [check, "PASS"] for line in verify.stdout.splitlines()), verify.stdout
    # Two processes with batch norm cannot equal one with twice the batch: each rank normalises by
    # its own micro-batch. The check fails, as it should, but its usual cause blamed the loop
    # ("losses averaged per rank"); it now names the model's batch norm.
    ddp = subprocess.run([sys.executable, "-m", "tools.verify", "--config", "configs/blobs.yaml", "--steps", "8",
                          "--nproc", "2", "--checks", "ddp"], cwd=project, capture_output=True, text=True,
                         timeout=600)
    assert ddp.returncode == 1 and "ddp           FAIL" in ddp.stdout, ddp.stdout + ddp.stderr
    assert "ddp: usual cause: the model's batch norm (net.1, net.5) normalises by each rank's micro-batch " \
           "in training, so 2 processes cannot equal one with 2 times the batch" in ddp.stdout, ddp.stdout
