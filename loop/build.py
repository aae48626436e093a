"""The parts of a run, wired in the order train.py needs them: seed, data, precision, model,
micro-batch fit, compile, EMA copy, wrapping, optimizer, schedule -> a `Trainer`. Shared by
train.py, make verify's in-process audits (tools/audit_grads.py) and the benchmarks, so each builds
exactly what a real run trains. The data set and the model come from the project's builders
(DATASETS, MODELS: data/__init__.py, model/__init__.py), which the caller hands in; what the loop
needs of what they build is checked here, before anything is written.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn.parameter import UninitializedParameter

from loop import auto_batch
from loop.compiler import check_cuda_graphs, check_options, compile_kwargs
from loop.config.runtime import (
    check_same_config,
    check_same_data,
    check_with_world,
    follow_global_batch,
    idle_settings,
    step_over_the_data,
)
from loop.data.bundle import Data, check_samples
from loop.device import use_attention_kernel, use_tf32
from loop.distributed import fsdp
from loop.distributed.group import Dist
from loop.distributed.wrap import wrap
from loop.ema import EMA
from loop.errors import BadInput
from loop.guards import faults
from loop.optim import build_optimizer
from loop.precision import Precision, check_weights
from loop.rng import rank_seed, seed_everything
from loop.schedule import build_scheduler
from loop.trainer import Trainer


def build_trainer(cfg, dist: Dist, device: torch.device, datasets: dict, models: dict) -> Trainer:
    check_same_config(cfg, dist)
    check_with_world(cfg, dist)
    check_options(cfg.train, cfg.run.deterministic)
    auto_batch.check(cfg, dist.world)
    # The builders draw the same numbers on every rank: the same data (a random split stays one
    # split) and the same initial weights.
    seed_everything(cfg.run.seed)
    data = build_data(cfg.data, datasets)
    check_same_data(data, dist)
    use_tf32(device, cfg.train.tf32)
    use_attention_kernel(cfg.train.attention_kernel, device)
    precision = Precision(cfg.train.precision, device)
    # In host memory: `wrap` moves it to the device. Under FSDP with several processes only rank 0
    # makes weights, the others shapes (meta device) that `wrap` fills with their shards of rank 0's
    # weights; the EMA copy is shapes only on every rank, filled the same way.
    deferred = fsdp.deferred(cfg, dist.world)
    with torch.device("meta") if deferred and not dist.main else nullcontext():
        model = build_model(cfg.model, data, models)
    check_weights(model, precision, cfg.train.precision)
    if auto := cfg.data.batch_size == "auto":  # before compiling and wrapping: the model as it is
        cfg.data.batch_size, how = auto_batch.micro_batch(cfg, model, data, device, precision, dist)
        dist.say(f"data.batch_size=auto: {cfg.data.batch_size}, {how}")
    if accum := follow_global_batch(cfg, dist.world):  # before anything reads train.grad_accum
        dist.say(accum)
    check_cuda_graphs(cfg, device, auto)
    if cfg.train.compile:
        # In place: state_dict keys, hence checkpoints, stay those of the model.
        model.compile(**compile_kwargs(cfg.train))
        options = "".join(f", {k}={v}" for k, v in cfg.train.compile_options.items())
        dist.say(f"model compiled in place (torch.compile, mode {cfg.train.compile_mode}{options}); the "
                 f"first steps include compilation")
    # Before wrapping: an FSDP module cannot be deep-copied.
    ema = EMA(model, cfg.ema.decay, cfg.ema.warmup, shapes_only=deferred) if cfg.ema.enabled else None
    for note in [*idle_settings(cfg, precision), step_over_the_data(cfg, dist.world, len(data.train))]:
        if note:
            dist.say(f"note: {note}")
    model = wrap(model, device, cfg, precision.dtype, ema)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.train.max_steps)
    # Each rank's own streams (dropout, augmentation) start here, whatever the builders drew: FSDP's
    # meta-device ranks draw nothing, so they would otherwise differ from DDP's.
    seed_everything(rank_seed(cfg.run.seed, dist.rank))
    trainer = Trainer(cfg, model, data, optimizer, scheduler, precision, device, dist, ema)
    # Deliberate faults, if configured, from outside the step (loop/guards/faults.py).
    trainer.forward = faults.around_forward(trainer.forward, cfg.faults, trainer.progress, dist.rank)
    trainer.checkpoints.midway = faults.kill_midway(cfg.faults.kill_in_ckpt_at_step)
    return trainer


def build_data(cfg, datasets: dict) -> Data:
    """data.name's data set, its first and last samples checked against the contract."""
    if cfg.name not in datasets:
        raise BadInput(f"config key data.name: expected one of {', '.join(datasets)}; got {cfg.name!r}.")
    try:
        data = datasets[cfg.name](cfg)
        check_samples(data, cfg.name)
    except PermissionError as e:  # a cache or data directory another user made (umask 077)
        raise BadInput(f"data.name={cfg.name}: cannot read {e.filename or 'its files'} ({e.strerror}); "
                       f"expected files and directories this user can read (data.cache_dir, "
                       f"data.path).") from None
    return data


def build_model(cfg, data: Data, models: dict) -> nn.Module:
    """model.name's model for `data`, refused where the loop could not train or keep it, and with
    model.activation_checkpointing switched on through its own switch."""
    if cfg.name not in models:
        raise BadInput(f"config key model.name: expected one of {', '.join(models)}; got {cfg.name!r}.")
    model = models[cfg.name](cfg, data)
    if not any(p.requires_grad for p in model.parameters()):  # else blamed on the loss being detached
        frozen = sum(p.numel() for p in model.parameters())
        raise BadInput(f"config key model.name={cfg.name}: the model has no parameter to train "
                       f"({frozen:,} parameters, none with requires_grad=True); expected at least one.")
    refuse_what_the_loop_cannot_keep(model, f"config key model.name={cfg.name}")
    if cfg.activation_checkpointing:
        if not hasattr(model, "set_activation_checkpointing"):
            raise BadInput(f"config key model.activation_checkpointing=true: model.name={cfg.name} has no "
                           f"switch for it; expected a method set_activation_checkpointing(on) on the "
                           f"model (the example GPT has one), or false.")
        model.set_activation_checkpointing(True)
    return model


def refuse_what_the_loop_cannot_keep(model: nn.Module, where: str) -> None:
    """Valid PyTorch the loop cannot train or keep, named before anything is written: each is a
    traceback, at the optimizer's build, the first clipping, or after the last step."""
    for name, p in model.named_parameters():
        if isinstance(p, UninitializedParameter):  # the optimizer, EMA and checkpoints need shapes
            raise BadInput(f"{where}: {name} is a lazy parameter (nn.LazyLinear...), still without a "
                           f"shape; expected sizes given when the model is built (or one forward in "
                           f"its builder).")
    for name, m in model.named_modules():
        if getattr(m, "sparse", False) is True:  # nn.Embedding(sparse=True), nn.EmbeddingBag
            raise BadInput(f"{where}: {name} makes sparse gradients (sparse=True), which gradient "
                           f"clipping and AdamW do not take; expected sparse=False.")
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):  # get_extra_state: hashed, averaged, sharded? no
            raise BadInput(f"{where}: its state_dict holds {key}, a {type(value).__name__} "
                           f"(get_extra_state), not a tensor; checkpoints, params_sha256, the EMA "
                           f"copy and FSDP take tensors; expected tensors only (keep it in a buffer).")
