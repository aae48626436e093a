"""What a checkpoint holds, and putting it back.

A checkpoint is the state of every part of the run, by name (`Trainer.parts`): model (unwrapped
keys), optimizer, LR schedule, GradScaler, EMA, best/early-stop monitor and progress (the data
position) in `state.pt`, written by rank 0, beside the run it came from (its config, world size
and metadata, which a resume compares with its own: loop/checkpoint/notes.py); and each rank's RNG
streams in `rng_rank<r>.pt`. Under FSDP the model, optimizer and EMA weights are not in state.pt:
every rank writes its shards with torch.distributed.checkpoint (loop/distributed/fsdp.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from loop.checkpoint import notes, store
from loop.checkpoint.resume import followed, origin, verified
from loop.checkpoint.weights import load_export, load_model_state
from loop.distributed import fsdp
from loop.errors import BadInput
from loop.guards.oom import resplit
from loop.rng import rank_seed, seed_everything

SHARDED = ("model", "optimizer")  # under FSDP: in the shards every rank writes, not in state.pt
FORMAT = 2  # state.pt's layout: one entry per part. A resume refuses another (weights.py)


def files(parts: dict, rank: int, sharded: bool, run_facts: dict) -> dict[str, object]:
    """The files this rank writes: rank 0 state.pt (every part but the RNG streams, and `run_facts`),
    every rank its RNG streams. A part that is off (EMA) is None."""
    mine = {f"rng_rank{rank}.pt": parts["rng"].state_dict()}
    if rank != 0:
        return mine
    shared = {name: None if part is None or (sharded and name in SHARDED) else part.state_dict()
              for name, part in parts.items() if name != "rng"}
    return {"state.pt": {**shared, **run_facts, "sharded": sharded, "format": FORMAT}, **mine}


def restore(path: Path, parts: dict, cfg, dist, metadata: dict, split: int | None = None) -> str | None:
    """Checkpoint `path` into every part, saying what differs from the run that saved it (`metadata`:
    this run's; loop/checkpoint/notes.py). The weights are checked to fit before anything is
    loaded; the RNG streams come last, since loading the others may draw from them. `split`: a
    rollback's micro_split, this run's own for its data.batch_size, which it keeps (a resume fits
    the checkpoint's to data.batch_size instead). Returns the origin the checkpoints this run saves
    record (loop/checkpoint/resume.py::origin)."""
    dist.say(f"loading checkpoint {path} ...")
    model, ema, rank, lab = parts["model"], parts["ema"], dist.rank, cfg.lab.break_
    state = load_model_state(path, model, cfg, parts["optimizer"], fmt=FORMAT)  # FSDP: the shards of both
    if ema and state["ema"] and state["ema"]["weights"] is None:  # FSDP: the EMA's shards too
        fsdp.load_weights(ema.module, path, "ema")
    for name in ("scheduler", "scaler", "ema", "monitor", "progress"):
        if parts[name] is None or (name in ("ema", "scaler") and not state.get(name)):  # off now or then
            continue  # (EMA; a scaler is off but for fp16)
        if name == "scaler" and lab == "no_scaler_state":  # lab: the loss scale starts over
            continue
        with plain_data(path / "state.pt", name):
            parts[name].load_state_dict(state.get(name))
    if ema and not state["ema"]:  # ema.enabled turned on at this resume: from the resumed weights
        ema.reset(model)
    mine = f"rng_rank{rank}.pt"
    if lab == "no_rng_restore":  # lab: the streams go on from wherever this process is
        pass
    elif (path / mine).exists():
        with plain_data(path / mine, "random streams"):
            parts["rng"].load_state_dict(store.load(path, mine))
    else:  # more processes than the run that saved it: this rank's streams start fresh
        seed_everything(rank_seed(cfg.run.seed, rank, parts["progress"].step))
        print(f"note: rank {rank}: {path} has no {mine} (saved with world size "
              f"{state['world_size']}); its random streams start from a new seed")
    with plain_data(path / "state.pt", "config and metadata"):
        changed = notes.what_changed(state, cfg, dist.world, metadata)
        # An out-of-memory split is for the micro-batch it split: the checkpoint's data.batch_size.
        if split is not None:
            parts["progress"].micro_split = split
        elif note := resplit(parts["progress"], state["config"]["data"]["batch_size"], cfg.data.batch_size):
            changed.append(note)
    for note in changed:
        dist.say(f"note: {note}")
    step = parts["progress"].step
    dist.say(f"resumed from {path} at step {step}")
    here = Path(cfg.run.out_dir) / "checkpoints"
    for note in notes.after_resume(step, parts["monitor"].state, cfg, here, path):
        dist.say(f"note: {note}")
    return origin(cfg.run.resume, path)


@contextmanager
def plain_data(f: Path, part: str):
    """A part of checkpoint file `f` that does not load (a value of another type or shape than the
    loop writes: edited, or another program's) is bad input naming it, not a traceback."""
    try:
        yield
    except (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.OutOfMemoryError)):
        raise  # the device's failure (exit 1 or 3: a rerun may do), not the checkpoint's
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise BadInput(f"checkpoint file {f}: cannot load its {part} ({type(e).__name__}: {str(e)[:160]}); "
                       f"expected what this loop writes. Resume from another checkpoint (run.resume=PATH).") from None


def warm_start(path: Path, model: nn.Module, ema, cfg) -> Path:
    """run.init_from: model weights only (optimizer, schedule and step start fresh), from a
    checkpoint directory or a model.pt; returns the path they came from."""
    path = followed(path)
    if path.is_file():  # a model.pt: train.py's export, or one given to you
        load_export(path, model, cfg)
    else:
        load_model_state(verified(path, "run.init_from"), model, cfg)
    if ema:  # the average starts from the warm-start weights
        ema.reset(model)
    return path
