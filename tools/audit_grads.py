"""make verify's in-process gradient audits: the gradient the optimizer is handed, read inside its
step (a step pre-hook), for one real optimizer step of the loop (`Trainer.step`, wired by
loop/build.py exactly as train.py wires it).

    accumulation  train.grad_accum=k with micro-batch b  vs  1 x k*b, on the same k*b samples: the
                  gradient applied, and the loss and gradient norm logged
    clipping      that one-batch step  vs  a plain float32 reference: mean loss over the targets,
                  backward, clip_grad_norm_'s formula, by hand; with train.clip_grad set below the
                  step's gradient norm where the config's would not clip it (a clip that never acts
                  proves nothing)

Both run in eval mode, so dropout draws nothing and both sides compute the same function, and every
micro-batch after the first keeps a quarter of its real targets, so the micro-batches hold
different target counts (the case where only dividing by the whole step's target count is exact)
and each still weighs enough that a loop that leaves one out fails.
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from data import DATASETS
from loop.build import build_trainer
from loop.config.load import load_config
from loop.config.runtime import follow_global_batch
from loop.contract import loss_and_sums
from loop.data.bundle import IGNORE_INDEX
from loop.data.sampler import holding_targets, split_batch, to_device, train_loader
from loop.device import pick_device
from loop.distributed.group import Dist
from loop.precision import DTYPES
from model import MODELS

# Relative L2 difference allowed between two gradients of the same step that were summed in a
# different order (float32: ~1e-7 seen) or rounded differently by autocast (bf16 keeps 8 bits of
# mantissa, fp16 11): far below what a wrong normalisation or a wrong clip does (~1e-1 and up).
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
HALF = {dtype: name for name, dtype in DTYPES.items() if dtype is not None}  # torch.bfloat16: "bf16", ...


def arithmetic(precision: str, model: torch.nn.Module) -> str:
    """The coarsest arithmetic a step's gradients see: autocast's (train.precision), or the weights'
    own when the model keeps them in 16 bits (a model built in bf16 computes in bf16 under fp32)."""
    return max([precision, *(HALF[p.dtype] for p in model.parameters() if p.dtype in HALF)],
               key=TOLERANCE.__getitem__)


@dataclass
class Result:
    check: str
    ok: bool
    numbers: str
    hint: str = ""


class Probe:
    """A trainer wired as train.py wires it (loop/build.py), in eval mode (no dropout: both sides of
    a comparison compute the same function), whose optimizer steps run on given batches and are
    read inside the optimizer's step."""

    def __init__(self, config: str, overrides: list[str], accum: int, batch: int):
        cfg = load_config(config, [*overrides, f"train.grad_accum={accum}", f"data.batch_size={batch}",
                                   "train.global_batch=0",  # the accumulation asked for, not derived
                                   "train.nan_policy=skip", "train.max_bad_steps=8", "ema.enabled=false",
                                   "train.async_save=false"],
                          DATASETS, MODELS)
        self.trainer = build_trainer(cfg, Dist(), pick_device(cfg.train.device), DATASETS, MODELS)
        self.trainer.model.eval()
        self.logged: list[tuple[float, float]] = []  # (loss, grad norm) of each step tried
        self.trainer.log = SimpleNamespace(
            record=lambda fields, loss, grad_norm: self.logged.append((float(loss), float(grad_norm))))

    def applied(self, micro: list[dict]) -> tuple[dict[str, torch.Tensor], float, float]:
        """Run optimizer steps on these batches until one is taken (fp16 may overflow first and
        back off its scale); return the gradients handed to the optimizer, by name (none if no step
        was taken), and the last logged norm and loss."""
        t, seen = self.trainer, {}

        def capture(opt, _args, _kwargs) -> None:
            # GradScaler.step hands a fused optimizer gradients still scaled, with the scale as
            # `grad_scale` (None once unscale_ ran): it divides inside its kernel, so divide here too.
            scale = getattr(opt, "grad_scale", None)
            inv = 1.0 if scale is None else 1.0 / float(scale)
            seen.update({n: p.grad.detach().double() * inv for n, p in t.raw.named_parameters()
                         if p.grad is not None})

        hook = t.optimizer.register_step_pre_hook(capture)
        for _ in range(8):
            t.feed.batches = iter(micro)
            t.step()
            if seen:
                break
        hook.remove()
        loss, norm = self.logged[-1]
        return seen, norm, loss


