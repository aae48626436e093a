"""A Hugging Face causal LM, wrapped as docs/bring-your-own.md shows, trains in the loop and resumes
bit for bit; the library's own `.loss` (a mean) is refused before anything is written. Runs where
`transformers` is installed (it is the user's dependency, not the loop's)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
import torch.nn as nn
import torch.nn.functional as F

from conftest import metrics, summary, train_here
from loop.config.fields import opt
from loop.config.schema import ModelSection
from loop.data.bundle import Data

transformers = pytest.importorskip("transformers")


@dataclass
class HFOptions(ModelSection):  # the GPT's size keys, so the tests' tiny settings (TINY) apply
    n_layer: int = opt(2, min=1)
    n_head: int = opt(2, min=1)
    n_embd: int = opt(32, min=1)
    library_loss: bool = False  # return the library's .loss (labels=): a mean, of targets shifted twice


class CausalLM(nn.Module):
    def __init__(self, lm: nn.Module, library_loss: bool):
        super().__init__()
        self.lm, self.library_loss = lm, library_loss

    def forward(self, batch: dict):
        if self.library_loss:
            return self.lm(input_ids=batch["x"], labels=batch["y"]).loss
        logits = self.lm(input_ids=batch["x"]).logits  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten(), ignore_index=-100,
                               reduction="sum")


def build_hf(cfg: HFOptions, data: Data) -> CausalLM:
    # bos/eos None: GPT-2's 50256 lies outside a small vocabulary (the library warns at every build)
    config = transformers.GPT2Config(vocab_size=data.vocab_size, n_positions=data.seq_len,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                     bos_token_id=None, eos_token_id=None)
    return CausalLM(transformers.GPT2LMHeadModel(config), cfg.library_loss)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    from model import MODELS

    monkeypatch.setitem(MODELS, "hf", build_hf)


HF = ["model.name=hf", "train.max_steps=8", "train.ckpt_every=4", "train.eval_every=4"]


def test_a_wrapped_library_model_trains_and_resumes_bit_for_bit(tmp_path, cache):
    ref, out = tmp_path / "ref", tmp_path / "run"
    train_here(ref, cache, *HF)
    losses = [r["loss"] for r in metrics(ref)]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    # The run as if stopped after step 4's checkpoint: its newest step, summary and report gone.
    train_here(out, cache, *HF)
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    for name in ("summary.json", "report.md"):
        (out / name).unlink(missing_ok=True)
    rerun = train_here(out, cache, *HF)
    assert "at step 4" in rerun.stdout, rerun.stdout
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]
    assert [r["loss"] for r in metrics(out)] == losses


def test_the_librarys_mean_loss_is_refused_before_anything_is_written(tmp_path, cache):
    out = tmp_path / "run"
    proc = train_here(out, cache, *HF, "model.library_loss=true", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'reduction="sum"' in proc.stderr, proc.stderr
    assert not out.exists()
