"""train.py with one more model for tests/test_distributed.py: `gpt_spare`, the GPT plus a head
its forward never uses, whose parameters get no gradient (what DDP must be told about).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/spare_head.py k=v ...
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model  # noqa: E402
import train  # noqa: E402


def gpt_spare(cfg, data) -> nn.Module:
    m = model.BUILDERS["gpt"](cfg, data)
    m.spare = nn.Linear(cfg.n_embd, 2)
    return m


if __name__ == "__main__":
    model.BUILDERS["gpt_spare"] = gpt_spare
    sys.exit(train.main())
