"""Config checks that need the run: one config and one data set on every process, keys whose
range is the run's ranks (all refused), and settings that cannot act in this run (said as notes).
"""
from __future__ import annotations

from loop.config.load import differing, flat, to_dict
from loop.distributed.group import Dist
from loop.errors import BadInput
from loop.precision import Precision


def idle_settings(cfg, precision: Precision) -> list[str]:
    """Settings that cannot act in this run: said, not refused (a later run may extend
    train.max_steps, or evaluate more often)."""
    t, notes = cfg.train, []
    if t.early_stop_patience and not t.eval_every:
        notes.append("train.early_stop_patience has no effect with train.eval_every=0: it counts "
                     "evaluations, and this run evaluates once, at its end")
    elif t.early_stop_patience >= (n := -(-t.max_steps // t.eval_every) if t.eval_every else 0) > 0:
        notes.append(f"train.early_stop_patience={t.early_stop_patience} cannot stop this run: it "
                     f"evaluates {n} time(s) (train.eval_every={t.eval_every} of train.max_steps="
                     f"{t.max_steps}), and stopping takes {t.early_stop_patience} after the first")
    if (w := cfg.schedule.warmup_steps) > t.max_steps > 0:
        notes.append(f"schedule.warmup_steps={w} is longer than train.max_steps={t.max_steps}: the "
                     f"learning rate never reaches optim.lr (the run ends at {t.max_steps / w:.0%} of it)")
    if t.fsdp_mixed_precision and (precision.dtype is None or t.strategy != "fsdp"):
        notes.append(f"train.fsdp_mixed_precision=true has no effect with train.strategy="
                     f"{t.strategy} and {precision.name} precision: it needs fsdp and bf16 or fp16")
    if t.compile_mode != "default" and not t.compile:
        notes.append(f"train.compile_mode={t.compile_mode} has no effect with train.compile=false")
    if t.compile_options and not t.compile:
        notes.append("train.compile_options has no effect with train.compile=false")
    d = cfg.data
    if d.num_workers == 0 and d.prefetch_factor != type(d).prefetch_factor:  # its default says nothing
        # torch's DataLoader takes prefetch_factor with workers only (loop/data/sampler.py)
        notes.append(f"data.prefetch_factor={d.prefetch_factor} has no effect with data.num_workers=0: it "
                     f"counts the batches each worker loads ahead, and without workers the training "
                     f"process loads each batch when a step asks for it (raise data.num_workers to load ahead)")
    if t.attention_kernel == "cudnn" and cfg.run.deterministic:
        notes.append("train.attention_kernel=cudnn has no effect with run.deterministic=true: cuDNN's "
                     "attention has no deterministic backward, so torch runs the next kernel in its "
                     "order (flash)")
    for key in ("nan_at_step", "oom_at_step", "kill_in_ckpt_at_step"):
        step = getattr(cfg.faults, key)
        if step == 0 or step > t.max_steps:  # steps count from 1
            notes.append(f"faults.{key}={step} will not fire: this run's steps are 1 to "
                         f"train.max_steps={t.max_steps}")
    k = cfg.faults.kill_in_ckpt_at_step
    if 0 < k < t.max_steps and not (t.ckpt_every and k % t.ckpt_every == 0):  # loop/trainer.py saves
        best = " its evaluation is a new best or" if t.eval_every and k % t.eval_every == 0 else ""
        which = (f"is neither a multiple of train.ckpt_every={t.ckpt_every} nor the last step"
                 if t.ckpt_every else "is not the last step (train.ckpt_every=0: at the end only)")
        notes.append(f"faults.kill_in_ckpt_at_step={k} may not fire: step {k} {which}, so it writes "
                     f"a checkpoint only if{best} the run stops there (early stopping, a preemption "
                     f"signal)")
    return notes


def step_over_the_data(cfg, world: int, n_train: int) -> str | None:
    """A step of more samples than the training split holds some of them more than once: said, not
    refused (an overfitting check on a handful of samples may want it)."""
    step = world * cfg.data.batch_size * cfg.train.grad_accum
    if step > n_train:
        return (f"a step takes {step} samples ({world} process(es) x data.batch_size {cfg.data.batch_size} "
                f"x train.grad_accum {cfg.train.grad_accum}), more than the {n_train} of the training split: "
                f"each step holds some samples more than once")
    return None


def check_same_config(cfg, dist: Dist) -> None:
    """One config on every process: each node reads its own files, overrides and .env, and a
    train.max_steps apart would hang the run at its end, an optim.lr apart would train replicas
    that part without a word."""
    check_same("config", flat(to_dict(cfg)), dist,
               "the same config on every process (the same config file, overrides and .env on every node)")


def check_same_data(data, dist: Dist) -> None:
    """One data set on every process: each node reads its own files, and a corpus apart gives the
    ranks another sample order (DDP trains on without a word) or other validation batch counts
    (FSDP hangs in evaluation). Sizes and the plain values of the data set's meta (a corpus's
    sha256) are compared, as repr (a NaN equals itself); contents are not read again. A builder
    may put anything in meta: an object's text holds its address, a set's its process's order."""
    if dist.world == 1:
        return
    meta = {f"meta.{k}": repr(v) for k, v in data.meta.items() if v is None or isinstance(v, (str, int, float, bool))}
    facts = {"len(train)": len(data.train), "len(val)": len(data.val), "vocab_size": data.vocab_size,
             "seq_len": data.seq_len, **meta}
    check_same("data", facts, dist, "the same data on every process (the same files under data.path "
                                    "and data.cache_dir on every node)")


def check_same(what: str, mine: dict, dist: Dist, expected: str) -> None:
    """`mine` ({key: value}) equal to rank 0's on every process. Every rank raises, so none waits
    for the others in a collective; each names the keys it holds apart."""
    if dist.world == 1:
        return
    main = dist.from_main(mine)
    differ = differing(main, mine)
    if n := int(dist.sum_host([float(bool(differ))])[0]):
        def say(d: dict) -> str:
            return ", ".join(f"{k}={str(d.get(k))[:80]}" for k in differ)  # a meta value may be long
        here = (f"rank {dist.rank} has {say(mine)} where rank 0 has {say(main)}" if differ else
                f"{n} process(es) have another one than rank 0 (their messages name the keys)")
        raise BadInput(f"the {what} differs between processes: {here}; expected {expected}.")


def refuse_auto(cfg) -> None:
    """data.batch_size=auto is train.py's to resolve (loop/auto_batch.py); the tools train at given sizes."""
    if cfg.data.batch_size == "auto":
        raise BadInput("config key data.batch_size=auto: train.py fits it to the GPU, and this tool "
                       "trains at a given micro-batch; expected a number for data.batch_size.")


def follow_global_batch(cfg, world: int) -> str | None:
    """train.global_batch: set train.grad_accum from it, so a step trains on the same samples
    whatever data.batch_size and the process count are: the loss is the sum over all of them,
    divided by their count, in one micro-batch or many. What it set, for the console; None unset."""
    refuse_auto(cfg)
    g, b = cfg.train.global_batch, cfg.data.batch_size
    if not g:
        return None
    if g % (b * world):
        fit = (f"a data.batch_size that divides {g // world}" if g % world == 0 else
               f"a train.global_batch that is a multiple of {world}")
        raise BadInput(f"config key train.global_batch={g}: expected a multiple of data.batch_size={b} "
                       f"x {world} process(es) = {b * world}; use {fit}, or train.global_batch=0 for "
                       f"train.grad_accum as given.")
    cfg.train.grad_accum = g // (b * world)
    return (f"train.global_batch={g}: train.grad_accum={cfg.train.grad_accum} ({world} process(es) x "
            f"data.batch_size {b} x {cfg.train.grad_accum})")


def check_with_world(cfg, dist: Dist) -> None:
    """Keys whose range is the run's ranks. A fault aimed at a rank the run does not have never
    fires, and a fire drill that passes because nothing happened proves nothing."""
    for key in ("nan_rank", "oom_rank"):
        rank = getattr(cfg.faults, key)
        if rank >= dist.world:
            raise BadInput(f"config key faults.{key}: rank {rank}, but this run has {dist.world} "
                           f"process(es); expected -1 (every rank) or a rank below {dist.world}.")
