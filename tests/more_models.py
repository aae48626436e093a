"""train.py with more models and data sets, for the tests of what users' own do under DDP and FSDP.

Models: `gpt_spare`, the GPT plus a head its forward never uses (parameters that get no gradient);
`gpt_first_micro`, the GPT plus a layer its forward uses in every other training call only;
`gpt_frozen`, the GPT with its position embeddings frozen (requires_grad=False);
`gpt_bn`, the GPT with batch norm over its embeddings (buffers the forward updates);
`gpt_bn_spare_bf16`, `gpt_spare` with that batch norm and its weights in bfloat16 (a checkpoint
loaded in bf16 to fine-tune); `gpt_wrong`, the GPT with a bug in its forward (embeddings one feature
too wide); and two that FSDP cannot shard: `gpt_scalar`, with a parameter of shape (), and
`gpt_shared`, its second block the first one again (weights shared across layers). Data sets:
`text_broken`, the text corpus with training samples that raise (a user's Dataset bug);
`text_augmented`, the text corpus with random augmentation (conftest.augment); `text_masked`, the
text corpus with a varying number of each sample's targets masked (-100); `text_per_node`, the text
corpus one sample shorter on rank 1 (a node with another copy of the data).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/more_models.py k=v ...
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from conftest import Mapped, augment  # noqa: E402 (this file's directory is on sys.path)
from data import DATASETS  # noqa: E402
from data.text import TextOptions, build_text  # noqa: E402
from loop.data.bundle import Data  # noqa: E402
from model import MODELS  # noqa: E402
from model.gpt import GPTOptions, build_gpt  # noqa: E402


def broken(i: int, item: dict) -> dict:
    if i % 100 == 7:  # one in a hundred: the first step meets one within a few steps
        raise ValueError(f"sample {i} cannot be read")
    return item


def text_broken(cfg: TextOptions) -> Data:
    d = build_text(cfg)
    d.train = Mapped(d.train, broken)
    return d


def mask_some(i: int, item: dict) -> dict:
    y = item["y"].clone()
    y[: (i * 7) % y.numel()] = -100  # 0 to seq_len - 1 targets masked: ranks hold different counts
    return {**item, "y": y}


def text_masked(cfg: TextOptions) -> Data:
    d = build_text(cfg)
    d.train = Mapped(d.train, mask_some)
    return d


def text_augmented(cfg: TextOptions) -> Data:
    d = build_text(cfg)
    d.train = Mapped(d.train, augment)
    return d


def text_per_node(cfg: TextOptions) -> Data:
    d = build_text(cfg)
    if os.environ.get("RANK") == "1":
        d.train = torch.utils.data.Subset(d.train, range(len(d.train) - 1))  # item i is still idx i
        d.meta = {**d.meta, "train_tokens": d.meta["train_tokens"] - 1}
    return d


class TokenNorm(nn.BatchNorm1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C), normalised per channel
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


def gpt_spare(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.spare = nn.Linear(cfg.n_embd, 2)
    return m


class EveryOther(nn.Module):
    """`inner`, after `extra` in training's odd-numbered calls only: with train.grad_accum=2, in each
    step's first micro-batch and never in its last (a path that depends on the data)."""

    def __init__(self, inner: nn.Module, n: int):
        super().__init__()
        self.inner, self.extra, self.calls = inner, nn.Linear(n, n), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            x = x + self.extra(x) if self.calls % 2 else x
        return self.inner(x)


def gpt_first_micro(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.drop = EveryOther(m.drop, cfg.n_embd)
    return m


def gpt_frozen(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.wpe.weight.requires_grad_(False)  # frozen, as a fine-tune (LoRA) leaves most weights
    return m


def gpt_bn(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.drop = nn.Sequential(TokenNorm(cfg.n_embd), m.drop)  # applied to the embeddings
    return m


def gpt_bn_spare_bf16(cfg: GPTOptions, data: Data) -> nn.Module:
    m = gpt_spare(cfg, data)
    m.drop = nn.Sequential(TokenNorm(cfg.n_embd), m.drop)  # applied to the embeddings
    return m.to(torch.bfloat16)


def gpt_wrong(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.drop = nn.Linear(cfg.n_embd, cfg.n_embd + 1)  # the blocks' first LayerNorm refuses its input
    return m


def gpt_scalar(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.temperature = nn.Parameter(torch.tensor(1.0))
    return m


def gpt_shared(cfg: GPTOptions, data: Data) -> nn.Module:
    m = build_gpt(cfg, data)
    m.blocks[1] = m.blocks[0]
    return m


if __name__ == "__main__":
    MODELS.update(gpt_spare=gpt_spare, gpt_frozen=gpt_frozen, gpt_bn=gpt_bn, gpt_bn_spare_bf16=gpt_bn_spare_bf16,
                  gpt_wrong=gpt_wrong, gpt_scalar=gpt_scalar, gpt_shared=gpt_shared, gpt_first_micro=gpt_first_micro)
    DATASETS.update(text_broken=text_broken, text_augmented=text_augmented, text_masked=text_masked,
                    text_per_node=text_per_node)
    sys.exit(train.main())
