"""data.batch_size=auto: the largest micro-batch that fits, found by trying the divisors of
the per-process share of train.global_batch; the model is left as it was; a resumed run takes its
checkpoint's micro-batch (so it stays bit-exact), chosen as the run chooses it; the validation set
does not move with the micro-batch; what auto cannot do is exit 2. The try on a real
GPU: tests/test_cuda.py::test_an_auto_micro_batch_fits_the_gpu_without_running_out_of_memory."""
from __future__ import annotations

import gc
import shutil
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from conftest import ROOT, load_config, metrics, out_of_memory_in_a_cycle, run_train, summary, train_here
from loop.auto_batch import divisors, largest_that_fits
from loop.config.runtime import follow_global_batch
from loop.errors import BadInput
from loop.precision import Precision

DEFAULT = ROOT / "configs" / "default.yaml"


class FitsEight(nn.Module):
    """Runs out of memory on more than 8 samples, as its forward ends (its buffers moved already)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.norm(self.lin(batch["x"]))
        if len(out) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out.sum()


def samples(n: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(train=[{"x": torch.randn(4, generator=g), "y": torch.tensor(0)} for _ in range(n)])


def test_the_largest_micro_batch_that_fits_is_found_and_the_model_is_left_as_it_was():
    assert divisors(64) == [64, 32, 16, 8, 4, 2, 1] and divisors(12) == [12, 6, 4, 3, 2, 1]
    torch.manual_seed(0)
    model = FitsEight().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cpu = torch.device("cpu")
    # Fewer samples than a try needs: around the data set again, as the loader's epochs go.
    assert largest_that_fits(model, samples(5), divisors(64), cpu, Precision("fp32", cpu), 0) == 8
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm's running stats too
    assert all(p.grad is None for p in model.parameters())
    assert largest_that_fits(model, samples(5), [48, 24, 12], cpu, Precision("fp32", cpu), 0) is None

    class Broken(FitsEight):
        def forward(self, batch):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):  # a bug is not a size that does not fit
        largest_that_fits(Broken(), samples(5), [8], cpu, Precision("fp32", cpu), 0)


class KeepsItsError(FitsEight):
    """Runs out of memory on more than 8 samples in a reference cycle that holds its activations."""

    def __init__(self):
        super().__init__()
        self.tries = []  # the activations of each try, weakly

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.norm(self.lin(batch["x"]))
        assert all(t() is None for t in self.tries), "a failed try's activations are still held"
        self.tries.append(weakref.ref(out))
        if len(out) > 8:
            out_of_memory_in_a_cycle()
        return out.sum()


def test_each_try_starts_with_what_the_failed_ones_held_freed():
    # Else the next size runs out too, on memory the last one still holds, and auto picks small.
    cpu = torch.device("cpu")
    gc.disable()  # no collection but the fit's own
    try:
        assert largest_that_fits(KeepsItsError(), samples(5), divisors(64), cpu, Precision("fp32", cpu), 0) == 8
    finally:
        gc.enable()


def test_auto_is_a_batch_size_that_train_py_resolves_and_exit_2_where_it_cannot(tmp_path, cache):
    assert load_config(DEFAULT, ["data.batch_size=auto"]).data.batch_size == "auto"
    with pytest.raises(BadInput, match="data.batch_size: expected int or auto"):
        load_config(DEFAULT, ["data.batch_size=big"])
    with pytest.raises(BadInput, match="data.batch_size=auto"):  # the tools train at a given size
        follow_global_batch(load_config(DEFAULT, ["data.batch_size=auto", "train.global_batch=8"]), 1)
    for extra, says in ((["train.global_batch=0"], "train.global_batch"),
                        (["train.global_batch=8", "train.strategy=fsdp"], "train.strategy=fsdp"),
                        (["train.global_batch=8"], "CUDA")):  # a fresh run on the CPU: nothing to fit
        out = tmp_path / extra[-1]
        proc = train_here(out, cache, "data.batch_size=auto", *extra, check=False)
        assert proc.returncode == 2 and "data.batch_size=auto" in proc.stderr and says in proc.stderr, \
            proc.stderr
        assert not out.exists()


def test_a_resumed_run_takes_the_micro_batch_of_its_checkpoint(tmp_path, cache):
    steps = ["train.global_batch=8", "train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    train_here(whole, cache, *steps, "data.batch_size=2")
    train_here(part, cache, *steps, "data.batch_size=2", "train.max_steps=3")
    rerun = train_here(part, cache, *steps, "data.batch_size=auto")
    assert "data.batch_size=auto: 2, the micro-batch of the checkpoint it resumes" in rerun.stdout
    assert "at step 3" in rerun.stdout
    pairs = [[(r["loss"], r["grad_norm"]) for r in metrics(out)] for out in (part, whole)]
    assert pairs[0] == pairs[1]
    assert summary(part)["params_sha256"] == summary(whole)["params_sha256"]
    assert "batch_size: 2" in (part / "config.yaml").read_text()  # the number, for the next resume


def test_the_micro_batch_comes_from_the_checkpoint_the_resume_takes(tmp_path, cache):
    # The newest checkpoint does not verify: the resume skips it, and so does auto's lookup.
    steps = ["train.global_batch=8", "train.ckpt_every=3", "train.eval_every=0", "train.keep_last=5"]
    out = tmp_path / "run"
    train_here(out, cache, *steps, "data.batch_size=2", "train.max_steps=3")
    train_here(out, cache, *steps, "data.batch_size=4", "train.max_steps=6")
    with open(out / "checkpoints" / "step_00000006" / "state.pt", "r+b") as f:
        f.seek(100)
        f.write(b"tampered")
    rerun = train_here(out, cache, *steps, "data.batch_size=auto", "train.max_steps=9")
    assert "data.batch_size=auto: 2, the micro-batch of the checkpoint it resumes" in rerun.stdout
    assert "at step 3" in rerun.stdout, rerun.stdout


def test_the_validation_set_of_a_global_batch_stays_whatever_the_micro_batch(tmp_path, cache):
    # Without dropout the two runs' maths agree to rounding; evaluated on one set (eval_batches x
    # global_batch samples), so do their val_loss. On eval_batches x batch_size samples, the
    # micro-batch that auto picks on a GPU would decide the set (seen: 4.2816 vs 4.3121).
    args = ["train.global_batch=16", "train.max_steps=10", "model.dropout=0", "train.ckpt_every=0"]
    for size in (4, 2):
        train_here(tmp_path / str(size), cache, *args, f"data.batch_size={size}")
    four, two = ([r["val_loss"] for r in metrics(tmp_path / size) if "val_loss" in r] for size in ("4", "2"))
    assert len(four) == len(two) == 1 and two[0] == pytest.approx(four[0], rel=1e-5), (four, two)


def test_auto_follows_a_run_resume_path_as_the_run_does_and_names_what_is_wrong_with_it(tmp_path, cache):
    # run.resume=PATH, rerun after this run saved since: the run continues from its own newest
    # checkpoint (micro-batch 2), not from PATH (4), and auto takes that one's.
    steps = ["train.global_batch=8", "train.ckpt_every=3", "train.eval_every=0"]
    first, out = tmp_path / "first", tmp_path / "run"
    train_here(first, cache, *steps, "data.batch_size=4", "train.max_steps=3")
    start = f"run.resume={first / 'checkpoints' / 'step_00000003'}"
    train_here(out, cache, *steps, start, "data.batch_size=2", "train.max_steps=6")
    rerun = train_here(out, cache, *steps, start, "data.batch_size=auto", "train.max_steps=9")
    assert "data.batch_size=auto: 2, the micro-batch of the checkpoint it resumes" in rerun.stdout
    assert rerun.stdout.count("continuing from") == 1 and "step_00000006" in rerun.stdout, rerun.stdout
    # A run.resume that cannot be resumed is named as it would be without auto, before anything
    # is written, not taken for a fresh start on the CPU.
    for resume, says in ((f"run.resume={tmp_path / 'nowhere'}", "run.resume="),
                         ("run.resume=never", "run.resume=never")):
        before = sorted(p.name for p in out.rglob("*"))
        proc = train_here(out, cache, *steps, resume, "data.batch_size=auto", check=False)
        assert proc.returncode == 2 and says in proc.stderr and "CUDA" not in proc.stderr, proc.stderr
        assert sorted(p.name for p in out.rglob("*")) == before


def test_auto_takes_the_micro_batch_of_a_checkpoint_the_run_fetches_from_its_mirror(tmp_path, cache):
    # out_dir's checkpoints gone (a new disk, `latest` left): the run resumes the mirror's newest,
    # and auto takes its micro-batch, rather than refusing the `latest` that names nothing.
    steps = ["train.global_batch=8", "train.ckpt_every=3", "train.eval_every=0", f"run.mirror={tmp_path / 'mirror'}"]
    out = tmp_path / "run"
    train_here(out, cache, *steps, "data.batch_size=2", "train.max_steps=3")
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    rerun = train_here(out, cache, *steps, "data.batch_size=auto", "train.max_steps=6")
    assert "data.batch_size=auto: 2, the micro-batch of the checkpoint it resumes" in rerun.stdout, rerun.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_after_a_change_of_process_count_the_micro_batch_is_kept_where_it_divides(tmp_path, cache):
    # One process, then two: the per-process share of a global batch of 8 goes from 8 to 4.
    args = ["train.global_batch=8", "train.ckpt_every=3", "train.eval_every=0", "model.dropout=0"]
    kept, tried = tmp_path / "kept", tmp_path / "tried"
    run_train(kept, cache, *args, "data.batch_size=4", "train.max_steps=3")
    then = run_train(kept, cache, *args, "data.batch_size=auto", "train.max_steps=6", nproc=2)
    assert "data.batch_size=auto: 4, the micro-batch of the checkpoint it resumes" in then.stdout, then.stdout
    assert "train.grad_accum=1 (2 process(es) x data.batch_size 4 x 1)" in then.stdout
    assert "at step 3" in then.stdout and summary(kept)["steps"] == 6
    # A micro-batch of 8 does not divide a share of 4: sizes are tried anew, which needs a GPU.
    run_train(tried, cache, *args, "data.batch_size=8", "train.max_steps=3")
    proc = run_train(tried, cache, *args, "data.batch_size=auto", "train.max_steps=6", nproc=2, check=False)
    assert proc.returncode != 0 and "data.batch_size=auto: fits the micro-batch to a CUDA GPU" in proc.stderr
    assert sorted(p.name for p in (tried / "checkpoints").glob("step_*")) == ["step_00000003"]


class LoraLike(nn.Module):
    """A frozen 16-bit base, a trainable float32 head and a buffer: what the step holds beside
    each differs (AdamW and DDP keep nothing for the base; the EMA keeps it in float32)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(100, 100).half().requires_grad_(False)  # 10,100 x 2 bytes
        self.head = nn.Linear(100, 10)  # 1,010 x 4 bytes
        self.register_buffer("seen", torch.zeros(5))  # 5 x 4 bytes


