"""The model probed before anything is written (loop/trainer.py::Trainer.start): one validation
batch through it keeps the model's contract (loop/contract.py: a loss summed over the targets, and
every other value it returns a sum too), and train.best_metric is one it reports. A contract broken
here would train without a word, on gradients divided by the wrong count.

`ev` is the run's Evaluator (loop/evaluate.py): its validation batches, precision, device, ranks and
seed; the probe runs as validation does (eval mode, no gradients, torch's streams put back after).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from loop.contract import loss_and_sums
from loop.data.sampler import holding_targets, split_batch, target_halves, to_device
from loop.errors import BadInput, GaveUp
from loop.evaluate import evaluating, val_metrics
from loop.guards.oom import out_of_memory, release_memory
from loop.rng import own_rng


def check_model(ev, raw: nn.Module, oom, best_metric: str, compiled: bool) -> None:
    """Before anything is written, probe one validation batch through `raw`, the model training
    trains (eval mode, no gradients, torch's streams as they were after): it keeps its contract
    (`loss_and_sums`, a loss summed over the targets), and train.best_metric is one it reports.
    `oom` (loop/guards/oom.py): what an out of memory says where it cannot be retried."""
    if not ev.dist.sum_host([sum(b["n_targets"] for b in ev.batches)])[0]:
        raise BadInput("data: the validation batches hold no targets (every y is -100, the ignored "
                       "index); expected some to measure val_loss on.")
    # A batch with targets where this rank has one: the probe divides by the count over ranks.
    probe = next((b for b in ev.batches if b["n_targets"]), ev.batches[0])
    try:  # a compiled model is built here, at its first forward
        with own_rng(ev.device, ev.seed):
            names, split = fitted(ev, raw, probe, oom)
    except Exception as e:
        if not (compiled and cannot_compile(e)):
            raise
        raise BadInput(f"config key train.compile=true: torch.compile could not build this model "
                       f"({str(e).strip().splitlines()[0]}); install what it names (a C++ compiler "
                       f"for the CPU, a C compiler for Triton on CUDA), or set "
                       f"train.compile=false.") from e
    if best_metric not in names:
        raise BadInput(f"config key train.best_metric: expected one of the validation metrics this "
                       f"model reports ({', '.join(names)}); got {best_metric!r}.")
    sums_add_up(ev, raw, split_batch(probe, split)[0], split)


@torch.no_grad()
def sums_add_up(ev, raw: nn.Module, batch: dict, split: int) -> None:
    """A loss summed over the targets is the sum of its halves' losses; a mean is about half that
    (HF's `.loss`, reduction="mean"), and a prediction broadcast against its targets ((B,) and
    (B, 1): a B x B matrix of errors) more. Either trains without a word, on gradients the loop
    divides by the wrong count. The halves of a batch of one sample are its targets' halves
    (the others -100); of one target (a classifier's), the whole is the sample twice over,
    where that may fit. Four more forwards: the batch under two seeds (a model that draws
    random numbers in eval mode cannot be compared, and is said), then its two halves.
    `split`: the probe's pieces, of which `batch` is one (more than 1: two samples ran out of
    memory). Every rank takes part (under FSDP each forward is a collective)."""
    batch = holding_targets(batch)  # a half without targets would compare nothing
    parts, cannot = split_batch(batch, 2), False
    if len(parts) < 2 and not (parts := target_halves(batch)):
        cannot = split > 1 or ev.sharded  # under FSDP an out of memory cannot be retried
        parts = [batch, batch]
        batch = {**{k: torch.cat([v, v]) for k, v in batch.items() if torch.is_tensor(v)},
                 "n_targets": 2 * batch["n_targets"]}
    if ev.dist.sum_host([float(cannot or not all(h["n_targets"] for h in parts))])[0]:
        return  # on some rank: nothing to compare (or a half without targets)

    def sums(b: dict, seed: int = ev.seed) -> dict[str, float]:  # the loss first, then the others
        with own_rng(ev.device, seed), ev.precision.autocast():
            loss, others = loss_and_sums(raw(to_device(b, ev.device)))
            return {k: v.float().item() for k, v in {"loss": loss, **others}.items()}

    got = None
    try:
        with evaluating(raw):
            got = [sums(batch), sums(batch, ev.seed + 1), *map(sums, parts)]
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not out_of_memory(e) or ev.sharded:  # FSDP: the other ranks wait in this forward's gathers
            raise
    if got is None:  # the sample twice over did not fit
        release_memory(ev.device)  # outside the except, whose traceback pins the tensors
    whole, again, *halves = got or [{"loss": 0.0}] * 4
    # A value that differs under other draws cannot be compared (its halves draw others again).
    drawn = {k for k in whole if not math.isclose(whole[k], again[k], rel_tol=1e-4, abs_tol=1e-9)}
    random = "loss" in drawn
    # Every value it returns is a sum (the loop reports val_<name> as the sum over the targets'
    # count): a perplexity or an accuracy of the batch would be reported divided by it.
    wrong = [k for k in whole if k not in drawn and not adds_up(whole[k], halves[0][k], halves[1][k])] \
        if got and not random else []
    full, randoms, wrongs = ev.dist.sum_host([float(got is None), float(random), float(bool(wrong))])
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
        ev.dist.say(f"note: the model draws random numbers in eval mode (one validation batch under "
                    f"two seeds gave losses {whole:.6g} and {again:.6g}), so whether its loss is a sum "
                    f"over the targets is not checked; validation draws them seeded by run.seed, the "
                    f"same at every evaluation")


def fitted(ev, raw: nn.Module, batch: dict, oom) -> tuple[dict[str, float], int]:
    """val_metrics on `batch`, in halves, quarters, ... if it runs out of memory: a micro-batch
    too big for the card must reach training, whose recovery (train.oom_policy) splits it. Ranks
    need not agree first: the one collective comes after every forward. Under FSDP, whose
    forward gathers weights from every rank, an out-of-memory cannot be retried. Returns the
    metrics and the split that fitted."""
    split, n = 1, len(batch["idx"])
    while True:
        try:
            return val_metrics(raw, [batch], ev.precision, ev.device, ev.dist, split), split
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise  # retried outside the except block: its traceback pins the tensors
        if ev.sharded:
            oom.in_collectives("in the first validation forward (the model's contract probe) "
                               "under FSDP, which gathers each block's weights from all ranks")
        if split >= n:
            raise GaveUp(f"out of memory in the model's first forward (validation, no "
                         f"gradients), even one sample at a time: the model does not fit "
                         f"{ev.device}; use a smaller model or data.seq_len.")
        split *= 2
        release_memory(ev.device)


def adds_up(whole: float, a: float, b: float) -> bool:
    """`whole` is `a + b` up to rounding (bf16's, at 1%), measured against the halves too: the halves of
    a signed sum can be far larger than it."""
    return abs(whole - a - b) <= 1e-2 * max(abs(whole), abs(a) + abs(b)) + 1e-6


def cannot_compile(e: Exception) -> bool:
    """The compiler itself failed (no C++ compiler, no Triton, a GPU too old for it), not the
    model: a bug in the model's forward reaches Dynamo's tracing first, as a TorchRuntimeError,
    and stays the crash it is in eager mode, with its own message."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import GPUTooOldForTriton, TritonMissing

    return isinstance(e, (BackendCompilerFailed, TritonMissing, GPUTooOldForTriton))
