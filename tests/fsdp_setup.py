"""Run under torchrun: build what train.py would (loop/build.py) with the given overrides, the GPT
given a non-persistent buffer (in no state_dict), and print one JSON line per rank: this process's
peak host memory (ru_maxrss), the bytes of the model's weights, that buffer's values in the model
and in the EMA copy, and the devices the EMA copy was built on, for tests/test_fsdp.py; with train.fsdp_mixed_precision=true also, after
one backward of a validation batch, how many of this rank's gradient values bf16 cannot hold.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_setup.py k=v ...
"""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import (
    build_trainer,  # noqa: E402
    load_config,  # noqa: E402
)
from loop import build  # noqa: E402
from loop.config.load import DEFAULT_CONFIG
from loop.contract import loss_and_sums  # noqa: E402
from loop.distributed import fsdp, group
from model import MODELS  # noqa: E402
from model.gpt import GPTOptions, build_gpt  # noqa: E402


def gpt_with_buffer(cfg: GPTOptions, data):
    m = build_gpt(cfg, data)
    m.register_buffer("probe", torch.arange(1.0, 5.0), persistent=False)  # meta on meta ranks
    return m


MODELS["gpt"] = gpt_with_buffer
EMA, ema_built_on = build.EMA, []


def ema_seen(*args, **kwargs):
    ema = EMA(*args, **kwargs)
    ema_built_on.extend(sorted({t.device.type for t in ema.module.parameters()}))
    return ema


build.EMA = ema_seen
cfg = load_config(DEFAULT_CONFIG, sys.argv[1:])
dist, device = group.init(cfg.train.device)


def report() -> None:
    """In a function so that the trainer, which holds process groups, is gone before close()."""
    t = build_trainer(cfg, dist, device)
    n_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters())  # whole, not shards
    fields = {"rank": dist.rank, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "model_bytes": n_bytes, "probe": t.model.probe.tolist(),
              "ema_probe": t.ema.module.probe.tolist() if t.ema else None, "ema_built_on": ema_built_on}
    if cfg.train.fsdp_mixed_precision:  # each rank's batch differs: so do its bf16 gradients
        loss_and_sums(t.model(t.evaluator.batches[0]))[0].backward()
        grads = [fsdp.local(p.grad) for p in t.model.parameters()]
        fields["grads_beyond_bf16"] = sum(int((g != g.bfloat16().float()).sum()) for g in grads)
    line = json.dumps(fields)
    sys.stdout.flush()
    os.write(1, f"{line}\n".encode())  # one write: the ranks share the pipe (print may write twice)
    dist.barrier()


try:
    report()
finally:
    group.close()
