"""Models, one builder per `model.name`. The contract the loop relies on: `forward(batch)` returns
the loss summed over the batch's real targets (a scalar tensor). `generate` is optional."""
from __future__ import annotations

import torch.nn as nn

from loop.errors import BadInput
from model.gpt import GPT


def build_gpt(cfg, data) -> nn.Module:
    if cfg.n_embd % cfg.n_head:
        raise BadInput(f"config key model.n_embd: expected a multiple of model.n_head="
                       f"{cfg.n_head}; got {cfg.n_embd}.")
    return GPT(data.vocab_size, data.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout,
               cfg.bias, cfg.activation_checkpointing)


BUILDERS = {"gpt": build_gpt}


def build_model(cfg, data) -> nn.Module:
    if cfg.name not in BUILDERS:
        raise BadInput(f"config key model.name: expected one of {', '.join(BUILDERS)}; got {cfg.name!r}.")
    return BUILDERS[cfg.name](cfg, data)
