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
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, build_trainer, load_config, metrics, run_train, summary, token_data, train_cmd, train_here
from loop.config.runtime import idle_settings
from loop.data.bundle import IGNORE_INDEX
from loop.device import use_attention_kernel, use_tf32
from loop.distributed.group import Dist
from loop.errors import BadInput
from loop.precision import Precision
from model.gpt import GPT, GPTOptions, build_gpt


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
    # last in torch's order as a process starts (a CUDA run lets torch settle it first:
    # tests/test_cuda.py); asked for, first. Determinism mode turns it off (no deterministic
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
        use_attention_kernel("auto", torch.device("cpu"))


def test_the_cudnn_attention_note_is_said_only_in_determinism_mode():
    # Without run.deterministic cuDNN's kernel is tried first (the test above): no note says otherwise.
    fp32 = Precision("fp32", torch.device("cpu"))
    assert idle_settings(load_config(ROOT / "configs" / "default.yaml", ["train.attention_kernel=cudnn"]), fp32) == []
    det = load_config(ROOT / "configs" / "default.yaml", ["train.attention_kernel=cudnn", "run.deterministic=true"])
    assert [n.split(":")[0] for n in idle_settings(det, fp32)] == [
        "train.attention_kernel=cudnn has no effect with run.deterministic=true"]


def test_tf32_leaves_the_global_matmul_precision_readable():
    """Inductor's autotuning (compile_mode max-autotune...) reads torch's global precision, which
    raises where it disagrees with the CUDA one, and the compile with it. The flags
    are process state, set the same with no GPU; the CPU's own matmul precision stays as it was."""
    cuda, flags = torch.device("cuda"), torch.backends.cuda.matmul
    before = torch.get_float32_matmul_precision(), flags.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    try:
        use_tf32(cuda, True)
        assert (torch.get_float32_matmul_precision(), flags.fp32_precision) == ("high", "tf32")
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu
        use_tf32(cuda, False)
        assert (torch.get_float32_matmul_precision(), flags.fp32_precision) == ("highest", "ieee")
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu
        # TF32 is CUDA's: on another device the process's precisions (a notebook's own) stay.
        state = torch.get_float32_matmul_precision(), flags.fp32_precision, torch.backends.cudnn.conv.fp32_precision
        for other in ("cpu", "mps"):
            use_tf32(torch.device(other), True)
            assert (torch.get_float32_matmul_precision(), flags.fp32_precision,
                    torch.backends.cudnn.conv.fp32_precision) == state, other
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.mkldnn.matmul.fp32_precision = cpu
        flags.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before[1], before[2]


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


