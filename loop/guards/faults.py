"""Deliberate faults (`faults.*`): an out-of-memory error or a non-finite loss at a chosen step,
for tests and fire drills.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def fire_once(fired: set[str], fault: str, due: bool) -> bool:
    """An injected fault fires the first time its step is reached in a process (a rollback
    replays steps, and must not meet the same fault again)."""
    if due and fault not in fired:
        fired.add(fault)
        return True
    return False


def injected_oom(*_) -> None:
    """faults.oom_at_step, raised from a hook: as a forward ends (its activations allocated, where
    a real out-of-memory error would find them) or as a backward starts."""
    raise torch.OutOfMemoryError("injected by faults.oom_at_step")


@contextmanager
def forward_oom(module: torch.nn.Module, due: bool):
    """Around a forward: if `due`, `module`'s forward raises `injected_oom` as it ends."""
    handle = module.register_forward_hook(injected_oom) if due else None
    try:
        yield
    finally:
        if handle:
            handle.remove()

