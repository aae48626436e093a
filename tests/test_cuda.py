"""The CUDA paths on a real GPU; every test here is skipped without one (CI has none).

    make test ARGS=tests/test_cuda.py PYTHON=python3      # on a GPU machine; scripts/gpu_checks.sh

bf16 and fp16 (GradScaler) with fused AdamW train, repeat and resume bit-identically in
determinism mode (so does configs/gpt2_124m.yaml, scaled down, with its own speed settings), whose
fused attention kernels repeat their backward bit for bit; the attention
kernel asked for runs (cuDNN's, or flash's where determinism mode turns cuDNN's off); a micro-batch
too big for the card runs out of memory for real and is recovered by splitting it, and
data.batch_size=auto finds one that fits; the chunked loss resumes bit-identically; FlexAttention
(model.attention=flex) gives SDPA's gradients and resumes bit-identically in bf16; steady-state
steps make exactly one host sync each (the finite check), compiled with CUDA graphs too, proved
with torch.cuda.set_sync_debug_mode; CUDA graphs (train.compile_mode=reduce-overhead) train a step
in one micro-batch and resume bit-identically, and refuse gradient accumulation; torchrun with one
process trains over nccl (with EMA and async checkpoints), bit-identical to plain python, also
after a SIGKILL and rerun; FSDP with CPU offload
and mixed precision trains close to FSDP on the GPU and resumes bit-identically; NVML reads the
GPU the run trains on.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from conftest import DIST, ROOT, TINY, build_trainer, load_config, metrics, run_and_signal, run_train, summary
from loop.device import use_tf32
from tools import jobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = ["train.device=cuda", "run.deterministic=true"]  # after TINY's train.device=cpu: wins


def resumes_as(a: Path, killed: Path, *args: str) -> None:
    """A run of `args` SIGKILLed at step 12 and rerun (from step 10's checkpoint) ends with run
    `a`'s losses and weights, bit for bit."""
    code, printed = run_and_signal(killed, 12, *args)
    assert code == -signal.SIGKILL, printed
    rerun = run_train(killed, *args)
    assert "at step 10" in rerun.stdout, rerun.stdout
    assert [r["loss"] for r in metrics(killed)] == [r["loss"] for r in metrics(a)]
    assert summary(killed)["params_sha256"] == summary(a)["params_sha256"]


def test_nvml_reads_the_gpu_the_run_trains_on(tmp_path, cache):
    # loop/observe/telemetry.py names the run's GPU to NVML by its UUID (NVML's numbering ignores
    # CUDA_VISIBLE_DEVICES): the readings come under gpu0, and the energy is that GPU's alone.
    pynvml = pytest.importorskip("pynvml")
    out = tmp_path / "run"
    r = run_train(out, cache, *CUDA, "train.max_steps=10", "train.log_every=5")
    assert "GPU telemetry off" not in r.stderr, r.stderr
    last = metrics(out)[-1]
    assert {"gpu0/util_pct", "gpu0/power_w", "gpu0/energy_j"} <= last.keys() and not any(
        k.startswith("gpu1/") for k in last), last
    assert last["energy_j"] == last["gpu0/energy_j"]  # the run's one GPU, no other
    assert summary(out)["energy_j"] > 0  # read at the end: also a run shorter than the 1 s tick
    pynvml.nvmlInit()
    try:  # the UUID the run asked NVML for is the one of the GPU CUDA calls cuda:0
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(0).uuid}")
        assert pynvml.nvmlDeviceGetUUID(handle) == f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_repeats_and_resumes_bit_identically(tmp_path, cache, precision):
    args = [cache, *DIST, *CUDA, f"train.precision={precision}"]
    a, b, killed = tmp_path / "a", tmp_path / "b", tmp_path / "killed"
    run_train(a, *args)
    run_train(b, *args)
    code, printed = run_and_signal(killed, 12, *args)
    assert code == -signal.SIGKILL, printed
    rerun = run_train(killed, *args)
    assert "at step 10" in rerun.stdout, rerun.stdout
    losses = [r["loss"] for r in metrics(a)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    for out in (b, killed):
        assert [r["loss"] for r in metrics(out)] == losses, out.name
        assert summary(out)["params_sha256"] == summary(a)["params_sha256"], out.name
    assert json.loads((a / "metadata.json").read_text())["determinism"]["sdpa_kernels"][0] == "flash"
    state = torch.load(a / "checkpoints" / "step_00000020" / "state.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["fused"] is True
    assert bool(state["scaler"]) == (precision == "fp16")  # fp16: the GradScaler's scale and tracker


@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_the_fused_attention_kept_by_determinism_mode_repeats_its_backward_bit_for_bit(kernel):
    # run.deterministic=true keeps these kernels (loop/determinism.py), trusting torch to run their
    # backward deterministically under its flag: five backward passes at GPT-2 124M's attention
    # shape, the kernel forced (sdpa_kernel raises if it cannot run), must give the same bits.
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            runs = [torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                        (q, k, v), grad) for _ in range(5)]
    finally:
        torch.use_deterministic_algorithms(False)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_the_attention_kernel_asked_for_runs_and_determinism_mode_falls_back_to_flash():
    # train.attention_kernel=cudnn (loop/device.py) at GPT-2 124M's attention shape: the profiler
    # sees cuDNN's kernel; with cuDNN's attention off, as determinism mode has it, flash's.
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from loop.device import use_attention_kernel

    cuda = torch.device("cuda")
    q = torch.randn(16, 12, 1024, 64, device=cuda, dtype=torch.bfloat16)

    def ran() -> set[str]:  # the fused kernels' ops the call ran
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_")}

    # torch's own pick (cuDNN with torch 2.11 on an H200), settled at its first attention call, where
    # it replaced an order set before: train.attention_kernel=flash ran cuDNN there.
    own = ran()
    try:
        use_attention_kernel("flash", cuda)
        assert ran() == {"aten::_scaled_dot_product_flash_attention"}
        use_attention_kernel("cudnn", cuda)
        assert ran() == {"aten::_scaled_dot_product_cudnn_attention"}
        torch.backends.cuda.enable_cudnn_sdp(False)
        assert ran() == {"aten::_scaled_dot_product_flash_attention"}
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        use_attention_kernel("auto", cuda)
    assert ran() == own and len(own) == 1


def test_a_real_out_of_memory_is_recovered_by_splitting(tmp_path, cache):
    # GPT-2 124M at 1024 tokens a sample needs very roughly 0.75 GB a sample in training: a
    # micro-batch of about twice the card's memory in those units cannot fit. Not the TINY model.
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    big = 2 ** math.ceil(math.log2(2 * gib / 0.75))
    out = tmp_path / "run"
    cmd = jobs.train_cmd(["--config", str(ROOT / "configs" / "gpt2_124m.yaml"), f"run.out_dir={out}",
                          cache, "train.compile=false", "train.global_batch=0", "train.grad_accum=1",
                          f"data.batch_size={big}",
                          "train.max_steps=3", "train.log_every=1", "train.eval_every=0",
                          "train.eval_batches=1", "train.ckpt_every=0", "report.plots=false"])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr)  # the log scripts/gpu_checks.sh keeps
    assert proc.returncode == 0, proc.stderr
    assert f"step 1: out of memory; micro-batch {big} -> {big // 2}" in proc.stderr, proc.stderr
    assert json.loads((out / "metadata.json").read_text())["faults_injected"] is None  # a real one
    recs = metrics(out)
    # It stops at the first size that fits (128 on an H200, 32 on an H100): the failed tries'
    # memory is back, which a reference cycle would hold (and each smaller try would run out too).
    assert [r["step"] for r in recs] == [1, 2, 3] and big // 8 <= recs[-1]["micro_batch"] < big
    assert summary(out)["micro_batch"] == recs[-1]["micro_batch"]