def test_compile_options_reach_torch_compile_over_the_mode_s_and_are_checked_by_name_and_type(monkeypatch, tmp_path):
    # train.compile_options: inductor's own options over the mode's (torch takes a mode or options,
    # not both), from dotted overrides (a name may hold a dot) or a YAML mapping, kept in config.yaml;
    # a name inductor lacks, or a value of another type than its default's, is exit 2 naming the key,
    # before anything is built.
    from loop.compiler import check_options, compile_kwargs
    from loop.config.load import save

    default = ROOT / "configs" / "default.yaml"
    given = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: given.append(kw))
    cfg = load_config(default, ["train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs",
                                "train.compile_options.coordinate_descent_tuning=false",
                                "train.compile_options.triton.cudagraphs=false", "train.device=cpu", "model.n_layer=1"])
    build_trainer(cfg, Dist(), torch.device("cpu"))
    assert given == [{"options": {"max_autotune": True, "coordinate_descent_tuning": False, "triton.cudagraphs": False}}]
    from bench.loop_vs_bare import Bare  # the bare loop compiles with the same settings

    Bare(cfg, 2)
    assert given[1] == given[0]
    with pytest.raises(BadInput, match=r"train\.compile_options\.no_such_option\b"):  # a run checks first
        build_trainer(load_config(default, ["train.compile=true", "train.compile_options.no_such_option=true",
                                            "train.device=cpu", "model.n_layer=1"]), Dist(), torch.device("cpu"))
    assert len(given) == 2
    torch.compile(torch.nn.Linear(2, 2), **compile_kwargs(cfg.train))  # torch takes them: it checks names here
    mapping = tmp_path / "c.yaml"
    mapping.write_text("data: {name: random}\nmodel: {name: gpt}\n"
                       "train:\n  compile_options: {epilogue_fusion: false, coordinate_descent_search_radius: 2}\n")
    options = {"epilogue_fusion": False, "coordinate_descent_search_radius": 2}
    assert load_config(mapping, []).train.compile_options == options
    save(load_config(mapping, []), tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", []).train.compile_options == options
    for bad in ("no_such_option=true", "coordinate_descent_tuning=3", "coordinate_descent_search_radius=yes"):
        with pytest.raises(BadInput, match=rf"config key train\.compile_options\.{bad.split('=')[0]}\b"):
            check_options(load_config(default, [f"train.compile_options.{bad}"]).train)
    with pytest.raises(BadInput, match=r"train\.compile_options\.epilogue_fusion: expected a bool, int"):
        load_config(default, ["train.compile_options.epilogue_fusion=[1]"])
    with pytest.raises(BadInput, match=r"train\.compile_options: expected a mapping"):
        load_config(default, ["train.compile_options=3"])
    assert load_config(default, ["train.compile_options.epilogue_fusion=false",
                                 "train.compile_options={}"]).train.compile_options == {}
    from data import DATASETS
    from loop.config.load import keys_help
    from model import MODELS

    assert "compile_options={}" in keys_help(DATASETS, MODELS)  # python train.py --help lists it
    idle = load_config(default, ["train.compile_options.epilogue_fusion=false"])
    assert idle_settings(idle, Precision("fp32", torch.device("cpu"))) == [
        "train.compile_options has no effect with train.compile=false"]


def test_compile_options_are_checked_by_the_type_torch_declares_for_them():
    # torch.compile checks a value by isinstance of the option's declared type where that is a plain
    # class: an int for a float option would be a RuntimeError traceback (exit 1) as the model
    # compiles, so it reaches torch as a float (config.yaml keeps what was given). Where torch checks
    # nothing (int | None, a Literal, a Callable), a wrong value would fail mid-compile or not at
    # all: exit 2 naming the key, before anything is built.
    from loop.compiler import check_options, compile_kwargs

    default = ROOT / "configs" / "default.yaml"
    cfg = load_config(default, ["train.compile_options.cpu_gpu_bw=40", "train.compile_options.cpp.simdlen=8",
                                "train.compile_options.triton.multi_kernel=1"])
    check_options(cfg.train)
    kwargs = compile_kwargs(cfg.train)
    assert kwargs == {"options": {"cpu_gpu_bw": 40.0, "cpp.simdlen": 8, "triton.multi_kernel": 1}}
    assert type(kwargs["options"]["cpu_gpu_bw"]) is float and type(cfg.train.compile_options["cpu_gpu_bw"]) is int
    torch.compile(torch.nn.Linear(2, 2), **kwargs)  # torch takes them
    for bad in ("cpp.simdlen=abc", "cpp.simdlen=true", "triton.multi_kernel=7", "pre_grad_custom_pass=true",
                "cpu_gpu_bw=true"):
        with pytest.raises(BadInput, match=rf"config key train\.compile_options\.{bad.split('=')[0]}: expected"):
            check_options(load_config(default, [f"train.compile_options.{bad}"]).train)


def test_cuda_graph_modes_need_the_whole_step_in_one_micro_batch(monkeypatch):
    # reduce-overhead and max-autotune replay CUDA graphs, whose compiled backward hands its output
    # buffer to .grad, and the next micro-batch's replay writes over it. On CUDA such a mode with
    # accumulation is exit 2 naming the key and the step in one micro-batch; off CUDA, without
    # compiling, in a mode without graphs, or with one micro-batch, nothing is refused.
    import torch._inductor.config  # noqa: F401

    import loop.build  # noqa: F401  (loop.trainer keeps the cuda_graphs it imports: the real one, not the patch below)
    from loop import compiler
    from loop.config import runtime

    def cfg(*more):
        return load_config(ROOT / "configs" / "default.yaml", ["train.compile=true", "data.batch_size=4", *more])
    cuda = torch.device("cuda")
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(BadInput, match=rf"train\.compile_mode={mode}\b.*train\.grad_accum=2.*"
                                           rf"data\.batch_size=8 train\.grad_accum=1\)"):
            compiler.check_cuda_graphs(cfg(f"train.compile_mode={mode}", "train.grad_accum=2"), cuda)
    for ok in (cfg("train.compile_mode=reduce-overhead", "train.grad_accum=1"),
               cfg("train.compile_mode=max-autotune-no-cudagraphs", "train.grad_accum=2"),
               cfg("train.compile_mode=reduce-overhead", "train.grad_accum=2", "train.compile=false")):
        compiler.check_cuda_graphs(ok, cuda)
    compiler.check_cuda_graphs(cfg("train.compile_mode=reduce-overhead", "train.grad_accum=2"), torch.device("cpu"))
    # TORCHINDUCTOR_CUDAGRAPHS=1 (inductor's own switch) turns them on in any mode.
    with torch._inductor.config.patch({"triton.cudagraphs": True}), \
            pytest.raises(BadInput, match=r"TORCHINDUCTOR_CUDAGRAPHS .*train\.grad_accum=2"):
        compiler.check_cuda_graphs(cfg("train.compile_mode=max-autotune-no-cudagraphs", "train.grad_accum=2"), cuda)
    # So does inductor's option in train.compile_options, which also turns a mode's off.
    with pytest.raises(BadInput, match=r"train\.compile_options\.triton\.cudagraphs=true replays"):
        compiler.check_cuda_graphs(cfg("train.compile_options.triton.cudagraphs=true", "train.grad_accum=2"), cuda)
    compiler.check_cuda_graphs(cfg("train.compile_mode=reduce-overhead", "train.compile_options.triton.cudagraphs=false",
                                   "train.grad_accum=2"), cuda)
    # With train.global_batch the accumulation follows data.batch_size: the step in one is that size alone.
    whole = cfg("train.compile_mode=reduce-overhead", "train.global_batch=16")
    runtime.follow_global_batch(whole, 1)
    with pytest.raises(BadInput, match=r"\(data\.batch_size=16\)"):
        compiler.check_cuda_graphs(whole, cuda)
    # data.batch_size=auto's pick is the largest that fits: not the whole step, a smaller step then.
    with pytest.raises(BadInput, match=r"data\.batch_size=auto found 4 fits, not 16: a smaller train\.global_batch"):
        compiler.check_cuda_graphs(whole, cuda, auto=True)
    # A run checks before it compiles (the CPU taken for CUDA here).
    monkeypatch.setattr(compiler, "cuda_graphs", lambda cfg, device: f"train.compile_mode={cfg.train.compile_mode}")
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(kw))
    with pytest.raises(BadInput, match=r"train\.compile_mode=reduce-overhead\b"):
        build_trainer(cfg("train.compile_mode=reduce-overhead", "train.grad_accum=2", "train.device=cpu",
                          "model.n_layer=1"), Dist(), torch.device("cpu"))
    assert compiled == []


