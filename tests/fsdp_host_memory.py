"""Run under torchrun: build what train.py would (loop/build.py) with the given overrides, then
print one JSON line per rank with this process's peak host memory (ru_maxrss) and the bytes of
the model's weights, for tests/test_fsdp.py.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_host_memory.py k=v ...
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop import distributed  # noqa: E402
from loop.build import build_trainer  # noqa: E402
from loop.config import DEFAULT_CONFIG, load_config  # noqa: E402

cfg = load_config(DEFAULT_CONFIG, sys.argv[1:])
dist, device = distributed.init(cfg.train.device)
try:
    t = build_trainer(cfg, dist, device)
    n_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters())  # whole, not shards
    print(json.dumps({"rank": dist.rank, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "model_bytes": n_bytes}), flush=True)
    dist.barrier()
finally:
    distributed.close()
