"""The model's contract, checked on what every forward returns (`loss_and_sums`).

A model's `forward(batch)` returns the loss summed over the batch's real targets (targets equal to
-100 are not counted), or a dict with that sum under "loss" and more sums over the same targets (a
classifier: "accuracy", the number it got right). The loop divides by the target count of the whole
optimizer step, so gradient accumulation is exact, and validation divides each sum by the count of
its targets. Before anything is written, `check_model` (loop/probe.py) probes a
validation batch through the model: the loss is a sum, and train.best_metric is one it reports.
"""
from __future__ import annotations

import torch

from loop.errors import BadInput

CONTRACT = ("expected the loss summed over the batch's real targets as a tensor of one number "
            "(shape (), e.g. reduction=\"sum\"), or a dict with it under \"loss\" and more such sums "
            "(docs/bring-your-own.md)")


def loss_and_sums(out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Split what a model's forward returned into the summed loss and its other sums. Anything else
    is the model's contract broken: a clear error naming what came back, not a traceback from deep
    in the loop. Only metadata is read (no host sync)."""
    sums = out if isinstance(out, dict) else {"loss": out}
    if "loss" not in sums:
        raise BadInput(f"the model's forward(batch) returned a dict without \"loss\" (keys: "
                       f"{', '.join(map(str, sums))}); {CONTRACT}.")
    for name, v in sums.items():
        if not torch.is_tensor(v) or v.dim() != 0:
            what = f"a tensor of shape {tuple(v.shape)}" if torch.is_tensor(v) else f"a {type(v).__name__}"
            raise BadInput(f"the model's forward(batch) returned {what}"
                           f"{f' under {name!r}' if out is sums else ''}; {CONTRACT}.")
    loss = sums["loss"]
    if not torch.is_floating_point(loss):
        raise BadInput(f"the model's forward(batch) returned a loss of dtype {loss.dtype}, which "
                       f"cannot be differentiated; {CONTRACT}.")
    if torch.is_grad_enabled() and not loss.requires_grad:  # training: backward needs a graph
        raise BadInput(f"the model's forward(batch) returned a loss detached from the weights "
                       f"(requires_grad=False), which cannot be differentiated; {CONTRACT}.")
    return loss, {k: v for k, v in sums.items() if k != "loss"}
