"""Whether a checkpoint's (or an exported model.pt's) weights fit the model this run built, and
loading them: a mismatch names every tensor that differs and the config keys that size a model,
before anything is loaded. Weights alone load across strategies: an FSDP checkpoint's shards into a
plain model, a whole state_dict into an FSDP one.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from loop.checkpoint import store
from loop.config.load import differing, flat, to_dict
from loop.config.schema import Config
from loop.distributed import fsdp
from loop.errors import BadInput

# What to do about weights that do not fit: when resuming, and when only the weights are taken.
RESUME = ("Use the config and model code it was trained with, or a new run.out_dir (and a new run.mirror, "
          "if one is set: it would hand the new run the same checkpoint).")
WARM_START = ("Set the model.* keys it was trained with, or leave run.init_from empty to start from "
              "random weights.")


def load_model_state(path: Path, model: nn.Module, cfg: Config, optimizer=None,
                     advice: str = "", fmt: int | None = None) -> dict:
    """Load a checkpoint's state.pt and put its weights (and, if given, the optimizer state) into
    `model`, refusing a mismatch. `fmt`: the layout a resume reads (loop/checkpoint/state.py); a
    warm start reads only the weights, in any layout."""
    state = store.load(path, "state.pt")
    if fmt is not None and state.get("format") != fmt:
        raise BadInput(f"checkpoint {path} has another layout (format {state.get('format', 1)}; this "
                       f"loop resumes format {fmt}): it was written by another version of the loop. "
                       f"Resume it with that version, or start a new run.out_dir with "
                       f"run.init_from={path} (its weights only).")
    advice = advice or (RESUME if optimizer is not None else WARM_START)
    was_sharded = bool(state.get("sharded"))
    if optimizer is not None and was_sharded != fsdp.is_sharded(model):
        how = {True: "train.strategy=fsdp under torchrun", False: "plain python or train.strategy=ddp"}
        raise BadInput(f"checkpoint {path} was written with {how[was_sharded]}; resuming it with "
                       f"{how[not was_sharded]} is not supported. Use the strategy it was written "
                       f"with (any number of processes, `torchrun --nproc_per_node=1` included), or "
                       f"start a new run.out_dir with run.init_from={path} (weights only).")
    saved = fsdp.saved_shapes(path) if was_sharded else state["model"]
    refuse_mismatch(model, saved, f"checkpoint {path}", state.get("config"), cfg, advice)
    if was_sharded:
        fsdp.load(model, optimizer, path)  # the optimizer's shards too
    else:
        load_whole(model, state["model"])
        if optimizer is not None:
            load_optimizer(optimizer, state["optimizer"], model, path)
    return state


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict, model: nn.Module, path: Path) -> None:
    """The optimizer's state, refused where it does not fit the parameters it is for: torch maps it
    by position, and a fused kernel reads a moment of another shape past its end (NaN weights)."""
    params = [q for g in optimizer.param_groups for q in g["params"]]
    names = {q: n for n, q in model.named_parameters()}
    try:
        saved_ids = [i for g in saved["param_groups"] for i in g["params"]]
        bad = [f"{names.get(params[n], n)}: {k} {tuple(v.shape)} vs parameter {tuple(params[n].shape)}"
               for i, n in zip(saved_ids, range(len(params))) for k, v in saved["state"].get(i, {}).items()
               if torch.is_tensor(v) and v.dim() > 0 and v.shape != params[n].shape]
        if len(saved_ids) != len(params) or bad:
            raise ValueError(f"{len(saved_ids)} parameters saved, {len(params)} here" if not bad else
                             f"{len(bad)} moment(s) of another shape: {'; '.join(bad[:3])}")
        optimizer.load_state_dict(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BadInput(f"checkpoint file {path / 'state.pt'}: its optimizer state does not fit this model's "
                       f"parameters ({e}): the model creates its parameters in another order or shape "
                       f"than the run that saved it. {RESUME}") from None


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
    bad = shape_mismatches(model, saved)
    if not bad:
        return
    why = ""
    if isinstance(saved_cfg, dict):
        old, new = flat(saved_cfg), flat(to_dict(cfg))
        keys = [k for k in differing(old, new) if k.startswith("model.") or k == "data.seq_len"]
        why = (f"It was trained with {', '.join(f'{k}={old.get(k)}' for k in keys)} (this config: "
               f"{', '.join(f'{k}={new.get(k)}' for k in keys)}). " if keys else
               "It was trained with this config's model.* keys and data.seq_len: the data's "
               "vocabulary or the model code differs. ")
    raise BadInput(f"{source} does not fit the configured model ({len(bad)} tensor(s)):\n  "
                   + "\n  ".join(bad) + f"\n{why}{advice}")


def shape_mismatches(model: nn.Module, saved: dict) -> list[str]:
    """What differs between the model and a saved state_dict, one line per key."""
    mine = model.state_dict()
    out = [f"{k}: missing from checkpoint" for k in mine if k not in saved]
    out += [f"{k}: in checkpoint, not in the model" for k in saved if k not in mine]
    out += [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(v.shape)}"
            for k, v in mine.items() if k in saved and saved[k].shape != v.shape]
    return out
