"""torch.compile for a run (train.compile=true): what reaches it, and what its CUDA graphs forbid.

`train.compile_mode` is torch.compile's mode; `train.compile_options` are inductor's own options
(`torch._inductor.config`: coordinate_descent_tuning, triton.cudagraphs, ...) over the mode's, checked
by name and type before anything is built. The bench's bare loop compiles with the same settings.

CUDA graphs (reduce-overhead, max-autotune, or triton.cudagraphs on) cannot accumulate gradients over
micro-batches here: with .grad freed after each step (zero_grad(set_to_none=True)), torch's compiled
backward hands its graph's output buffer to .grad, and the next micro-batch's replay writes over it
(pytorch/pytorch#169545), so the step's gradient would be wrong, or torch raises mid-run. A run that
replays them trains each step in one micro-batch: accumulation is exit 2, an out-of-memory gives up
instead of splitting (loop/guards/oom.py), and so does a resume of a run that split.
"""
from __future__ import annotations

import types
import typing

import torch

from loop.config.fields import shown
from loop.errors import BadInput

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs
GRAPHS = "triton.cudagraphs"  # inductor's own switch for them (TORCHINDUCTOR_CUDAGRAPHS=1), any mode
WITHOUT_GRAPHS = (f"train.compile_mode=max-autotune-no-cudagraphs or default (no train.compile_options.{GRAPHS}=true, "
                  f"TORCHINDUCTOR_CUDAGRAPHS unset)")


def compile_kwargs(train) -> dict:
    """torch.compile's keyword arguments for the train section: its mode, or, with options, the mode's
    own options with train.compile_options over them (torch takes a mode or options, not both)."""
    if not train.compile_options:
        return {"mode": train.compile_mode}
    from torch._inductor import config as inductor
    from torch._inductor import list_mode_options

    # An int for a float option as a float: torch.compile checks isinstance(value, float).
    options = {k: float(v) if type(v) is int and _floats(_declared(inductor, k)) else v
               for k, v in train.compile_options.items()}
    return {"options": {**list_mode_options(train.compile_mode), **options}}


def check_options(train, deterministic: bool = False) -> None:
    """train.compile_options: each name one of inductor's options, each value of the type torch
    declares for it (the one torch.compile checks, where it checks: a Union or a Literal it lets
    through, and a value of the wrong one fails mid-compile, or not at all). Under run.deterministic
    (`deterministic`), not inductor's own deterministic mode turned off (loop/determinism.py)."""
    if not train.compile_options:
        return
    from torch._inductor import config as inductor

    known = inductor.get_config_copy()
    for name, value in train.compile_options.items():
        key = f"train.compile_options.{name}"
        if name not in known:
            raise BadInput(f"config key {key}: torch {torch.__version__}'s inductor has no option {name!r}; "
                           f"expected a name in torch._inductor.config (coordinate_descent_tuning, "
                           f"max_autotune_gemm, {GRAPHS}, ...).")
        if not _fits(value, hint := _declared(inductor, name)):
            raise BadInput(f"config key {key}: expected {_spelled(hint)}, the type torch declares for it "
                           f"(its default: {shown(known[name])}); got {shown(value)}.")
    if deterministic and train.compile_options.get("deterministic") is False:
        raise BadInput("config key train.compile_options.deterministic=false turns off what run.deterministic=true "
                       "needs of the compiler: kernels chosen without timing them, so that two runs compile "
                       "the same kernels; expected it left out, or run.deterministic=false.")


def _declared(inductor, name: str):
    """The type torch declares for an inductor option (an older torch's: its default's)."""
    get_type = getattr(inductor, "get_type", None)
    return get_type(name) if get_type else type(inductor.get_config_copy()[name])


def _members(hint) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _floats(hint) -> bool:
    """A float option that takes no int: an int given for it is read as a float."""
    return float in _members(hint) and int not in _members(hint)


def _fits(value, hint) -> bool:
    """A config value (bool, int, float or text) for an inductor option declared `hint`: of a scalar
    member of it (a bool is no int, an int is a float), or one of a Literal's values. A Callable,
    a list, None alone or a name torch cannot resolve ('CUDAGraphPolicy | None') takes none."""
    if len(members := _members(hint)) > 1:
        return any(_fits(value, m) for m in members)
    if typing.get_origin(hint) is typing.Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    if hint is float:
        return type(value) in (int, float)
    return hint in (bool, int, str) and type(value) is hint


def _spelled(hint) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    return text if len(text) <= 60 else f"{text[:57]}..."


def cuda_graphs(cfg, device: torch.device) -> str:
    """The setting that makes this run replay CUDA graphs, or '' (off CUDA there are none)."""
    t = cfg.train
    if not (t.compile and device.type == "cuda"):
        return ""
    if GRAPHS in t.compile_options:
        return f"train.compile_options.{GRAPHS}=true" if t.compile_options[GRAPHS] else ""
    if t.compile_mode in CUDA_GRAPH_MODES:
        return f"train.compile_mode={t.compile_mode}"
    from torch._inductor import config as inductor  # imported where a compile on CUDA will import it anyway

    return f"TORCHINDUCTOR_CUDAGRAPHS ({GRAPHS})" if inductor.triton.cudagraphs else ""


def check_cuda_graphs(cfg, device: torch.device, auto: bool = False) -> None:
    """A run that replays CUDA graphs trains each step in one micro-batch (the module's docstring).
    `auto`: data.batch_size is data.batch_size=auto's pick, the largest that fits."""
    t, b = cfg.train, cfg.data.batch_size
    if (setting := cuda_graphs(cfg, device)) and t.grad_accum > 1:
        whole = (f"data.batch_size=auto found {b} fits, not {b * t.grad_accum}: a smaller train.global_batch"
                 if auto else f"data.batch_size={b * t.grad_accum}" + ("" if t.global_batch else " train.grad_accum=1"))
        raise BadInput(f"{setting} replays CUDA graphs, which cannot accumulate gradients over micro-batches, "
                       f"and this step has train.grad_accum={t.grad_accum} (the next micro-batch's replay "
                       f"writes over the gradient the last one left); expected {WITHOUT_GRAPHS}, or the step "
                       f"in one micro-batch ({whole}).")


def check_resumed_split(setting: str, b: int, micro_split: int) -> None:
    """A resume whose checkpoint's run split its micro-batch after running out of memory (Progress.
    micro_split, fitted to this data.batch_size `b`: loop/guards/oom.py::resplit) trains each step in
    several micro-batches: under CUDA graphs (`setting`: cuda_graphs), the accumulation
    check_cuda_graphs refuses."""
    if setting and micro_split > 1:
        fits = -(-b // micro_split)
        raise BadInput(f"{setting} replays CUDA graphs, which cannot accumulate gradients over micro-batches, "
                       f"and the checkpoint's run ran out of memory, so this resume trains data.batch_size={b} "
                       f"in {micro_split} micro-batches of {fits}; expected {WITHOUT_GRAPHS} to resume it.")
