"""Lab switches: each breaks one concern of the honest loop on purpose, for teaching.

    python train.py lab.break=no_rng_restore            # a run that says loudly what it breaks
    make verify ARGS="lab.break=no_rng_restore"         # ... and the audit that catches it

Off by default (`lab.break=""`). A run with one on prints a banner at the start and records the
switch in metadata.json and summary.json. Each switch is marked `lab:` in the code it breaks
(grep for its name); the table below is what `make verify` reports for each (tests/test_lab.py
proves it on the default config, with `needs` added where the concern exists only under fp16).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    breaks: str  # what goes wrong, in one line
    caught_by: tuple[str, ...]  # the make verify checks that fail
    needs: tuple[str, ...] = ()  # overrides under which the concern exists at all


SWITCHES = {
    "no_rng_restore": Switch(
        "a resume does not restore the RNG streams, so dropout masks after it differ",
        ("resume",)),
    "no_sampler_state": Switch(
        "a resume restarts the data order from the first sample instead of the saved position",
        ("resume", "data")),
    "clip_before_unscale": Switch(
        "fp16: gradients are clipped while still multiplied by the loss scale, then unscaled",
        ("clipping",), ("train.precision=fp16",)),
    "mean_loss_per_microbatch": Switch(
        "each micro-batch's loss is its own mean divided by the step's micro-batch count, so "
        "micro-batches with fewer targets weigh more than they should", ("accumulation",)),
    "no_scaler_state": Switch(
        "fp16: a resume starts a fresh GradScaler (loss scale and growth counter)",
        ("resume",), ("train.precision=fp16",)),
    "eval_consumes_train_rng": Switch(
        "validation batches are drawn from the training RNG, so evaluating changes training",
        ("eval",)),
}


def banner(name: str) -> str:
    s = SWITCHES[name]
    need = f" (it only bites with {' '.join(s.needs)})" if s.needs else ""
    line = "!" * 100
    return (f"{line}\nLAB SWITCH ON: lab.break={name}: {s.breaks}{need}.\nThis run is broken on "
            f"purpose; make verify should fail its {', '.join(s.caught_by)} check.\n{line}")
