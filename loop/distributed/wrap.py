"""The model on its device and in its wrapper: DDP (a full copy per process) or FSDP (shards),
and the gradient sync around the micro-batches of a step.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from loop.errors import BadInput


def check_supported(cfg, device: torch.device) -> None:
    """Refuse, before anything is written, what this device cannot do."""
    if cfg.train.fsdp_cpu_offload and device.type != "cuda":
        raise BadInput(f"config key train.fsdp_cpu_offload: moves parameters from the GPU to host "
                       f"memory, but this run is on {device}; expected false.")


def wrap(model: torch.nn.Module, device: torch.device, cfg, param_dtype=None,
         ema=None) -> torch.nn.Module:
    """Move `model`, built in host memory, to `device` and wrap it: DDP with one process per device
    (the unwrapped model stays reachable as `.module`), or, with train.strategy=fsdp, FSDP2
    sharding in place (loop/distributed/fsdp.py): no device ever holds the whole model, and only rank 0 built
    it with weights. `ema`, the AveragedModel copied from the model before wrapping (under FSDP
    its shapes only), gets rank 0's weights, as the model does (every rank builds from run.seed, but
    a model drawing from a generator of its own may differ per rank), and the same placement."""
    check_supported(cfg, device)
    t = cfg.train
    if t.strategy == "fsdp" and dist.is_initialized():
        from loop.distributed import fsdp

        fsdp.check_shardable(model)
        weights = fsdp.host_weights(model) if dist.get_rank() == 0 else {}  # handed out by shard
        shard = partial(fsdp.shard, whole_weights=weights, cpu_offload=t.fsdp_cpu_offload,
                        param_dtype=param_dtype if t.fsdp_mixed_precision else None, device=device)
        if ema is not None:
            shard(ema.module)  # starts as the model: rank 0's weights
        return shard(model)
    model.to(device)
    if ema is not None:
        ema.module.to(device)  # its update counter stays in host memory (loop/ema.py)
    if not dist.is_initialized():  # plain python train.py
        if t.strategy == "fsdp":
            print("note: train.strategy=fsdp has no effect without torchrun; training unsharded")
        return model
    model = ddp(model, device, t.find_unused_parameters)
    if ema is not None:  # DDP broadcast rank 0's weights at construction
        ema.module.load_state_dict(model.module.state_dict())
    return model


def ddp(module: torch.nn.Module, device: torch.device, find_unused: bool) -> torch.nn.Module:
    """`module` in DDP, one process per device. A collective: every rank calls it together."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
               find_unused_parameters=find_unused)


def check_all_used(model: torch.nn.Module, find_unused: bool, step: int) -> None:
    """After a step's backward under DDP without train.find_unused_parameters: a trainable parameter
    that got no gradient in the last micro-batch's backward (grad_sync notes those that did) leaves
    its bucket unreduced (the other gradients in it stay this rank's own) and DDP's next forward
    fails. Said clearly, before the optimizer steps on them."""
    if find_unused or not is_ddp(model):
        return
    unused = [n for n, q in model.module.named_parameters() if q.requires_grad and id(q) not in model.got_grad]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise BadInput(f"step {step}: parameters {', '.join(unused[:3])}{more} got no gradient in the "
                       f"step's last micro-batch (the model's forward did not use them), which DDP cannot reduce; set "
                       f"train.find_unused_parameters=true, or freeze them (requires_grad=False) or "
                       f"take them out of the model.")


def is_ddp(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return isinstance(model, DDP)


@contextmanager
def grad_sync(model: torch.nn.Module, sync: bool):
    """Around forward and backward of a micro-batch: with `sync` false, gradients only accumulate
    locally (DDP `no_sync`; FSDP defers its reduce-scatter); the last micro-batch syncs them all."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        yield
    elif not is_ddp(model) or (sync and model.find_unused_parameters):
        yield
    elif not sync:
        with model.no_sync():
            yield
    else:  # DDP reduces in this backward the gradients it gets: those that came (check_all_used)
        got = model.got_grad = set()
        hooks = [q.register_post_accumulate_grad_hook(lambda q: got.add(id(q)))
                 for q in model.module.parameters() if q.requires_grad]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
