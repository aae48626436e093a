"""The speed switches change speed and memory, not the maths: activation checkpointing gives the
same gradients bit for bit, and a compiled model's checkpoints are interchangeable with an
uncompiled one's (torch.compile in place keeps the state_dict keys). The kernel choices reach
torch: the attention kernel asked for comes first in its order (but where determinism mode turns
it off), torch.compile gets the mode asked for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, build_trainer, load_config, metrics, run_train, summary, train_cmd, train_here
from loop.config.runtime import idle_settings
from loop.device import use_attention_kernel
from loop.distributed.group import Dist
from loop.precision import Precision
from model.gpt import GPT


def grads(activation_checkpointing: bool) -> tuple[list[torch.Tensor], int]:
    """Gradients of one batch, and how many times block 0 ran forward."""
    torch.manual_seed(0)
    model = GPT(16, 8, 2, 2, 32, 0.1, True)
    model.set_activation_checkpointing(activation_checkpointing)
    calls = []
    # A pre-hook: the recomputation stops early, once it has what backward needs, so a forward
    # hook (run when forward returns) would not see it.
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks: drawn in forward, replayed by the recomputation
    model({"x": x[:, :-1], "y": x[:, 1:]}).backward()
    return [p.grad for p in model.parameters()], len(calls)


def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit():
    (plain, n_plain), (ckpt, n_ckpt) = grads(False), grads(True)
    assert (n_plain, n_ckpt) == (1, 2)  # it really recomputed the block in backward
    assert len(plain) == len(ckpt) and all(torch.equal(a, b) for a, b in zip(plain, ckpt))


@pytest.mark.slow
def test_compiled_and_plain_runs_share_checkpoints(tmp_path, cache):
    steps = ["train.max_steps=6", "train.ckpt_every=3", "model.dropout=0", "train.eval_every=0"]
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    run_train(plain, cache, *steps)
    # Compiled to step 3, then resumed without compile from the compiled run's checkpoint.
    compiled = run_train(mixed, cache, *steps[1:], "train.max_steps=3", "train.compile=true")
    assert "model compiled in place" in compiled.stdout
    state = torch.load(mixed / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)
    assert list(state["model"]) == list(torch.load(plain / "model.pt", weights_only=True)["model"])
    rerun = run_train(mixed, cache, *steps)
    assert "at step 3" in rerun.stdout, rerun.stdout
    # Inductor fuses the float32 arithmetic differently from eager mode: equal to rounding only.
    for x, y in zip(metrics(plain), metrics(mixed)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
    assert summary(mixed)["val_loss"] == pytest.approx(summary(plain)["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_compile_that_cannot_build_the_model_is_bad_input(tmp_path, cache):
    # No C++ compiler for inductor on the CPU (no C compiler for Triton on CUDA, as in CUDA runtime
    # images): exit 2 at the first forward, before anything is written, naming what is missing and
    # the way out, not a traceback of torch internals with exit 1.
    out = tmp_path / "run"
    proc = subprocess.run(train_cmd(out, cache, "train.compile=true", "train.max_steps=2"), cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CXX": str(tmp_path / "no-such-g++")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert ("error: config key train.compile=true: torch.compile could not build this model "
            "(InvalidCxxCompiler: No working C++ compiler found") in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().endswith("or set train.compile=false.") and not out.exists()


@pytest.mark.slow
def test_a_bug_in_the_model_under_compile_is_its_own_error(tmp_path, cache):
    # A forward that is wrong whatever compiles it (a LayerNorm handed one feature too many) fails
    # in Dynamo's tracing. It is the crash it is in eager mode: exit 1, its own message, not
    # "torch.compile could not build this model ... install a C++ compiler" with exit 2.
    out = tmp_path / "run"
    cmd = train_cmd(out, cache, "model.name=gpt_wrong", "train.compile=true", "train.max_steps=2")
    cmd[1] = str(ROOT / "tests" / "more_models.py")  # train.py with the test models registered
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "could not build" not in proc.stderr, proc.stderr
    assert "normalized_shape=[32]" in proc.stderr and "[4, 32, 33]" in proc.stderr, proc.stderr[-3000:]


def test_what_needs_no_fsdp_does_not_import_it():
    # FSDP, DCP and DTensor cost 0.8 s of CPU to import, so loop/distributed/fsdp.py imports them
    # where used, not at the top, where a config error, `--help` and tools.sample would answer that
    # much later. (A training run imports them anyway: the optimizer's first param group imports
    # torch._dynamo, which imports FSDP.)
    heavy = ("torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor")
    code = f"import sys, train, tools.sample, tools.verify; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_attention_kernel_asked_for_is_tried_first_and_determinism_mode_falls_back(tmp_path, cache):
    # metadata.json lists the kernels torch may pick, in the order it tries them. cuDNN's comes
    # last in torch's own order; asked for, first. Determinism mode turns it off (no deterministic
    # backward): the run says so and flash runs. CPU runs: the order is the process's all the same.
    def kernels(out, *keys):
        proc = train_here(tmp_path / out, cache, "train.max_steps=1", *keys)
        return json.loads((tmp_path / out / "metadata.json").read_text())["determinism"]["sdpa_kernels"], proc

    try:
        assert kernels("cudnn", "train.attention_kernel=cudnn")[0] == ["cudnn", "flash", "efficient", "math"]
        assert kernels("auto")[0] == ["flash", "efficient", "math", "cudnn"]  # torch's own again
        det, proc = kernels("det", "train.attention_kernel=cudnn", "run.deterministic=true")
        assert det == ["flash", "efficient", "math"]
        assert "note: train.attention_kernel=cudnn has no effect with run.deterministic=true" in proc.stdout
    finally:  # the order is the process's: the next test in this one gets torch's
        use_attention_kernel("auto")


def test_torch_compile_gets_the_mode_asked_for(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: modes.append(kw["mode"]))
    cfg = load_config(ROOT / "configs" / "default.yaml", ["train.compile=true", "train.compile_mode=max-autotune",
                                                          "train.device=cpu", "model.n_layer=1"])
    build_trainer(cfg, Dist(), torch.device("cpu"))
    assert modes == ["max-autotune"]
    idle = load_config(ROOT / "configs" / "default.yaml", ["train.compile_mode=reduce-overhead"])
    assert idle_settings(idle, Precision("fp32", torch.device("cpu"))) == [
        "train.compile_mode=reduce-overhead has no effect with train.compile=false"]
