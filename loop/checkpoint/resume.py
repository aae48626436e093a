"""Which checkpoint a run starts from, decided before anything in out_dir is written.

    run.resume=auto   newest valid checkpoint in out_dir/checkpoints (or, if that dir holds none,
                      the newest valid one in run.mirror); none at all -> a fresh start
    run.resume=never  fresh start; refused if out_dir already holds checkpoints it would overwrite
    run.resume=PATH   that checkpoint dir, which must verify (checkpoints/latest or /best: the
                      one it names); or, once this run has saved since starting there, its
                      newest checkpoint from PATH on (`continued`): the same command reruns on
    run.init_from=PATH (fresh starts only) model weights from that checkpoint (or exported
                      model.pt), nothing else
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from loop.checkpoint import store
from loop.config.load import flat, to_dict
from loop.config.schema import Config
from loop.distributed import fsdp
from loop.errors import BadInput

# What to do about weights that do not fit: when resuming, and when only the weights are taken.
RESUME = ("Use the config and model code it was trained with, or a new run.out_dir (and a new run.mirror, "
          "if one is set: it would hand the new run the same checkpoint).")
WARM_START = ("Set the model.* keys it was trained with, or leave run.init_from empty to start from "
              "random weights.")


def choose(resume: str, ckpt_root: Path, mirror: str, before_fetch=lambda: None) -> Path | None:
    """`before_fetch`: called before a checkpoint from the mirror is written into ckpt_root."""
    if resume == "never":
        if store.step_dirs(ckpt_root):
            raise BadInput(f"run.resume=never, but {ckpt_root} already holds checkpoints that a "
                           f"fresh run would overwrite; use a new run.out_dir.")
        if mirror:
            from loop.checkpoint.mirror import listed

            if listed(mirror)[2]:  # the mirror keeps what checkpoints/ keeps: it would prune them
                raise BadInput(f"run.resume=never, but run.mirror={mirror} already holds checkpoints "
                               f"that a fresh run's mirroring would delete; give the run its own "
                               f"run.mirror, or run.resume=auto to continue from them.")
        return None
    if not resume:  # Path("") is "." (here), which was named as "not a valid checkpoint"
        raise BadInput("config key run.resume is empty; expected auto, never or a checkpoint directory.")
    if resume != "auto":
        given = followed(Path(resume))
        return continued(ckpt_root, given) or verified(given, "run.resume")
    if not store.step_dirs(ckpt_root) and mirror:
        from loop.checkpoint.mirror import fetch_latest

        if fetched := fetch_latest(mirror, ckpt_root, before_fetch):
            return fetched
    path = store.newest_valid(ckpt_root)
    if path is None and (latest := ckpt_root / "latest").is_file():  # its checkpoints deleted by hand
        raise BadInput(f"run.resume=auto: {latest} names {latest.read_text(errors='replace').strip()}, "
                       f"but {ckpt_root} holds no checkpoint; a fresh start would overwrite this "
                       f"run's metrics and model. Expected the checkpoints it names; to start over, "
                       f"use a new run.out_dir (or delete {latest}).")
    return path


def continued(ckpt_root: Path, given: Path) -> Path | None:
    """The newest valid checkpoint in ckpt_root saved by a run that started from `given` (its
    manifest's `resumed_from`): a rerun of a command naming run.resume=PATH (after a Ctrl-C, a
    preemption, a torchrun restart, a requeue) went back to PATH and trained those steps again."""
    start = str(given.resolve())
    for path in reversed(store.step_dirs(ckpt_root)):
        if path.resolve() != given.resolve() and store.manifest(path).get("resumed_from") == start \
                and store.verify(path) is None:
            print(f"note: run.resume={given}: continuing from {path}, which this run saved after "
                  f"starting there (to start from {given} again, give a new run.out_dir)")
            return path
    return None


def origin(resume: str, path: Path | None) -> str | None:
    """The checkpoint a run's lineage started from by run.resume=PATH, recorded in each checkpoint
    it saves (`continued` looks for it); inherited through resumes from its own checkpoints."""
    if path is None:
        return None
    recorded = store.manifest(path).get("resumed_from")
    if resume in ("auto", "never") or recorded == str(followed(Path(resume)).resolve()):
        return recorded
    return str(path.resolve())


def followed(path: Path) -> Path:
    """checkpoints/latest and checkpoints/best are files holding a checkpoint's name: that one."""
    if path.name in ("latest", "best") and path.is_file():
        target = path.parent / path.read_text(errors="replace").strip()
        if not target.is_dir():  # deleted by hand, or copied without it
            raise BadInput(f"{path} names {target.name}, which is not in {path.parent}; expected the "
                           f"name of a checkpoint directory there.{checkpoints_near(path.parent)}")
        return target
    return path


