"""The config's sections: every key, its default, and its bounds or choices (checked at load time by
loop/config/fields.py). These defaults are the embedded default run's: `python train.py` uses
them, and `--help` lists them. The `data` and `model` sections are the loop's keys here
(DataSection, ModelSection) plus those of the chosen data set's or model's builder: its options,
a dataclass that extends the section (loop/config/builders.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loop.config.fields import INT64, opt
from loop.lab import SWITCHES


@dataclass
class DataSection:
    """The loop's keys of `data`; data.name's builder reads the rest (data/__init__.py)."""
    name: str = ""  # which data set: a name in the project's DATASETS
    # Per micro-step, per process; auto: the largest that fits the GPU (loop/auto_batch.py)
    batch_size: int = opt(16, min=1, max=INT64, auto=True)
    num_workers: int = opt(0, min=0)
    prefetch_factor: int = opt(2, min=1)
    pin_memory: bool = True  # only takes effect on CUDA
    log_ids: bool = False  # write each step's sample ids into metrics.jsonl (make verify's data audit)


@dataclass
class ModelSection:
    """The loop's keys of `model`; model.name's builder reads the rest (model/__init__.py)."""
    name: str = ""  # which model: a name in the project's MODELS
    # Recompute activations in backward (less memory, one more forward of compute), through the
    # model's own switch: a `set_activation_checkpointing(on)` method.
    activation_checkpointing: bool = False


@dataclass
class RunConfig:
    out_dir: str = opt("runs/default", path=True)
    seed: int = opt(1337, min=0, max=2**32 - 1)  # NumPy's global generator takes 32 bits
    resume: str = opt("auto", path=True)  # auto | never | path to a checkpoint directory
    init_from: str = opt("", path=True)  # a checkpoint dir or a model.pt: its weights only (a fresh run)
    mirror: str = opt("", path=True)  # also copy each checkpoint here: a directory or an fsspec URL
    deterministic: bool = False  # deterministic kernels only (see loop/determinism.py)


@dataclass
class OptimConfig:
    lr: float = opt(2e-3, min=0.0)
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
    grad_accum: int = opt(2, min=1, max=INT64)
    # Samples per optimizer step over every process; set, train.grad_accum follows from it (the
    # same step whatever the micro-batch and process count). 0: batch_size x grad_accum x processes
    global_batch: int = opt(0, min=0, max=INT64)
    clip_grad: float = opt(1.0, min=0.0)  # 0 = no clipping (the norm is still logged)
    precision: str = opt("auto", choices=("auto", "bf16", "fp16", "fp32"))
    device: str = "auto"  # auto (cuda > mps > cpu) or a torch device string
    log_every: int = opt(10, min=1)
    eval_every: int = opt(50, min=0)  # and at the last step; 0 = only there
    eval_batches: int = opt(10, min=1, max=INT64)  # validation: this many x batch_size x processes (or x global_batch)
    ckpt_every: int = opt(100, min=0)  # 0 = only at the end
    keep_last: int = opt(3, min=1)  # newest checkpoints kept, plus the best one
    async_save: bool = False  # copy state to CPU memory, write the checkpoint in a background thread
    best_metric: str = "val_loss"  # the validation metric that picks the best checkpoint
    best_mode: str = opt("min", choices=("min", "max"))
    early_stop_patience: int = opt(0, min=0)  # stop after this many evals without improvement; 0 = off
    early_stop_min_delta: float = opt(0.0, min=0.0)  # what counts as an improvement
    sample_tokens: int = opt(200, min=0)  # length of the text sample in summary.json
    nan_policy: str = opt("skip", choices=("skip", "rollback", "abort"))  # on a non-finite loss/grad
    max_bad_steps: int = opt(5, min=1)  # skip/rollback give up at more bad steps than this in a row
    oom_policy: str = opt("split", choices=("split", "abort"))  # split: halve the micro-batch, retry
    strategy: str = opt("ddp", choices=("ddp", "fsdp"))  # several processes: full copies or shards
    find_unused_parameters: bool = False  # ddp: let parameters go unused in a step (a graph walk each step)
    fsdp_mixed_precision: bool = False  # fsdp: weights in the autocast dtype for compute, fp32 reduce
    fsdp_cpu_offload: bool = False  # fsdp: keep sharded weights and optimizer state in host memory
    compile: bool = False  # torch.compile the model in place (state_dict keys unchanged)
    # torch.compile's mode: max-autotune tries more kernels at compile time; reduce-overhead and
    # max-autotune replay CUDA graphs (docs/performance.md)
    compile_mode: str = opt("default", choices=("default", "reduce-overhead", "max-autotune",
                                                "max-autotune-no-cudagraphs"))
    # inductor's own options over the mode's (torch._inductor.config names: coordinate_descent_tuning,
    # max_autotune_gemm, triton.cudagraphs, ...; loop/compiler.py)
    compile_options: dict[str, bool | int | float | str] = opt({})
    tf32: bool = True  # CUDA: TF32 tensor cores for float32 matmuls and convolutions (Ampere+)
    # CUDA: the attention kernel torch tries first, then its own order (loop/device.py)
    attention_kernel: str = opt("auto", choices=("auto", "cudnn", "flash", "efficient", "math"))
    profile: bool = False  # profile steps 4-8 and print where the time goes (loop/observe/profile.py)


@dataclass
class EmaConfig:
    """Exponential moving average of the weights, used for validation and exported at the end."""
    enabled: bool = False
    decay: float = opt(0.999, min=0.0, max=1.0)
    # The first update copies the weights; the decay after n updates is min(decay, (1+n)/(warmup+n)),
    # n an int64 tensor.
    warmup: int = opt(10, min=1, max=2**62)


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
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    lab: LabConfig = field(default_factory=LabConfig)