class Biggest(TorchDispatchMode):
    """The most elements of any tensor an op hands back (the tensors autograd and Python see)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = (t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        self.most = max([self.most, *sizes])
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_chunked_loss_is_the_summed_cross_entropy_without_the_whole_logits(precision):
    B, T, V = 4, 32, 512
    torch.manual_seed(0)
    ref = GPT(V, T, 2, 2, 32, 0.0, False)
    chunked = GPT(V, T, 2, 2, 32, 0.0, False, loss_chunks=4)
    chunked.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randint(0, V, (B, T), generator=g), "y": torch.randint(0, V, (B, T), generator=g)}
    batch["y"][0, :20] = IGNORE_INDEX  # ignored targets count in neither
    losses, grads = [], []
    for model in (ref, chunked):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"), Biggest() as seen:
            loss = model(batch)
            loss.backward()
        losses.append(loss)
        grads.append([p.grad for p in model.parameters()])
        if model is chunked:  # no op made a (tokens x vocabulary) tensor, where the full head does
            assert seen.most <= B * T * V // 4, seen.most
        else:
            assert seen.most == B * T * V
    assert losses[1].dtype == torch.float32 and losses[1].shape == ()
    if precision == "fp32":  # the same sum; only the order of the additions differs
        assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
        for a, b in zip(*grads):  # the tied embedding's gradient sums in another order too
            assert (b - a).norm() <= 1e-5 * a.norm()
    else:  # the head in float32 where the full logits are bf16: closer to float32 than bf16's step
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            h = chunked.hidden(batch["x"]).flatten(0, 1).float()
        with torch.no_grad():
            exact = F.cross_entropy(h @ chunked.lm_head.weight.T, batch["y"].flatten(), reduction="sum")
        assert losses[1].item() == pytest.approx(exact.item(), rel=1e-6)
        assert losses[0].item() == pytest.approx(exact.item(), rel=1e-2)


def test_a_run_with_the_chunked_loss_resumes_bit_for_bit(tmp_path, cache):
    steps = ["train.max_steps=6", "train.ckpt_every=3", "train.eval_every=0", "model.loss_chunks=3"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    train_here(whole, cache, *steps)
    train_here(part, cache, *steps, "train.max_steps=3")
    assert "at step 3" in train_here(part, cache, *steps).stdout
    assert [r["loss"] for r in metrics(part)] == [r["loss"] for r in metrics(whole)]
    assert summary(part)["params_sha256"] == summary(whole)["params_sha256"]
    plain = tmp_path / "plain"  # the full logits train the same model, to the order of the sums
    train_here(plain, cache, *steps[:-1])
    for x, y in zip(metrics(plain), metrics(whole), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]


def test_the_chunked_loss_needs_a_torch_that_has_it(monkeypatch):
    monkeypatch.delattr(F, "linear_cross_entropy")
    with pytest.raises(BadInput) as e:
        build_gpt(GPTOptions(name="gpt", n_layer=1, n_head=1, n_embd=8, loss_chunks=2),
                  token_data(16, 8))
    assert str(e.value).startswith("config key model.loss_chunks=2") and torch.__version__ in str(e.value)


def test_flex_attentions_block_mask_is_causal_attention():
    # model.attention=flex attends through FlexAttention with model/gpt.py's block mask; on the CPU
    # (forward only, torch's unfused reference) it is SDPA's causal attention, also for a length
    # that is not a whole number of the mask's 128-token blocks.
    from torch.nn.attention.flex_attention import flex_attention

    from model.gpt import _causal_mask

    g = torch.Generator().manual_seed(0)
    for T in (128, 200):
        q, k, v = (torch.randn(2, 3, T, 16, generator=g) for _ in range(3))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": the reference is the point
            flex = flex_attention(q, k, v, block_mask=_causal_mask(T, torch.device("cpu")))
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert (flex - sdpa).abs().max() <= 1e-6, T
    with torch.inference_mode():  # a mask first built in evaluation's inference mode
        mask = _causal_mask(96, torch.device("cpu"))
    assert not mask.kv_num_blocks.is_inference()


def test_flex_attention_trains_on_cuda_only_and_evaluates_anywhere(tmp_path, cache):
    # No FlexAttention backward on the CPU: a training run stops at its first step with exit 2
    # (nothing trained, no checkpoint); no attention dropout either, refused before the run dir is
    # made. A trained model's evaluation and sampling on the CPU take SDPA: the same numbers.
    r = train_here(tmp_path / "cpu", cache, "model.attention=flex", "model.dropout=0", check=False)
    assert r.returncode == 2 and "model.attention=flex" in r.stderr and "CUDA" in r.stderr, r.stderr
    assert not (tmp_path / "cpu" / "checkpoints").exists()
    r = train_here(tmp_path / "dropout", cache, "model.attention=flex", "model.dropout=0.1", check=False)
    assert r.returncode == 2 and "model.dropout" in r.stderr, r.stderr
    assert not (tmp_path / "dropout").exists()
    torch.manual_seed(0)
    sdpa, flex = GPT(64, 32, 2, 2, 16, 0.0, False), GPT(64, 32, 2, 2, 16, 0.0, False, flex=True)
    flex.load_state_dict(sdpa.state_dict())
    batch = {"x": torch.randint(0, 64, (3, 32)), "y": torch.randint(0, 64, (3, 32))}
    with torch.inference_mode():
        assert torch.equal(flex.eval()(batch), sdpa.eval()(batch))
        g = [torch.Generator().manual_seed(1) for _ in range(2)]
        assert torch.equal(flex.generate(batch["x"][:1], 8, g[0]), sdpa.generate(batch["x"][:1], 8, g[1]))
