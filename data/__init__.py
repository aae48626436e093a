"""The project's data sets, by data.name: each a builder that takes its options (a dataclass that
extends loop.config.schema.DataSection, whose keys it adds to the config's `data` section) and
returns a `Data` bundle (loop/data/bundle.py). train.py hands DATASETS to the loop.

To add one: write `build_mine(cfg: MineOptions) -> Data` in a module of its own and name it here.
"""
from data.markov import build_markov
from data.mnist import build_mnist
from data.shakespeare import build_shakespeare
from data.synthetic import build_random
from data.text import build_text
from data.tokens import build_tokens

DATASETS = {"text": build_text, "markov": build_markov, "random": build_random, "tokens": build_tokens,
            "shakespeare": build_shakespeare, "mnist": build_mnist}
