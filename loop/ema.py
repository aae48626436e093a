"""EMA of the weights: a copy of the model (`EMA.module`), averaged after every optimizer step taken.

The first update copies the weights; the one after n updates averages with the decay
min(decay, (1+n)/(warmup+n)), which warms up so that early averages are not dominated by the
random initial weights. The copy is validated, checkpointed and exported; its
checkpoint state is its plain weights (no `module.` prefix) and the update count (a buffer in no
state_dict is copied from the model, not averaged), and with FSDP
the weights are sharded like the model's and saved with its shards (loop/distributed/fsdp.py).

It is built from the model before that is wrapped (an FSDP module cannot be deep-copied);
`loop.distributed.wrap.wrap` then gives the copy rank 0's weights and, with FSDP, the model's
sharding.

Weights the model keeps in 16 bits are averaged in float32: in bfloat16, the default decay 0.999
rounds to 1.0 and the average never moves from its first value (its validation loss stays the
initial model's, and early stopping stops a run that is learning); at 0.99 it rounds to 0.988,
and each step's small update mostly rounds away. The float32 copy costs twice the 16-bit weights'
memory. Validation and text samples round it to the weights' own dtypes (`in_model_dtypes`): a
forward may cast to the dtype its weights were built in.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

from loop.distributed import fsdp


class EMA(AveragedModel):
    """AveragedModel holds the copy and its update counter (in host memory, so reading it is no
    device sync). Its own `update_parameters` is not used: it pairs a float32 average with bfloat16
    weights but refuses float16 ones, and computes (1 - d) * w in the weights' dtype, rounded the
    same way each step (a bf16 average would settle up to half a bf16 step off)."""

    def __init__(self, model: nn.Module, decay: float, warmup: int, shapes_only: bool = False):
        """`shapes_only`: the copy on the meta device (no memory), which FSDP sharding fills with
        rank 0's weights (loop/distributed/fsdp.py::shard)."""
        super().__init__(meta_copy(model) if shapes_only else model, use_buffers=True)
        self.decay, self.warmup = decay, warmup
        # A buffer in no state_dict (a cache, RoPE's frequencies) is in no checkpoint either: it is
        # copied from the model, not averaged, so a resumed run's copy holds what an uninterrupted
        # one's does (an average of a constant drifts by rounding).
        kept = self.module.state_dict().keys()
        self.averaged = [True] * len(list(self.module.parameters())) + \
            [name in kept for name, _ in self.module.named_buffers()]
        # Each tensor's dtype in the model where that is 16-bit (None: kept as it is), by its place
        # in parameters() then buffers(): moving the copy to its device makes new buffer tensors.
        self.narrow = [t.dtype if t.is_floating_point() and torch.finfo(t.dtype).bits < 32 else None
                       for t in [*self.module.parameters(), *self.module.buffers()]]
        for t, dtype in zip([*self.module.parameters(), *self.module.buffers()], self.narrow):
            if dtype is not None:
                t.data = t.data.float()  # in place: tied weights stay one tensor

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Average `model`'s weights and the floating buffers of its state_dict in (the other
        buffers copied): one foreach update per device and dtype (FSDP: this rank's shards); the
        decay stays a device tensor (no host read)."""
        averages = [fsdp.local(t) for t in (*self.module.parameters(), *self.module.buffers())]
        groups: dict[tuple, tuple[list, list]] = {}
        for a, w, averaged in zip(averages, (*model.parameters(), *model.buffers()), self.averaged):
            avg, new = groups.setdefault((a.device, a.dtype, averaged), ([], []))
            avg.append(a)
            new.append(fsdp.local(w).detach().to(a.dtype))
        first = bool(self.n_averaged == 0)
        for (device, dtype, averaged), (avg, new) in groups.items():
            # Counters (batch norm's) and buffers in no state_dict are copied, not averaged.
            if first or not dtype.is_floating_point or not averaged:
                torch._foreach_copy_(avg, new)
                continue
            n = self.n_averaged.to(device)
            d = torch.clamp((1 + n) / (self.warmup + n), max=self.decay).to(dtype)
            torch._foreach_mul_(avg, d)
            torch._foreach_add_(avg, torch._foreach_mul(new, 1 - d))
        self.n_averaged += 1

    @contextlib.contextmanager
    def in_model_dtypes(self):
        """The average rounded to the model's own dtypes inside (validation, a text sample), the
        float32 average as it was after: a forward written for 16-bit weights (`x.bfloat16()` before
        a bf16 layer) then runs on the copy as on the model, not into a dtype mismatch. Under FSDP
        the shards stay as they are (FSDP gathers them in the dtype they were sharded in)."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        narrowed = [] if fsdp.is_sharded(self.module) else \
            [(t, t.data, dtype) for t, dtype in zip(tensors, self.narrow) if dtype is not None]
        for t, _, dtype in narrowed:
            t.data = t.data.to(dtype)
        try:
            yield
        finally:
            for t, average, _ in narrowed:
                t.data = average

    def reset(self, model: nn.Module) -> None:
        """Start the average over from `model`'s weights (a warm start, or EMA turned on at a resume)."""
        self.module.load_state_dict(model.state_dict())
        self.n_averaged.zero_()

    def state_dict(self) -> dict:
        """The weights (None under FSDP: they are in the checkpoint's shards) and the update count."""
        sharded = fsdp.is_sharded(self.module)
        return {"weights": None if sharded else self.module.state_dict(), "n_averaged": self.n_averaged}

    def load_state_dict(self, state: dict) -> None:
        if state["weights"] is not None:  # else sharded: loaded with the model's shards
            self.module.load_state_dict(state["weights"])
        self.n_averaged.copy_(state["n_averaged"])


def meta_copy(model: nn.Module) -> nn.Module:
    """`model` deep-copied with every parameter and buffer replaced by a meta tensor of its shape:
    the structure, tied weights (one tensor, one copy) and compilation are kept, no memory taken."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)
