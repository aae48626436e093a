"""Seed every random stream, and capture / restore all of them for exact resume.

Streams: Python `random`, NumPy's global generator, torch CPU, and the current accelerator
device (CUDA or MPS). They are the process's, so each rank checkpoints its own (`RngStreams`, a
file per rank). The state holds only tensors and primitives, so it loads with
`torch.load(weights_only=True)`. `own_rng`: the streams seeded for a while and put back (what
validation draws in a model that draws in eval mode).
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of one rank's streams from `step` on, derived from all three by NumPy's
    SeedSequence: no two ranks or steps share a stream, nor any with the builders (seeded `seed`)."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


class RngStreams:
    """Every random stream of this process, as a part of the checkpoint."""

    def state_dict(self) -> dict:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state = {
            "python": random.getstate(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()  # the current device: one per rank
        if torch.backends.mps.is_available():
            state["mps"] = torch.mps.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["gauss"]))
        torch.set_rng_state(state["torch"])
        # A device this machine lacks (a checkpoint from a Mac, or a GPU node): its stream has no
        # use here, and the resume's note says the run is not exact on another machine.
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        if "mps" in state and torch.backends.mps.is_available():
            torch.mps.set_rng_state(state["mps"])


@contextlib.contextmanager
def own_rng(device: torch.device, seed: int):
    """Every random stream (Python's, NumPy's, torch's CPU and `device`'s) seeded with `seed` inside,
    and as it was after: what a forward draws there is the same at every evaluation, and training's
    next draws (dropout, a model's own `random`) are those of a run that never evaluated."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
            random.seed(seed)
            np.random.seed(seed % 2**32)  # NumPy's legacy seed is 32-bit
            torch.default_generator.manual_seed(seed)
            if device.type != "cpu":
                torch.get_device_module(device.type).manual_seed(seed)  # this process's device only
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