def test_an_auto_micro_batch_fits_the_gpu_without_running_out_of_memory(tmp_path, cache):
    # The global batch of the test above: data.batch_size=auto tries halvings of it before the
    # run and trains at the first that fits, with no split at a step; the rest is accumulation,
    # hence the compile mode without CUDA graphs, whatever the config's (loop/compiler.py).
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    big = 2 ** math.ceil(math.log2(2 * gib / 0.75))
    out = tmp_path / "run"
    cmd = jobs.train_cmd(["--config", str(ROOT / "configs" / "gpt2_124m.yaml"), f"run.out_dir={out}",
                          cache, f"train.global_batch={big}", "data.batch_size=auto",
                          "train.compile_mode=default",
                          "train.max_steps=3", "train.log_every=1", "train.eval_every=0",
                          "train.eval_batches=1", "train.ckpt_every=0", "report.plots=false"])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr)  # the log scripts/gpu_checks.sh keeps
    assert proc.returncode == 0 and "out of memory" not in proc.stderr, proc.stderr
    fit = int(proc.stdout.split("data.batch_size=auto: ")[1].split(",")[0])
    assert fit < big and f"train.grad_accum={big // fit} " in proc.stdout, proc.stdout
    assert [r["micro_batch"] for r in metrics(out)] == [fit] * 3
    assert f"batch_size: {fit}" in (out / "config.yaml").read_text()


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"), reason="needs torch 2.13")
def test_the_chunked_loss_repeats_and_resumes_bit_identically_in_bf16(tmp_path, cache):
    args = [cache, *DIST, *CUDA, "train.precision=bf16", "model.loss_chunks=4"]
    a, killed = tmp_path / "a", tmp_path / "killed"
    run_train(a, *args)
    resumes_as(a, killed, *args)


