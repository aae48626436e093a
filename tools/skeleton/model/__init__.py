"""The project's models, by model.name: each a builder that takes its options (a dataclass that
extends loop.config.schema.ModelSection, whose keys it adds to the config's `model` section) and
the data set, and returns an nn.Module whose `forward(batch)` returns the loss summed over the
batch's real targets (loop/contract.py). train.py hands MODELS to the loop.

To add one: write `build_other(cfg: OtherOptions, data: Data) -> nn.Module` in a module of its own
and name it here.
"""
from model.mine import build_mine

MODELS = {"mine": build_mine}