def step_batches(ds, seed: int, k: int, b: int) -> list[dict]:
    """The first k*b training samples in the loop's order that hold targets (a micro-batch without
    any weighs nothing, whatever its loss is divided by: a per-micro-batch mean would pass), as k
    micro-batches of b; fewer where the first 8*k*b samples hold fewer. Every micro-batch after the
    first keeps the first quarter of its real targets (when targets are ids; real ones, not
    positions, which a masked prompt leaves without any)."""
    found = []
    for batch in itertools.islice(train_loader(ds, k * b, seed, 0, 0, 2, False), 8):
        found.append(holding_targets(batch))
        if sum(len(f["idx"]) for f in found) >= k * b:
            break
    batch = {key: torch.cat([f[key] for f in found])[:k * b] for key, v in found[0].items() if torch.is_tensor(v)}
    micro = split_batch({**batch, "n_targets": -1}, k)  # recounted per micro-batch
    if not torch.is_floating_point(batch["y"]):
        for m in micro[1:]:
            y = m["y"].flatten()
            real = (y != IGNORE_INDEX).nonzero()[:, 0]
            first = real[:max(1, len(real) // 4)]
            kept = torch.full_like(y, IGNORE_INDEX)
            kept[first] = y[first]
            m["y"], m["n_targets"] = kept.view_as(m["y"]), len(first)
    return micro


def _join(micro: list[dict]) -> dict:
    """The micro-batches as one batch (targets recounted by summing)."""
    out = {k: torch.cat([m[k] for m in micro]) for k, v in micro[0].items() if torch.is_tensor(v)}
    return {**out, "n_targets": sum(m["n_targets"] for m in micro)}


def no_step(check: str, loss: float) -> Result:
    """A check whose step was never taken: the loss was not finite (the model's doing, on these
    batches: a micro-batch after the first holds a quarter of its targets), or the gradients were
    not (fp16 overflow, a learning rate too high)."""
    if not math.isfinite(loss):
        return Result(check, False, f"no optimizer step was taken in 8 tries: the loss was {loss}",
                      "a model that averages per sequence (or over some positions only), which is "
                      "0/0 for one without targets: the audit keeps the first quarter of a later "
                      "micro-batch's targets, whole sequences first; return the loss summed over "
                      "batch[\"y\"]'s real targets")
    return Result(check, False, "no optimizer step was taken in 8 tries (non-finite gradients every time)",
                  "lower optim.lr or check the data")


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten().cpu() for _, g in sorted(grads.items())])


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Relative difference of two sets of gradients by name. A parameter without a gradient on one
    side (a model that uses it for some samples only: one micro-batch may hold none) has zeros."""
    zeros = {n: torch.zeros_like(g) for n, g in {**a, **b}.items()}
    fa, fb = _flat({**zeros, **a}), _flat({**zeros, **b})
    return float((fa - fb).norm() / fb.norm().clamp_min(1e-30))


def reference(model: torch.nn.Module, batch: dict, device):
    """Plain float32, one batch, mean loss over the real targets, backward. Returns (gradients,
    their norm, the reference's arithmetic): the model's own dtypes where its forward casts to one
    of them (`x.to(torch.bfloat16)` before a bf16 layer), which float32 weights fail."""
    on_device = to_device(batch, device)
    try:
        ref, what = copy.deepcopy(model).float(), "float32"
        loss = loss_and_sums(ref(on_device))[0]
    except RuntimeError:  # "expected m1 and m2 to have the same dtype": a traceback, no table
        ref, what = copy.deepcopy(model), "own-dtype"
        loss = loss_and_sums(ref(on_device))[0]
    (loss / batch["n_targets"]).backward()
    grads = {name: p.grad.detach().double() for name, p in ref.named_parameters() if p.grad is not None}
    return grads, float(_flat(grads).norm()), what


def gradient_audits(config: str, overrides: list[str], checks: set[str]) -> list[Result]:
    if not {"accumulation", "clipping"} & checks:
        return []
    probe = load_config(config, overrides, DATASETS, MODELS)
    follow_global_batch(probe, 1)
    b, k = probe.data.batch_size, max(probe.train.grad_accum, 2)
    whole = Probe(config, overrides, 1, k * b)
    accum = Probe(config, overrides, k, b) if "accumulation" in checks else None  # not under CUDA graphs
    micro = step_batches(whole.trainer.data.train, probe.run.seed, k, b)
    counts = [m["n_targets"] for m in micro]
    if sum(len(m["idx"]) for m in micro) < k * b:  # a per-micro-batch mean cannot be told from a sum
        return [Result(check, False, f"only {sum(len(m['idx']) for m in micro)} of the first {8 * k * b} "
                       f"training samples hold a target (y other than -100); {k} micro-batches of {b} need "
                       f"{k * b}", "a data set whose samples mostly hold no target; check data.name's "
                       "training split") for check in ("accumulation", "clipping") if check in checks]
    w = whole.trainer
    kind = arithmetic(w.precision.name, w.raw)
    tol, kind = TOLERANCE[kind], kind if kind == w.precision.name else f"{kind} weights"
    # The reference from the weights before the step; its norm sets a clip that acts.
    ref, norm, what = reference(copy.deepcopy(w.raw), _join(micro), w.device)
    clip = asked = w.cfg.train.clip_grad
    if 0 < norm <= clip:
        clip = norm / 2
        for probe in filter(None, (accum, whole)):
            probe.trainer.cfg.train.clip_grad = clip  # read by Trainer.step at each step
    g_whole, norm_whole, loss_whole = whole.applied([_join(micro)])
    out = []
    if "accumulation" in checks:
        g_accum, norm_accum, loss_accum = accum.applied(micro)
        if not (g_accum and g_whole):
            out.append(no_step("accumulation", loss_accum if not g_accum else loss_whole))
        else:
            # The applied gradients alone miss a wrong factor where the clip rescales both sides
            # to one norm: the logged norm and loss (the true loss of the step) must agree too.
            diff = max(_rel(g_accum, g_whole),
                       abs(norm_accum - norm_whole) / max(norm_whole, 1e-30),
                       abs(loss_accum - loss_whole) / max(abs(loss_whole), 1e-30))
            ok, equal = diff <= tol, len(set(counts)) == 1
            note = "; equal target counts, so a per-micro-batch mean would pass too" if ok and equal else ""
            hint = ("with equal target counts a per-micro-batch mean divides right, so the usual cause is "
                    "a loss that does not grow with the batch: a prediction of shape (B,) broadcast "
                    "against targets of shape (B, 1) (a (B, B) matrix of errors); check the shapes "
                    "the model's loss compares") if equal else (
                    "each micro-batch's loss must be divided by the target count of the whole step (not "
                    "averaged per micro-batch), so the model's forward must return the loss summed over "
                    "its targets (reduction=\"sum\"), not their mean")
            out.append(Result("accumulation", ok, f"{k} x {b} vs 1 x {k * b} (targets per micro-batch "
                              f"{counts}): gradient, norm and loss rel. difference {diff:.1e} (tolerance {tol:g}, {kind}){note}",
                              hint))
    if "clipping" in checks:
        if not g_whole:
            out.append(no_step("clipping", loss_whole))
        else:
            scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # clip_grad_norm_'s rule
            diff = _rel(g_whole, {name: g * scale for name, g in ref.items()})
            ok = diff <= tol and abs(norm_whole - norm) <= max(tol * norm, 1e-6)
            set_for = f", set below the norm: the config's {asked:g} would not clip" if clip != asked else ""
            out.append(Result("clipping", ok,
                              f"applied gradient vs a plain {what} reference: rel. difference "
                              f"{diff:.1e}; gradient norm logged {norm_whole:.4g}, reference {norm:.4g}"
                              f" (train.clip_grad={clip:.4g}{set_for}, {kind})",
                              "unscale the gradients (GradScaler.unscale_) before clipping and before "
                              "measuring their norm; clip after the last micro-batch only"))
    return out
