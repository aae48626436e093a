"""Validation metrics and text samples, both without touching any training random stream.

Validation runs in eval mode under `no_grad` on a fixed set of batches (drawn once by their own
generator) and reports each sum the model returns (loop/contract.py) divided by the number of real
targets, as `val_loss`, `val_accuracy`, ..., with one host read. A model that draws from torch's
global streams in eval mode (a diffusion model's noise) draws them seeded by run.seed, and
training's streams are put back after (loop/rng.py::own_rng). The sample uses its own `torch.Generator`.

`Evaluator` is a run's evaluation: its fixed validation batches, its samples, and the probe of the
model's contract before anything is written.
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.nn as nn

from loop.contract import loss_and_sums
from loop.data.sampler import split_batch, target_halves, to_device, val_batches
from loop.data.seeded import SeededSamples
from loop.distributed import fsdp
from loop.errors import BadInput, GaveUp
from loop.guards.oom import out_of_memory, release_memory
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


@torch.no_grad()
def _adds_up(whole: float, a: float, b: float) -> bool:
    """`whole` is `a + b` up to rounding (bf16's, at 1%), measured against the halves too: the halves of
    a signed sum can be far larger than it."""
    return abs(whole - a - b) <= 1e-2 * max(abs(whole), abs(a) + abs(b)) + 1e-6


def text_sample(model: nn.Module, prompt: torch.Tensor, n: int, seed: int, decode) -> str:
    """`n` tokens after `prompt` (1, T), decoded."""
    with evaluating(model):
        ids = model.generate(prompt, n, torch.Generator(prompt.device).manual_seed(seed))[0].tolist()
    return decode(ids)


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Eval mode (no dropout, BatchNorm's running statistics) inside; the model's own mode after,
    and under FSDP each block's weights back to their shards (loop/distributed/fsdp.py::reshard)."""
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
                 sharded: bool, progress, oom):
        """`model`: what is evaluated (the EMA copy, if on); `progress` and `oom` (loop/guards/oom.py):
        the training micro-batch, which validation splits like, and what out of memory says."""
        self.model, self.data, self.precision, self.device, self.dist = model, data, precision, device, dist
        self.sharded, self.progress, self.oom, self.lab = sharded, progress, oom, cfg.lab.break_
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
        if self.lab == "eval_consumes_train_rng":  # lab: fresh batches from the training RNG
            batches = val_batches(self.data.val, self.batch_size, self.n_batches, None, self.dist.rank,
                                  self.dist.world)
        with own_rng(self.device, self.seed):
            metrics = val_metrics(self.model, batches, self.precision, self.device, self.dist,
                                  self.progress.micro_split)
        self.last = (self.progress.step, metrics)
        return metrics

    def evaluate(self, log, monitor) -> bool:
        """Validation metrics and a text sample into `log`; True if the monitored metric
        (train.best_metric) is the best so far (`monitor`: loop/monitor.py)."""
        metrics = self.validate()
        step = self.progress.step
        for name, value in metrics.items():
            log.scalar(step, name, value)
        if text := self.sample():
            log.text(step, "sample", text)  # a no-op off rank 0
        best = monitor.update(step, metrics[monitor.metric])
        if monitor.state.stop_reason:  # set by this evaluation: the loop ends here
            self.dist.say(f"stopped early at step {step}: {monitor.state.stop_reason}")
        return best

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
        return text_sample(self.model, prompt, self.tokens, self.seed, self.data.decode)

    def check_model(self, raw: nn.Module, best_metric: str, compiled: bool) -> None:
        """Before anything is written, probe one validation batch through the trained model `raw`
        (eval mode, no gradients, torch's streams as they were after): it keeps its contract
        (`loss_and_sums`, a loss summed over the targets), and train.best_metric is one it reports."""
        if not self.dist.sum_host([sum(b["n_targets"] for b in self.batches)])[0]:
            raise BadInput("data: the validation batches hold no targets (every y is -100, the ignored "
                           "index); expected some to measure val_loss on.")
        # A batch with targets where this rank has one: the probe divides by the count over ranks.
        probe = next((b for b in self.batches if b["n_targets"]), self.batches[0])
        try:  # a compiled model is built here, at its first forward
            with own_rng(self.device, self.seed):
                names, split = self._probe(raw, probe)
        except Exception as e:
            if not (compiled and _cannot_compile(e)):
                raise
            raise BadInput(f"config key train.compile=true: torch.compile could not build this model "
                           f"({str(e).strip().splitlines()[0]}); install what it names (a C++ compiler "
                           f"for the CPU, a C compiler for Triton on CUDA), or set "
                           f"train.compile=false.") from e
        if best_metric not in names:
            raise BadInput(f"config key train.best_metric: expected one of the validation metrics this "
                           f"model reports ({', '.join(names)}); got {best_metric!r}.")
        self._sums_add_up(raw, split_batch(probe, split)[0], split)

    @torch.no_grad()
    def _sums_add_up(self, raw: nn.Module, batch: dict, split: int) -> None:
        """A loss summed over the targets is the sum of its halves' losses; a mean is about half that
        (HF's `.loss`, reduction="mean"), and a prediction broadcast against its targets ((B,) and
        (B, 1): a B x B matrix of errors) more. Either trains without a word, on gradients the loop
        divides by the wrong count. The halves of a batch of one sample are its targets' halves
        (the others -100); of one target (a classifier's), the whole is the sample twice over,
        where that may fit. Four more forwards: the batch under two seeds (a model that draws
        random numbers in eval mode cannot be compared, and is said), then its two halves.
        `split`: the probe's pieces, of which `batch` is one (more than 1: two samples ran out of
        memory). Every rank takes part (under FSDP each forward is a collective)."""
        parts, cannot = split_batch(batch, 2), False
        if len(parts) < 2 and not (parts := target_halves(batch)):
            cannot = split > 1 or self.sharded  # under FSDP an out of memory cannot be retried
            parts = [batch, batch]
            batch = {**{k: torch.cat([v, v]) for k, v in batch.items() if torch.is_tensor(v)},
                     "n_targets": 2 * batch["n_targets"]}
        if self.dist.sum_host([float(cannot or not all(h["n_targets"] for h in parts))])[0]:
            return  # on some rank: nothing to compare (or a half without targets)

        def sums(b: dict, seed: int = self.seed) -> dict[str, float]:  # the loss first, then the others
            with own_rng(self.device, seed), self.precision.autocast():
                loss, others = loss_and_sums(raw(to_device(b, self.device)))
                return {k: v.float().item() for k, v in {"loss": loss, **others}.items()}

        got = None
        try:
            with evaluating(raw):
                got = [sums(batch), sums(batch, self.seed + 1), *map(sums, parts)]
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not out_of_memory(e) or self.sharded:  # FSDP: the other ranks wait in this forward's gathers
                raise
        if got is None:  # the sample twice over did not fit
            release_memory(self.device)  # outside the except, whose traceback pins the tensors
        whole, again, *halves = got or [{"loss": 0.0}] * 4
        # A value that differs under other draws cannot be compared (its halves draw others again).
        drawn = {k for k in whole if not math.isclose(whole[k], again[k], rel_tol=1e-4, abs_tol=1e-9)}
        random = "loss" in drawn
        # Every value it returns is a sum (the loop reports val_<name> as the sum over the targets'
        # count): a perplexity or an accuracy of the batch would be reported divided by it.
        wrong = [k for k in whole if k not in drawn and not _adds_up(whole[k], halves[0][k], halves[1][k])] \
            if got and not random else []
        full, randoms, wrongs = self.dist.sum_host([float(got is None), float(random), float(bool(wrong))])
        if full:
            return  # on some rank: nothing compared
        if wrongs:
            name = wrong[0] if wrong else None
            found = "on another process" if name is None else (
                f"on a validation batch of {batch['n_targets']} targets it gave {whole[name]:.6g}, on its two "
                f"halves {halves[0][name]:.6g} + {halves[1][name]:.6g} = {halves[0][name] + halves[1][name]:.6g}")
            what = "loss" if name in ("loss", None) else f"{name!r} (beside its loss)"
            raise BadInput(f"the model's {what} is not a sum over the batch's targets: {found}. Expected every "
                           f"value summed over the real targets (reduction=\"sum\", not the mean: the loop divides "
                           f"by the whole step's target count), and a prediction of the targets' shape (one of "
                           f"shape (B,) against targets of (B, 1) broadcasts to a B x B matrix of errors).")
        if randoms:
            whole, again = whole["loss"], again["loss"]
            self.dist.say(f"note: the model draws random numbers in eval mode (one validation batch under "
                          f"two seeds gave losses {whole:.6g} and {again:.6g}), so whether its loss is a sum "
                          f"over the targets is not checked; validation draws them seeded by run.seed, the "
                          f"same at every evaluation")

    def _probe(self, raw: nn.Module, batch: dict) -> tuple[dict[str, float], int]:
        """val_metrics on `batch`, in halves, quarters, ... if it runs out of memory: a micro-batch
        too big for the card must reach training, whose recovery (train.oom_policy) splits it. Ranks
        need not agree first: the one collective comes after every forward. Under FSDP, whose
        forward gathers weights from every rank, an out-of-memory cannot be retried. Returns the
        metrics and the split that fitted."""
        split, n = 1, len(batch["idx"])
        while True:
            try:
                return val_metrics(raw, [batch], self.precision, self.device, self.dist, split), split
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not out_of_memory(e):
                    raise  # retried outside the except block: its traceback pins the tensors
            if self.sharded:
                self.oom.in_collectives("in the first validation forward (the model's contract probe) "
                                        "under FSDP, which gathers each block's weights from all ranks")
            if split >= n:
                raise GaveUp(f"out of memory in the model's first forward (validation, no "
                             f"gradients), even one sample at a time: the model does not fit "
                             f"{self.device}; use a smaller model or data.seq_len.")
            split *= 2
            release_memory(self.device)


def _cannot_compile(e: Exception) -> bool:
    """The compiler itself failed (no C++ compiler, no Triton, a GPU too old for it), not the
    model: a bug in the model's forward reaches Dynamo's tracing first, as a TorchRuntimeError,
    and stays the crash it is in eager mode, with its own message."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import GPUTooOldForTriton, TritonMissing

    return isinstance(e, (BackendCompilerFailed, TritonMissing, GPUTooOldForTriton))
