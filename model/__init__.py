"""The project's models, by model.name: each a builder that takes its options (a dataclass that
extends loop.config.schema.ModelSection, whose keys it adds to the config's `model` section) and the
data set (loop/data/bundle.py: vocab_size, seq_len, ...), and returns an nn.Module whose
`forward(batch)` returns the loss summed over the batch's real targets (loop/contract.py). train.py
hands MODELS to the loop.

To add one: write `build_mine(cfg: MineOptions, data: Data) -> nn.Module` in a module of its own and
name it here.
"""
from model.cnn import build_cnn
from model.gpt import build_gpt

MODELS = {"gpt": build_gpt, "cnn": build_cnn}
