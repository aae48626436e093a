"""Typed configuration: dataclasses per section, loaded from YAML, with dotted CLI overrides.

    python train.py --config configs/default.yaml optim.lr=3e-4 optim.betas.1=0.99 train.max_steps=100

The `data` and `model` sections are defined next to their builders (data/config.py,
model/config.py), so a new task adds its options there. Every key is checked before anything runs: an unknown key gets a did-you-mean, a wrong type or an
out-of-range value names the key, the expected type and the value given, malformed YAML (a key
given twice included) names the file and line. All of these raise `BadInput` (exit code 2, nothing written). `save` writes the
resolved config; `load_config` on that file gives back an equal object.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data.config import DataConfig, MarkovConfig  # noqa: F401 (MarkovConfig: importable from here too)
from loop.atomic import atomic_write
from loop.config_check import DecimalLoader, check, from_dict, opt, override, to_dict
from loop.errors import BadInput
from loop.lab import SWITCHES
from loop.paths import check_paths
from model.config import ModelConfig

# Found from anywhere: `python ~/proj/train.py` run in another directory trains the default too
# (relative paths in a config, such as run.out_dir, stay relative to the working directory).
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    seed: int = opt(1337, min=0, max=2**32 - 1)  # NumPy's global generator takes 32 bits
    resume: str = "auto"  # auto | never | path to a checkpoint directory
    init_from: str = ""  # a checkpoint dir or a model.pt: its model weights only (a fresh run)
    mirror: str = ""  # also copy each checkpoint here: a directory or an fsspec URL
    deterministic: bool = False  # deterministic kernels only (see loop/determinism.py)


@dataclass
class OptimConfig:
    lr: float = opt(1e-3, min=0.0)
    weight_decay: float = opt(0.1, min=0.0)
    betas: list[float] = opt([0.9, 0.95], min=0.0, below=1.0)
    eps: float = opt(1e-8, above=0.0)  # AdamW divides by sqrt(v) + eps: 0 turns a zero gradient into NaN


@dataclass
class ScheduleConfig:
    name: str = "warmup_cosine"  # a key of loop.schedule.SCHEDULES
    warmup_steps: int = opt(20, min=0)
    min_lr_ratio: float = opt(0.1, min=0.0, max=1.0)  # cosine floor, as a fraction of optim.lr
    restart_period: int = opt(100, min=1)  # cosine_restarts: steps in the first cycle
    restart_mult: int = opt(1, min=1)  # cosine_restarts: each cycle is this many times longer
    step_size: int = opt(100, min=1)  # step: decay every this many steps
    gamma: float = opt(0.5, min=0.0)  # step: decay factor


@dataclass
class TrainConfig:
    max_steps: int = opt(500, min=0)
    grad_accum: int = opt(2, min=1)
    clip_grad: float = opt(1.0, min=0.0)  # 0 = no clipping (the norm is still logged)
    precision: str = opt("auto", choices=("auto", "bf16", "fp16", "fp32"))
    device: str = "auto"  # auto (cuda > mps > cpu) or a torch device string
    log_every: int = opt(10, min=1)
    eval_every: int = opt(50, min=0)  # and at the last step; 0 = only there
    eval_batches: int = opt(10, min=1)
    ckpt_every: int = opt(100, min=0)  # 0 = only at the end
    keep_last: int = opt(3, min=1)  # newest checkpoints kept, plus the best one
    async_save: bool = False  # copy state to CPU memory, write the checkpoint in a background thread
    best_metric: str = "val_loss"  # the validation metric that picks the best checkpoint
    best_mode: str = opt("min", choices=("min", "max"))
    early_stop_patience: int = opt(0, min=0)  # stop after this many evals without improvement; 0 = off
    early_stop_min_delta: float = opt(0.0, min=0.0)  # what counts as an improvement
    sample_tokens: int = opt(200, min=0)  # length of the text sample in summary.json
    nan_policy: str = opt("skip", choices=("skip", "rollback", "abort"))  # on a non-finite loss/grad
    max_bad_steps: int = opt(5, min=1)  # skip/rollback give up after this many bad steps in a row
    oom_policy: str = opt("split", choices=("split", "abort"))  # split: halve the micro-batch, retry
    strategy: str = opt("ddp", choices=("ddp", "fsdp"))  # several processes: full copies or shards
    find_unused_parameters: bool = False  # ddp: let parameters go unused in a step (a graph walk each step)
    fsdp_mixed_precision: bool = False  # fsdp: weights in the autocast dtype for compute, fp32 reduce
    fsdp_cpu_offload: bool = False  # fsdp: keep sharded weights and optimizer state in host memory
    compile: bool = False  # torch.compile the model in place (state_dict keys unchanged)
    tf32: bool = True  # CUDA: TF32 tensor cores for float32 matmuls and convolutions (Ampere+)
    profile: bool = False  # profile steps 4-8 and print where the time goes (loop/profile.py)


@dataclass
class EmaConfig:
    """Exponential moving average of the weights, used for validation and exported at the end."""
    enabled: bool = False
    decay: float = opt(0.999, min=0.0, max=1.0)
    warmup: int = opt(10, min=1)  # effective decay min(decay, (1+n)/(warmup+n)) after n updates


@dataclass
class ReportConfig:
    """The end-of-run report (report.md + plots): what a device-hour costs and the grid's CO2."""
    price_per_hour: float = opt(0.0, min=0.0)  # $ per device-hour; 0 = not reported
    co2_g_per_kwh: float = opt(400.0, min=0.0)
    plots: bool = True  # PNG plots with report.md (matplotlib); the tables are written either way


