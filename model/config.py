"""The `model` section of the config: options of every builder in model/BUILDERS.

A new model adds its options here (a field, or a sub-section like `cnn`), next to its builder;
nothing in loop/ changes. `n_layer`, `n_embd` and `dropout` are worth reusing for depth, width and
dropout in any model: tools like `make verify` set `model.dropout` when they need a model without
randomness.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loop.config.fields import opt


@dataclass
class CnnConfig:
    """model.name=cnn: two conv blocks (channels, then 2 x channels) and a hidden layer."""
    channels: int = opt(16, min=1)
    hidden: int = opt(64, min=1)


@dataclass
class ModelConfig:
    name: str = "gpt"  # a key of model.BUILDERS
    n_layer: int = opt(4, min=1)
    n_head: int = opt(4, min=1)
    n_embd: int = opt(128, min=1)
    dropout: float = opt(0.1, min=0.0, max=1.0)
    bias: bool = False
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    cnn: CnnConfig = field(default_factory=CnnConfig)
