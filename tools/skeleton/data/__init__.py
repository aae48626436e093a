"""The project's data sets, by data.name: each a builder that takes its options (a dataclass that
extends loop.config.schema.DataSection, whose keys it adds to the config's `data` section) and
returns a `Data` bundle (loop/data/bundle.py). train.py hands DATASETS to the loop.

To add one: write `build_other(cfg: OtherOptions) -> Data` in a module of its own and name it here.
"""
from data.mine import build_mine

DATASETS = {"mine": build_mine}