def test_processes_take_the_smallest_fit_beside_what_the_step_holds(monkeypatch):
    # The fit itself needs a CUDA GPU; what auto makes of the fits is reached here with the try
    # replaced: the sizes it tries, the reserve it holds beside them, the answer over the ranks.
    from loop import auto_batch
    from loop.distributed.group import Dist

    tried = []

    def fit(model, data, sizes, device, precision, reserve):
        tried.append((sizes, reserve))
        return 8

    class RankZeroOfTwo(Dist):  # the other rank's GPU fits 4
        def gather_to_main(self, obj):
            return [obj, 4]

        def from_main(self, obj):
            return obj

    monkeypatch.setattr(auto_batch, "largest_that_fits", fit)
    monkeypatch.setattr(auto_batch, "resumed_micro_batch", lambda run, out: None)  # a fresh run
    cuda, model = torch.device("cuda"), LoraLike()
    trainable, average = 1010 * 4, (10100 + 1010 + 5) * 4
    for world, ema, ddp in ((2, False, True), (1, False, True), (1, True, False)):
        cfg = load_config(DEFAULT, ["data.batch_size=auto", "train.global_batch=32", f"ema.enabled={ema}"])
        dist = RankZeroOfTwo(world=2) if world == 2 else Dist()
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda ddp=ddp: ddp)  # torchrun's group
        size, _ = auto_batch.micro_batch(cfg, model, None, cuda, Precision("fp32", torch.device("cpu")), dist)
        assert size == (4 if world == 2 else 8)  # every process takes the smallest
        # AdamW's two moments and DDP's buckets (one process under torchrun too) of the trainable
        # head alone; the EMA's float32 copy of everything.
        assert tried[-1] == (divisors(32 // world), (2 + ddp) * trainable + ema * average), (world, ema, ddp)
