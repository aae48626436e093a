"""Best-checkpoint tracking and early stopping on one validation metric.

`update(step, value)` is called after each evaluation; it says whether the value is a new best (the
trainer then saves a checkpoint at that step and retention keeps it). Early stopping fires when the
metric has not improved by `min_delta` for `patience` evaluations in a row; the best checkpoint
takes any improvement (as Keras and Lightning keep them: min_delta is early stopping's alone). The
state lives in the checkpoint, so a resumed run stops at the same evaluation an uninterrupted one
would.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class MonitorState:
    best: float | None = None
    best_step: int = 0
    bad_evals: int = 0  # evaluations since the last improvement by min_delta
    reference: float | None = None  # the value that improvement is measured from (best if min_delta=0)
    stop_reason: str = ""  # set once early stopping fires


class Monitor:
    def __init__(self, metric: str, mode: str, patience: int, min_delta: float):
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.state = MonitorState()

    def update(self, step: int, value: float) -> bool:
        s = self.state
        # A non-finite value is never the best: NaN compares false with everything, so one taken as
        # the first best would never be beaten, and `checkpoints/best` would keep its step.
        def beats(ref: float | None, delta: float) -> bool:
            return ref is None or (value < ref - delta if self.mode == "min" else value > ref + delta)

        better = math.isfinite(value) and beats(s.best, 0.0)
        if better:
            s.best, s.best_step = value, step
        if math.isfinite(value) and beats(s.reference, self.min_delta):
            s.reference, s.bad_evals = value, 0
        else:
            s.bad_evals += 1
            self.stop_if_patience_ran_out()
        return better

    def stop_if_patience_ran_out(self) -> None:
        s = self.state
        if self.patience and s.bad_evals >= self.patience:
            best = "none finite" if s.best is None else f"best {s.best:.6g} at step {s.best_step}"
            s.stop_reason = (f"{self.metric} did not improve by {self.min_delta} for "
                             f"{s.bad_evals} evaluations ({best})")

    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, **asdict(self.state)}

    def load_state_dict(self, d: dict) -> None:
        """A checkpoint's tracking, if it watched the same metric the same way; else none is kept
        (no yardstick: the best checkpoint and early stopping start over from here)."""
        saved = dict(d)
        if (saved.pop("metric"), saved.pop("mode")) != (self.metric, self.mode):
            self.state = MonitorState()
            return
        self.state = MonitorState(**saved)
        # Stopped or not follows from the count under this run's patience: resumed with a larger
        # train.early_stop_patience, or 0, a run that stopped early trains on; with a smaller one
        # that the count has reached, it stops here.
        self.state.stop_reason = ""
        self.stop_if_patience_ran_out()
