"""Models, one builder per `model.name`. The contract the loop relies on: `forward(batch)` returns
the loss summed over the batch's real targets (a scalar tensor), or a dict of such sums with the
loss under "loss" (loop/evaluate.py). `generate` is optional."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parameter import UninitializedParameter

from loop.errors import BadInput
from model.cnn import CNN
from model.gpt import GPT


def build_gpt(cfg, data) -> nn.Module:
    if cfg.n_embd % cfg.n_head:
        raise BadInput(f"config key model.n_embd: expected a multiple of model.n_head="
                       f"{cfg.n_head}; got {cfg.n_embd}.")
    return GPT(data.vocab_size, data.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout,
               cfg.bias, cfg.activation_checkpointing)


def build_cnn(cfg, data) -> nn.Module:
    shape = tuple(data.train[0]["x"].shape)  # one sample's (channels, height, width)
    if len(shape) != 3 or min(shape[1:]) < 4:
        raise BadInput(f"config key model.name=cnn: expected data whose samples are images (channels, "
                       f"height, width), height and width at least 4 (two 2x poolings); got x of "
                       f"shape {shape}.")
    return CNN(shape, data.vocab_size, cfg.cnn.channels, cfg.cnn.hidden, cfg.dropout)


BUILDERS = {"gpt": build_gpt, "cnn": build_cnn}


def build_model(cfg, data) -> nn.Module:
    if cfg.name not in BUILDERS:
        raise BadInput(f"config key model.name: expected one of {', '.join(BUILDERS)}; got {cfg.name!r}.")
    model = BUILDERS[cfg.name](cfg, data)
    if not any(p.requires_grad for p in model.parameters()):  # else blamed on the loss being detached
        frozen = sum(p.numel() for p in model.parameters())
        raise BadInput(f"config key model.name={cfg.name}: the model has no parameter to train "
                       f"({frozen:,} parameters, none with requires_grad=True); expected at least one.")
    refuse_what_the_loop_cannot_keep(model, f"config key model.name={cfg.name}")
    return model


def refuse_what_the_loop_cannot_keep(model: nn.Module, where: str) -> None:
    """Valid PyTorch the loop cannot train or keep, named before anything is written: each was a
    traceback, at the optimizer's build, the first clipping, or after the last step."""
    for name, p in model.named_parameters():
        if isinstance(p, UninitializedParameter):  # the optimizer, EMA and checkpoints need shapes
            raise BadInput(f"{where}: {name} is a lazy parameter (nn.LazyLinear...), still without a "
                           f"shape; expected sizes given when the model is built (or one forward in "
                           f"its builder).")
    for name, m in model.named_modules():
        if getattr(m, "sparse", False) is True:  # nn.Embedding(sparse=True), nn.EmbeddingBag
            raise BadInput(f"{where}: {name} makes sparse gradients (sparse=True), which gradient "
                           f"clipping and AdamW do not take; expected sparse=False.")
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):  # get_extra_state: hashed, averaged, sharded? no
            raise BadInput(f"{where}: its state_dict holds {key}, a {type(value).__name__} "
                           f"(get_extra_state), not a tensor; checkpoints, params_sha256, the EMA "
                           f"copy and FSDP take tensors; expected tensors only (keep it in a buffer).")