def test_flex_attention_gives_sdpa_gradients_on_the_gpu():
    # model.attention=flex on CUDA: FlexAttention compiled with model/gpt.py's causal block mask
    # (in an uncompiled model; a compiled one in the next test) gives SDPA's loss and gradients,
    # also at a length that is not a whole number of the mask's blocks, and after a first forward
    # in inference mode built the mask. In IEEE float32: TF32 (on after any in-process run) would
    # round FlexAttention's products and not SDPA's.
    from model.gpt import GPT

    torch.manual_seed(0)
    cuda, tf32 = torch.device("cuda"), torch.backends.cuda.matmul.fp32_precision
    use_tf32(cuda, False)
    try:
        sdpa = GPT(256, 200, 2, 2, 64, 0.0, False).to(cuda)
        flex = GPT(256, 200, 2, 2, 64, 0.0, False, flex=True).to(cuda)
        flex.load_state_dict(sdpa.state_dict())
        batch = {k: torch.randint(0, 256, (4, 200), device=cuda) for k in ("x", "y")}
        with torch.inference_mode():
            assert flex.eval()(batch).item() == pytest.approx(sdpa.eval()(batch).item(), rel=1e-5)
        flex.train(), sdpa.train()
        losses = [m(batch) for m in (sdpa, flex)]
        for loss in losses:
            loss.backward()
    finally:
        use_tf32(cuda, tf32 == "tf32")
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-5)
    for (name, a), b in zip(sdpa.named_parameters(), flex.parameters()):
        assert (b.grad - a.grad).norm() <= 1e-4 * a.grad.norm(), name


def test_flex_attention_repeats_and_resumes_bit_identically_in_bf16(tmp_path, cache):
    # The cheap exactness: a compiled GPT with FlexAttention in determinism mode, SIGKILLed and
    # rerun, gives the same bits; it trains as SDPA does, to bf16's rounding.
    args = [cache, *DIST, *CUDA, "train.precision=bf16", "train.compile=true"]
    a, killed, sdpa = tmp_path / "a", tmp_path / "killed", tmp_path / "sdpa"
    run_train(a, *args, "model.attention=flex")
    resumes_as(a, killed, *args, "model.attention=flex")
    run_train(sdpa, *args)
    assert metrics(a)[-1]["loss"] == pytest.approx(metrics(sdpa)[-1]["loss"], rel=0.05)


def test_cuda_graphs_train_a_step_in_one_micro_batch_resume_bit_identically_and_refuse_more(tmp_path, cache):
    # train.compile_mode=reduce-overhead replays CUDA graphs: with the step in one micro-batch it
    # trains as the default mode does and resumes bit for bit; with two, whose gradients the
    # replays would write over, it is exit 2 before anything is written (loop/compiler.py).
    args = [cache, *DIST, *CUDA, "train.precision=bf16", "train.compile=true", "data.batch_size=8",
            "train.grad_accum=1"]
    graphs = [*args, "train.compile_mode=reduce-overhead"]
    a, killed, plain, two = tmp_path / "a", tmp_path / "killed", tmp_path / "plain", tmp_path / "two"
    run_train(a, *graphs)
    resumes_as(a, killed, *graphs)
    run_train(plain, *args)
    assert [r["loss"] for r in metrics(a)] == pytest.approx([r["loss"] for r in metrics(plain)], rel=1e-3)
    proc = run_train(two, *graphs, "data.batch_size=4", "train.grad_accum=2", check=False)
    assert proc.returncode == 2 and "train.compile_mode=reduce-overhead" in proc.stderr, proc.stderr
    assert not two.exists()


def test_the_gpt2_config_with_its_own_speed_settings_repeats_and_resumes_bit_identically(tmp_path, cache):
    # configs/gpt2_124m.yaml as it stands (bf16, compiled with its train.compile_mode and
    # train.compile_options, fused AdamW, TF32, the step in one micro-batch), the model and data
    # scaled down, in determinism mode: whatever speed settings the config takes on, a run killed
    # and rerun gives the same bits.
    config = ROOT / "configs" / "gpt2_124m.yaml"
    args = ["--config", str(config), cache, *DIST, *CUDA, "model.n_layer=2", "model.n_head=2",
            "model.n_embd=128", "data.seq_len=128", "data.batch_size=8", "train.global_batch=8",
            "data.synthetic.tokens=200000"]
    a, killed = tmp_path / "a", tmp_path / "killed"
    run_train(a, *args)
    resumes_as(a, killed, *args)
    losses = [r["loss"] for r in metrics(a)]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert {r["micro_batch"] for r in metrics(a)} == {8}
    own, ran = load_config(str(config), []).train, load_config(str(a / "config.yaml"), []).train
    for key in ("precision", "compile", "compile_mode", "compile_options", "attention_kernel"):
        assert getattr(ran, key) == getattr(own, key), key


