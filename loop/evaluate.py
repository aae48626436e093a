"""Validation metrics and text samples, both without touching any training random stream.

Validation runs in eval mode under `no_grad` on a fixed set of batches (drawn once by their own
generator) and reports each sum the model returns (loop/contract.py) divided by the number of real
targets, as `val_loss`, `val_accuracy`, ..., with one host read. A model that draws from torch's
global streams in eval mode (a diffusion model's noise) draws them seeded by run.seed, and
training's streams are put back after (loop/rng.py::own_rng). The sample is given its own
`torch.Generator` and runs in those seeded streams too (a generate() may draw from torch's).

`Evaluator` is a run's evaluation: its fixed validation batches and its samples (loop/probe.py probes
the model's contract with them before anything is written).
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.nn as nn
from torch.profiler import record_function

from loop.contract import loss_and_sums
from loop.data.sampler import split_batch, to_device, val_batches
from loop.data.seeded import SeededSamples
from loop.distributed import fsdp
from loop.rng import own_rng


@torch.no_grad()
def val_metrics(model: nn.Module, batches: list[dict], precision, device: torch.device,
                dist, split: int = 1) -> dict[str, float]:
    """`val_<name>` for the loss and every other sum the model returns: means over the real
    targets of every rank's validation batches, each run in `split` pieces (after an
    out-of-memory, training's smaller micro-batch; the sums are the same)."""
    sums, count, names = None, 0, ["loss"]
    with evaluating(model):
        for batch in (part for b in batches for part in split_batch(b, split)):
            with precision.autocast():
                loss, extra = loss_and_sums(model(to_device(batch, device)))
            names = ["loss", *extra]
            values = torch.stack([loss.float(), *(v.float() for v in extra.values())])  # (names,)
            sums = values if sums is None else sums + values
            count += batch["n_targets"]
    totals = dist.sum_(torch.cat([sums, torch.tensor([float(count)], device=device)])).tolist()
    return {f"val_{name}": total / totals[-1] for name, total in zip(names, totals)}


def text_sample(model: nn.Module, prompt: torch.Tensor, n: int, seed: int, decode) -> str:
    """`n` tokens after `prompt` (1, T), decoded."""
    with evaluating(model):
        ids = model.generate(prompt, n, torch.Generator(prompt.device).manual_seed(seed))[0].tolist()
    return decode(ids)


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Eval mode (no dropout, BatchNorm's running statistics) inside; the model's own mode after,
    and, after a block that did not raise, under FSDP each block's weights back to their shards
    (loop/distributed/fsdp.py::reshard)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
    fsdp.reshard(model)


class Evaluator:
    """A run's validation and text samples: a fixed set of validation batches (drawn once by their
    own generator, the same at every evaluation), and samples drawn with a generator of their own,
    so evaluating never changes training."""

    def __init__(self, model: nn.Module, data, cfg, precision, device: torch.device, dist,
                 sharded: bool, progress, dtypes=contextlib.nullcontext):
        """`model`: what is evaluated (the EMA copy, if on); `progress`: the training micro-batch,
        which validation splits like (an out of memory made it smaller); `dtypes`: a context in which
        `model` has the trained model's dtypes (loop/ema.py::EMA.in_model_dtypes)."""
        self.model, self.data, self.precision, self.device, self.dist = model, data, precision, device, dist
        self.dtypes = dtypes
        self.sharded, self.progress, self.lab_break = sharded, progress, cfg.lab.break_
        self.seed, self.tokens = cfg.run.seed, cfg.train.sample_tokens
        # train.eval_batches x (data.batch_size x processes) samples; with train.global_batch, x its
        # samples: the set then stays whatever the micro-batch (auto: the GPU) and process count.
        per_step = cfg.train.grad_accum if cfg.train.global_batch else 1
        self.batch_size, self.n_batches = cfg.data.batch_size, cfg.train.eval_batches * per_step
        self.batches = val_batches(data.val, self.batch_size, self.n_batches, self.seed, dist.rank, dist.world)
        self.last: tuple[int, dict[str, float]] | None = None  # (step, {val_loss, val_...})

    def validate(self) -> dict[str, float]:
        """val_loss and the model's other val_ metrics over every rank's share; a collective."""
        batches = self.batches
        if self.lab_break == "eval_consumes_train_rng":  # lab: fresh batches from the training RNG
            batches = val_batches(self.data.val, self.batch_size, self.n_batches, None, self.dist.rank,
                                  self.dist.world)
        self.dist.sync_buffers(self.model)  # one model validated, the one a checkpoint keeps (the EMA's too)
        with own_rng(self.device, self.seed), self.dtypes():
            metrics = val_metrics(self.model, batches, self.precision, self.device, self.dist,
                                  self.progress.micro_split)
        self.last = (self.progress.step, metrics)
        return metrics

    def evaluate(self, log, monitor) -> bool:
        """Validation metrics and a text sample into `log`; True if the monitored metric
        (train.best_metric) is the best so far (`monitor`: loop/monitor.py)."""
        with record_function("eval"):  # a region of the profiler's breakdown (loop/observe/profile.py)
            metrics = self.validate()
            step = self.progress.step
            for name, value in metrics.items():
                log.scalar(step, name, value)
            if text := self.sample():
                log.text(step, "sample", text)  # a no-op off rank 0
        return monitor.update(step, metrics[monitor.metric])

    def sample(self) -> str | None:
        """A short text from the model after the last validation, on rank 0 (on every rank with
        FSDP, whose forward needs all of them; the same text on each). None for models that do not
        generate (a classifier), data without a decoder, or train.sample_tokens=0."""
        if not (self.dist.main or self.sharded) or not hasattr(self.model, "generate") \
                or self.data.decode is None or self.tokens == 0:
            return None
        step, metrics = self.last
        if not math.isfinite(metrics["val_loss"]):  # diverged weights: no distribution to draw from
            self.dist.say(f"warning: step {step}: val_loss is {metrics['val_loss']}; no text sample drawn",
                          file=sys.stderr)
            return None
        # Fetched as training fetches (loop/data/seeded.py): a validation set that augments draws
        # from its own seeded streams, so evaluating leaves the training streams (dropout) as they are.
        prompt = SeededSamples(self.data.val, self.seed)[(0, 0)]["x"][None, :8].to(self.device)  # (1, 8)
        # own_rng: a generate() that draws from torch's streams, not its generator
        with own_rng(self.device, self.seed), self.dtypes():
            return text_sample(self.model, prompt, self.tokens, self.seed, self.data.decode)