def verified(path: Path, key: str) -> Path:
    if not path.exists():  # it said "manifest.json is missing" of a path that is not there at all
        raise BadInput(f"{key}={path}: no such file or directory; expected a checkpoint directory."
                       f"{checkpoints_near(path)}")
    reason = store.verify(path)
    if reason:
        raise BadInput(f"{key}={path}: not a valid checkpoint ({reason}); expected a checkpoint "
                       f"directory whose manifest.json verifies.{checkpoints_near(path)}")
    return path


def checkpoints_near(path: Path) -> str:
    """Where a run directory, its checkpoints/ or its model.pt was named instead of a checkpoint:
    the ones in it that would do (the newest, and the best if marked), for the error message."""
    for root in (path / "checkpoints", path, path.parent / "checkpoints"):
        if dirs := store.step_dirs(root):
            best = root / "best"
            best = f"; the best: {root / best.read_text()}" if best.is_file() else ""
            return f" {root} holds checkpoints: the newest is {dirs[-1]}{best}."
    return ""


def load_model_state(path: Path, model: nn.Module, cfg: Config, optimizer=None,
                     advice: str = "") -> dict:
    """Load a checkpoint's state.pt and put its weights (and, if given, the optimizer state) into
    `model`, refusing a mismatch. Weights alone load across strategies: an FSDP checkpoint's
    shards into a plain model and a whole state_dict into an FSDP one."""
    state = store.load(path, "state.pt")
    advice = advice or (RESUME if optimizer is not None else WARM_START)
    was_sharded = bool(state.get("sharded"))
    if optimizer is not None and was_sharded != fsdp.is_sharded(model):
        how = {True: "train.strategy=fsdp under torchrun", False: "plain python or train.strategy=ddp"}
        raise BadInput(f"checkpoint {path} was written with {how[was_sharded]}; resuming it with "
                       f"{how[not was_sharded]} is not supported. Use the strategy it was written "
                       f"with (any number of processes, `torchrun --nproc_per_node=1` included), or "
                       f"start a new run.out_dir with run.init_from={path} (weights only).")
    if was_sharded:
        refuse_mismatch(model, fsdp.saved_shapes(path), f"checkpoint {path}", state.get("config"), cfg,
                        advice)
        fsdp.load(model, optimizer, path)
    else:
        refuse_mismatch(model, state["model"], f"checkpoint {path}", state.get("config"), cfg,
                        advice)
        load_whole(model, state["model"])
    if optimizer is not None and not was_sharded:
        optimizer.load_state_dict(state["optimizer"])
    return state


def load_export(path: Path, model: nn.Module, cfg: Config) -> None:
    """run.init_from=FILE: the weights of an exported model.pt (loop/observe/summary.py: {"model",
    "config", "data"}, "ema" too with EMA on; FSDP runs export it whole), or of a bare state_dict
    (`torch.save(model.state_dict(), PATH)`), into `model`."""
    export = store.load(path.parent, path.name)
    weights = export.get("model", export) if isinstance(export, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise BadInput(f"run.init_from={path}: expected a checkpoint directory, a model.pt as "
                       f"train.py exports it (a dict whose \"model\" is a state_dict), or a "
                       f"state_dict saved with torch.save(model.state_dict(), PATH).")
    refuse_mismatch(model, weights, f"model file {path}", export.get("config"), cfg, WARM_START)
    load_whole(model, weights)


def load_whole(model: nn.Module, weights: dict) -> None:
    """A whole (unsharded) state_dict into a plain or an FSDP model."""
    if fsdp.is_sharded(model):
        fsdp.load_full(model, weights)
    else:
        model.load_state_dict(weights)


def refuse_mismatch(model: nn.Module, saved: dict, source: str, saved_cfg, cfg: Config,
                    advice: str) -> None:
    """BadInput naming every tensor that differs, the keys that size a model (model.*, and
    data.seq_len, its context) that its run set otherwise (`saved_cfg`: the config dict saved with
    it; None for a bare state_dict), and what to do (`advice`)."""
    bad = store.shape_mismatches(model, saved)
    if not bad:
        return
    why = ""
    if isinstance(saved_cfg, dict):
        old, new = flat(saved_cfg), flat(to_dict(cfg))
        keys = sorted(k for k in old.keys() | new.keys()
                      if (k.startswith("model.") or k == "data.seq_len") and old.get(k) != new.get(k))
        why = (f"It was trained with {', '.join(f'{k}={old.get(k)}' for k in keys)} (this config: "
               f"{', '.join(f'{k}={new.get(k)}' for k in keys)}). " if keys else
               "It was trained with this config's model.* keys and data.seq_len: the data's "
               "vocabulary or the model code differs. ")
    raise BadInput(f"{source} does not fit the configured model ({len(bad)} tensor(s)):\n  "
                   + "\n  ".join(bad) + f"\n{why}{advice}")