@pytest.mark.parametrize("more", [["train.compile=false"], ["train.compile=true"],
                                  ["train.compile=true", "model.attention=flex", "model.dropout=0"],
                                  ["train.compile=true", "train.compile_mode=reduce-overhead", "train.grad_accum=1"]],
                         ids=["eager", "compiled", "compiled-flex", "cuda-graphs"])
def test_steady_state_steps_sync_with_the_host_once(tmp_path, more):
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    cfg = load_config(DEFAULT_CONFIG, [*TINY, f"run.out_dir={tmp_path / 'run'}",
                                       f"data.cache_dir={tmp_path / 'cache'}", "train.device=cuda",
                                       "train.precision=bf16", "train.max_steps=12", "train.log_every=100",
                                       "train.eval_every=0", "train.ckpt_every=0", "data.num_workers=2",
                                       "data.pin_memory=true", *more])
    trainer = build_trainer(cfg, Dist(), torch.device("cuda"))
    step, syncs = trainer.step, {}

    def watched() -> bool:  # steps 4..11: after warm-up (and compilation), before the final flush
        n = trainer.progress.step + 1
        if not 4 <= n < cfg.train.max_steps:
            return step()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ok = step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[n] = [(Path(w.filename).name, w.lineno) for w in seen
                    if "called a synchronizing" in str(w.message)]
        return ok

    trainer.step = watched
    trainer.run()
    source = (ROOT / "loop" / "trainer.py").read_text().splitlines()
    read = next(i for i, line in enumerate(source, 1) if "# one host read" in line)
    print("host syncs per steady-state step:", syncs)  # the record scripts/gpu_checks.sh keeps
    assert syncs == {n: [("trainer.py", read)] for n in range(4, 12)}, syncs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_with_one_gpu_trains_over_nccl_like_plain_python(tmp_path, cache, strategy):
    # With EMA and async checkpoints: FSDP stages its shards from the GPU to CPU memory and the
    # writer thread writes them over gloo while training goes on over nccl.
    args = [cache, *DIST, *CUDA, "train.precision=bf16", "ema.enabled=true", "train.async_save=true"]
    plain, one, killed = tmp_path / "plain", tmp_path / "torchrun", tmp_path / "killed"
    run_train(plain, *args)
    proc = run_train(one, *args, f"train.strategy={strategy}", nproc=1)
    assert f"1 process(es), {strategy} over nccl |" in proc.stdout, proc.stdout
    code, printed = run_and_signal(killed, 12, *args, f"train.strategy={strategy}", nproc=1, group=True)
    assert code == -signal.SIGKILL, printed
    run_train(killed, *args, f"train.strategy={strategy}", nproc=1)
    for out in (one, killed):
        assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(plain)], out.name
        for key in ("params_sha256", "ema_params_sha256"):
            assert summary(out)[key] == summary(plain)[key], (out.name, key)


def test_fsdp_cpu_offload_with_mixed_precision_on_one_gpu(tmp_path, cache):
    # Shards and optimizer state in host memory (the AdamW step runs on the CPU), weights cast to
    # bf16 for compute on the GPU. Passed on an H200 (bench/results/h200-2026-11-26/).
    args = [cache, *DIST, *CUDA, "train.precision=bf16", "train.strategy=fsdp",
            "train.fsdp_mixed_precision=true"]
    offload = "train.fsdp_cpu_offload=true"
    on_gpu, off, killed = tmp_path / "on_gpu", tmp_path / "offload", tmp_path / "killed"
    run_train(on_gpu, *args, nproc=1)
    run_train(off, *args, offload, nproc=1)
    code, printed = run_and_signal(killed, 12, *args, offload, nproc=1, group=True)
    assert code == -signal.SIGKILL, printed
    run_train(killed, *args, offload, nproc=1)
    assert [r["loss"] for r in metrics(killed)] == [r["loss"] for r in metrics(off)]
    assert summary(killed)["params_sha256"] == summary(off)["params_sha256"]
    # The optimizer step on the CPU is another kernel than the GPU's fused one: float32 rounding,
    # then carried through bf16 compute, hence the bf16-sized tolerance.
    for x, y in zip(metrics(on_gpu), metrics(off)):
        assert y["loss"] == pytest.approx(x["loss"], rel=5e-3), x["step"]
