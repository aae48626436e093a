"""FSDP2 (`train.strategy=fsdp`): parameters, gradients and optimizer state sharded over ranks.

    torchrun --nproc_per_node=8 train.py train.strategy=fsdp [train.fsdp_mixed_precision=true]

`shard` applies `fully_shard` to every block of the model (each element of an `nn.ModuleList`:
the transformer blocks of the GPT) and then to the root, so one block's full weights exist only
while it runs. Module and parameter names do not change, so state_dict keys stay those of the
plain model. Checkpoints are written with `torch.distributed.checkpoint` (DCP): each rank writes
its own shard (`__<rank>_0.distcp`) and rank 0 the `.metadata`, next to the usual `state.pt` and
RNG files, and DCP reshards on load, so a resume may use a different number of processes.
`full_state` gathers the whole model onto rank 0's CPU: the consolidated export (`model.pt`),
which loads into the plain model in one process. The EMA copy (loop/ema.py) is sharded the same
way and saved with the model's shards under the key "ema".
"""
from __future__ import annotations

import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from loop.checkpoint.sharded import metadata
from loop.errors import BadInput

# FSDP, DCP and DTensor are imported by the functions that use them, not here: importing them costs
# 0.8 s of CPU at every start (measured on a 2-core machine, half the time of `import torch`), and a
# run without FSDP never needs them. Every module imports this one for the checks below, which ask
# sys.modules instead: nothing is an FSDP module or a DTensor before their module is imported.


def _loaded(module: str, name: str) -> type | tuple:
    """The class `module.name` if `module` is imported, else () (isinstance(x, ()) is False)."""
    return getattr(sys.modules[module], name) if module in sys.modules else ()


def check_shardable(model: nn.Module) -> None:
    """Refuse, as bad input naming the parameter or module, the two things of a user's model that
    FSDP cannot take, which are otherwise PyTorch's traceback on every rank: a parameter of shape ()
    (`fully_shard` splits along the first dimension), and one module at two places (weights shared
    across layers: the distributed state dict cannot load it into the sharded model)."""
    why = "; make it a tensor of shape (1,), or use train.strategy=ddp."
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise BadInput(f"config key train.strategy=fsdp: FSDP cannot shard a parameter of shape (): "
                       f"{', '.join(scalars)}{why}")
    first: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):  # top-down: the outermost first
        if id(m) in first and any(True for _ in m.parameters()):
            raise BadInput(f"config key train.strategy=fsdp: the module {name} is {first[id(m)]} (one "
                           f"module at two places, its weights shared), which FSDP cannot load a "
                           f"state dict into; share parameters instead of the module, or use "
                           f"train.strategy=ddp.")
        first.setdefault(id(m), name)


def shard(model: nn.Module, whole_weights: dict[str, torch.Tensor], param_dtype: torch.dtype | None,
          cpu_offload: bool, device: torch.device) -> nn.Module:
    """Shard `model` in place: per block, then the root. On rank 0 `whole_weights` is the model's
    state_dict plus its non-persistent buffers (`host_weights`), in host memory ({} on the other
    ranks); `model` may be on the meta device (shapes only: on every rank but 0 under `deferred`,
    and the EMA copy). `fully_shard` keeps this rank's shard of each parameter (moving real ones
    to `device`), meta ones get memory here, then every rank's shards are filled from rank 0's
    weights, streamed one tensor at a time (DCP's `broadcast_from_rank0`). So host memory holds
    one whole model, on rank 0, and a device never more than its shards plus one whole tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )
    persistent = set(model.state_dict())  # names only; the rest of the buffers are in no state_dict
    kw = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
    if param_dtype is not None:  # compute in param_dtype, reduce gradients in float32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        # Uninitialised, filled just below. Onto the device even with CPU offload: FSDP moves the
        # parameter shards to host memory itself and keeps buffers on the device.
        model.to_empty(device=device)
    # A new dict: set_model_state_dict puts this rank's shards into the one it is given.
    set_model_state_dict(model, {k: v for k, v in whole_weights.items() if k in persistent},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buf in model.named_buffers():
        if name not in persistent:  # e.g. a cache registered with persistent=False
            if whole_weights:
                buf.copy_(whole_weights[name])
            dist.broadcast(buf, src=0)
    if hasattr(model, "generate"):  # called directly, not through forward: gather the root's weights
        register_fsdp_forward_method(model, "generate")
    return model


def host_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What `shard` hands out from rank 0: the state_dict and the buffers that are in none."""
    return {**dict(model.named_buffers()), **model.state_dict()}


