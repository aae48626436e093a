"""How far a run has come: optimizer steps, and the data position they consumed.

The data position (`samples`) counts the global samples that optimizer steps took, not what the
DataLoader prefetched: a resume starts a fresh sampler there (loop/data/sampler.py) and sees exactly
the samples the uninterrupted run saw from there on. Like every part of a checkpoint it has
`state_dict` / `load_state_dict`; loading puts the values into this object, so whoever holds it
sees the resumed position.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

# Fields a checkpoint may lack: read as their defaults (no row of bad steps under way).
MAY_LACK = ("bad_streak", "last_bad")


@dataclass
class Progress:
    step: int = 0  # optimizer steps done, skipped ones included
    samples: int = 0  # training samples consumed by those steps: the data position
    tokens: int = 0  # targets in those samples
    skipped: int = 0  # steps train.nan_policy=skip dropped (fp16 overflows, empty steps: counted apart)
    overflows: int = 0  # fp16 steps not taken for an overflow at a scale > 1 (the scale backed off)
    empty: int = 0  # steps skipped because their batches held no target (every y -100)
    train_s: float = 0.0  # wall time of the steps taken and their evaluations, not of checkpoint
    # writes or rolled-back steps, over every start of the run (resumes too)
    micro_split: int = 1  # each loaded batch is cut in this many micro-batches (doubles on OOM)
    rollbacks: int = 0  # times training went back to a checkpoint after a non-finite step
    skip_windows: list[list[int]] = field(default_factory=list)  # [start, end) positions never trained on
    bad_streak: int = 0  # non-finite steps in a row, none past them between (loop/guards/nonfinite.py)
    last_bad: int = 0  # the step the last of them was

    def advance(self, batches: list[dict], n_targets: int, world: int) -> None:
        """Count one optimizer step over `batches` (this rank's batches; every rank took as many)."""
        self.step += 1
        self.samples += sum(len(b["idx"]) for b in batches) * world
        self.tokens += n_targets

    def pass_over(self, width: int) -> None:
        """Mark the next step's `width` global samples, from the data position on, as never to be
        trained on (a rollback's bad window)."""
        self.skip_windows = [list(w) for w in sorted({*self.windows(width), (self.samples, self.samples + width)})]

    def windows(self, width: int) -> set[tuple[int, int]]:
        """The windows as (start, end); an int, as a checkpoint holding starts only has them, is a
        window's start, one step of `width` samples."""
        return {(w, w + width) if isinstance(w, int) else tuple(w) for w in self.skip_windows}

    def past_windows(self, width: int) -> int:
        """The data position of the next step of `width` global samples, past every window it
        would touch: a resume may take another width than the run that marked a window, and the
        step then starts past the window's end, never inside it."""
        at, moved = self.samples, True
        while moved:
            moved = False
            for start, end in self.windows(width):
                if start < at + width and at < end:
                    at, moved = end, True
        return at

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """ValueError for a value no run writes (a negative step, no micro-batch), which would train
        on from a wrong data position without a word, or fail later, after the run's files."""
        for f in fields(self):
            value = state[f.name] if f.name in state or f.name not in MAY_LACK else f.default
            if not _valid(f.name, value):
                raise ValueError(f"progress {f.name} = {value!r}")
            setattr(self, f.name, value)


def _count(value) -> bool:
    return type(value) is int and value >= 0


def _valid(name: str, value) -> bool:
    if name == "skip_windows":
        return isinstance(value, list) and all(_count(w) or (isinstance(w, list) and len(w) == 2 and
                                                            all(map(_count, w))) for w in value)
    if name == "train_s":
        return type(value) in (int, float) and value >= 0
    return _count(value) and (name != "micro_split" or value >= 1)