@dataclass
class FaultsConfig:
    """Deliberate faults for tests and fire drills; -1 = off."""
    nan_at_step: int = opt(-1, min=-1)  # make the loss non-finite the first time this step runs
    nan_rank: int = opt(-1, min=-1)  # ... on this rank only (-1: every rank)
    oom_at_step: int = opt(-1, min=-1)  # torch.OutOfMemoryError in this step's first micro-batch (once)
    oom_rank: int = opt(-1, min=-1)  # ... on this rank only (-1: every rank)
    oom_in: str = opt("forward", choices=("forward", "backward"))  # ... as its forward ends, or in its backward
    kill_in_ckpt_at_step: int = opt(-1, min=-1)  # SIGKILL this process midway through that step's checkpoint


@dataclass
class LabConfig:
    """Teaching switches that each break one concern on purpose (loop/lab.py); off by default."""
    break_: str = opt("", choices=("", *SWITCHES))  # written lab.break=NAME


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    lab: LabConfig = field(default_factory=LabConfig)


# ---------------------------------------------------------------------------------------- loading
def parse_args(argv: list[str] | None = None) -> tuple[str, list[str]]:
    p = argparse.ArgumentParser(description="Train with the honest loop.", epilog=keys_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, action=_Once,
                   help="YAML preset (default: %(default)s)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after --config
    return args.config, args.overrides


def keys_help() -> str:
    """Every key with its default (what applies when the config file does not set it), a line per
    section, for --help: the keys without opening loop/config.py."""
    def shown(v) -> str:  # as YAML and the command line take them: true, [0.9,0.95]
        return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, bool)) else str(v)

    lines = ["config keys, as section.key=value (the default where the config file sets none):"]
    for section, values in to_dict(Config()).items():
        keys = " ".join(f"{k}={shown(v)}" for k, v in flat(values).items())
        lines += textwrap.wrap(keys, 96, initial_indent=f"  {section}: ",
                               subsequent_indent=" " * (len(section) + 4), break_on_hyphens=False)
    return "\n".join(lines)


def flat(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted key: value}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


class _Once(argparse.Action):
    """An option given at most once: argparse keeps the last --config and drops the others unsaid."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_{self.dest}_seen", False):
            parser.error(f"argument {option_string}: given twice; expected one file (later keys "
                         f"can be given as section.key=value overrides)")
        setattr(namespace, f"_{self.dest}_seen", True)
        setattr(namespace, self.dest, values)


class _Loader(DecimalLoader):
    """yaml.safe_load that refuses a key given twice in one mapping. YAML keeps the last one
    silently, so a second `train:` section at the end of a file dropped every key of the first."""

    def construct_mapping(self, node, deep=False):
        first: dict[str, int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in first:
                    raise yaml.constructor.ConstructorError(
                        problem=f"key '{key.value}' given twice, first on line {first[key.value] + 1}; "
                                f"YAML would keep the second and drop the first without a word",
                        problem_mark=key.start_mark)
                first[key.value] = key.start_mark.line
        return super().construct_mapping(node, deep)


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """YAML file + dotted overrides -> a checked Config. Raises BadInput on any problem."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader) or {}
    except OSError as e:
        where = "" if path.is_absolute() else f", looked for in {Path.cwd()}"
        raise BadInput(f"config file {path}: cannot read it ({e.strerror}{where}); expected a YAML file.")
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding
        raise BadInput(f"config file {path}: byte {e.start} is not UTF-8 text; expected a YAML file.")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise BadInput(f"config file {path}{where}: malformed YAML ({getattr(e, 'problem', e)}).")
    cfg = from_dict(Config, raw, "", str(path))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            file = " (a config file is given as --config PATH)" if item.endswith((".yaml", ".yml")) else ""
            raise BadInput(f"override '{item}': expected the form section.key=value{file}.")
        override(cfg, key.split("."), value, key)
    check(cfg)
    check_paths(cfg)
    return cfg


# ---------------------------------------------------------------------------------------- output
def changed_keys(old: dict, new: Config) -> list[str]:
    """Dotted keys whose values differ between a saved config dict and `new`."""
    a, b = flat(old), flat(to_dict(new))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def save(cfg: Config, path: Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