def deferred(cfg, world: int) -> bool:
    """Whether weights come from rank 0 at sharding: under FSDP with several processes, every rank
    but 0 builds the model on the meta device, and every rank its EMA copy (loop/build.py)."""
    return cfg.train.strategy == "fsdp" and world > 1


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, _loaded("torch.distributed.fsdp", "FSDPModule"))


def reshard(model: nn.Module) -> None:
    """After a forward with no backward (evaluation, sampling): FSDP leaves the root module's
    weights whole after its forward, for the backward that follows in training, and only a
    backward or a state_dict shards them again. The EMA copy never has a backward, and its update
    needs its shards (loop/ema.py)."""
    if is_sharded(model):
        model.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a parameter or gradient shard); other tensors as they are."""
    return t.to_local() if isinstance(t, _loaded("torch.distributed.tensor", "DTensor")) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. the gradient norm, reduced over ranks); other tensors as they are."""
    return t.full_tensor() if isinstance(t, _loaded("torch.distributed.tensor", "DTensor")) else t


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state_dict on rank 0's CPU ({} on other ranks). A collective for FSDP models."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return model.state_dict()


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module | None) -> dict:
    """What DCP writes: this rank's shards of the model, optimizer and EMA weights (if any)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    fresh = not optimizer.state
    msd, osd = get_state_dict(model, optimizer)
    if fresh:  # no step taken yet (nan_policy=rollback's step-0 checkpoint): DCP made the state by
        # an optimizer step at lr 0 on zero gradients, and AdamW counted it: every later bias
        # correction would be one step off. Its moments are zeros, so with the count at 0 it is fresh.
        for s in optimizer.state.values():
            if torch.is_tensor(s.get("step")):
                s["step"].zero_()
    state = {"model": msd, "optimizer": osd}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema)
    return state


def write(state: dict, path: Path, group: dist.ProcessGroup | None = None) -> list[str]:
    """Every rank writes its part of `state` into `path` (a collective over `group`, which returns
    once all are written); returns the names of the files this rank wrote."""
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=path, process_group=group)
    rank = dist.get_rank()
    return sorted(p.name for p in path.glob(f"__{rank}_*.distcp")) + [".metadata"] * (rank == 0)


def staged_writer(model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module | None,
                  group: dist.ProcessGroup | None) -> Callable[[Path], list[str]]:
    """For asynchronous checkpoints: copy this rank's shards to CPU memory now (DCP's stager keeps
    each DTensor's place in the whole); the returned function writes that copy, later, in the
    writer thread, meeting the other ranks' writers on `group` (gloo, not the training's group)."""
    # No pinned or shared memory, staged right here, blocking copies. Positional, as dcp.async_save
    # passes them: the last field has another name in earlier torch releases.
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = stager.stage(state_dict(model, optimizer, ema))
    stager.close()  # drops its cache of storages; the copy lives on in `staged`
    return partial(write, staged, group=group)


def saved_shapes(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in a DCP checkpoint as shape-only (meta) tensors, to check a fit."""
    meta = metadata(path).state_dict_metadata
    return {k.removeprefix("model."): torch.empty(v.size, device="meta")
            for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: Path) -> None:
    """Load the shards this rank needs from `path` (any world size wrote it); optimizer optional."""
    if optimizer is None:
        load_weights(model, path, "model")
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    # get_state_dict gives a fresh optimizer state for every parameter, but a parameter that never
    # had a gradient (never used yet, e.g. an unrouted expert) has none in the checkpoint: load
    # what was saved, and leave the rest without state, as in the run that saved it.
    saved = metadata(path).state_dict_metadata  # checked: plain data only
    osd["state"] = {name: v for name, v in osd["state"].items()
                    if any(f"optimizer.state.{name}.{k}" in saved for k in v)}
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
    # strict=False for those parameters without state; dcp.load above was strict about the rest.
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(strict=False))


def load_weights(module: nn.Module, path: Path, key: str) -> None:
    """Weights saved under `key` ("model" or "ema") in checkpoint `path` into `module`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    sd = get_model_state_dict(module)
    metadata(path)  # checked: plain data only, before DCP unpickles it
    with warnings.catch_warnings():  # a plain process (init_from, tools.sample) reads them all, as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.load({key: sd}, checkpoint_id=path)
    set_model_state_dict(module, sd)


def load_full(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Weights from a whole (unsharded) state_dict, which every rank holds, into the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
