"""The profiler breakdown of a step: fractions for every region that sum to 1, and a trace file."""
from __future__ import annotations

import json

import pytest

from conftest import run_train
from loop.observe.profile import REGIONS, breakdown


@pytest.mark.slow
def test_profile_breakdown_names_every_region_and_sums_to_one(tmp_path, cache):
    out = tmp_path / "run"
    # An evaluation and a checkpoint after step 5: inside the profiled steps 4-8, named, not "other".
    proc = run_train(out, cache, "train.max_steps=10", "train.profile=true", "train.eval_every=5",
                     "train.ckpt_every=5")
    parts = json.loads((out / "profile" / "breakdown.json").read_text())
    assert set(parts) == {*REGIONS, "other"}
    assert sum(parts.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(parts[r] > 0 for r in REGIONS), parts  # each region was seen in the profiled steps
    assert parts["forward"] + parts["backward"] > parts["data"], parts
    trace = json.loads((out / "profile" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert set(REGIONS) <= names
    assert "step time breakdown" in proc.stdout


def test_breakdown_is_each_region_s_share_of_the_steps_and_other_never_below_zero():
    # Regions timed a hair past their steps (their timers' ends are not the step's) would make "other"
    # negative: it stays at 0.
    from types import SimpleNamespace

    def prof(**us):
        return SimpleNamespace(key_averages=lambda: [SimpleNamespace(key=k, cpu_time_total=v) for k, v in us.items()])

    steps_us = 1000.0  # the profiled steps' wall time
    assert breakdown(prof(data=10.0, forward=400.0, backward=500.0, optimizer=40.0), steps_us) == \
        {"data": 0.01, "forward": 0.4, "backward": 0.5, "optimizer": 0.04, "eval": 0.0, "checkpoint": 0.0,
         "other": pytest.approx(0.05)}
    assert breakdown(prof(data=20.0, forward=450.0, backward=550.0, optimizer=0.0), steps_us)["other"] == 0.0


def test_a_region_s_gpu_side_twin_does_not_hide_its_host_time():
    # With CUDA activity on, a region that launches GPU work has a GPU-side annotation of the same
    # name, which torch's averages keep as a row of its own with no host time: a lookup by name that
    # kept the last row would read forward, backward and optimizer as 0.0% on a GPU.
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    def event(i, name, us, device):
        return FunctionEvent(id=i, name=name, thread=0, start_us=0, end_us=us, device_type=device,
                             is_user_annotation=True, stack=[])

    events = EventList([event(0, "data", 10, DeviceType.CPU), event(1, "forward", 400, DeviceType.CPU),
                        event(2, "backward", 500, DeviceType.CPU), event(3, "optimizer", 40, DeviceType.CPU),
                        event(4, "forward", 300, DeviceType.CUDA), event(5, "backward", 450, DeviceType.CUDA),
                        event(6, "optimizer", 30, DeviceType.CUDA)])
    events._build_tree()
    averages = events.key_averages()
    assert sorted(e.key for e in averages).count("forward") == 2  # the twins are rows of their own
    assert breakdown(SimpleNamespace(key_averages=lambda: averages), 1000.0) == \
        {"data": 0.01, "forward": 0.4, "backward": 0.5, "optimizer": 0.04, "eval": 0.0, "checkpoint": 0.0,
         "other": pytest.approx(0.05)}


@pytest.mark.slow
def test_a_run_that_ends_before_the_profiled_steps_reports_nothing(tmp_path, cache):
    # No breakdown, rather than one of "other 100.0%" (3 steps: no profiled step) or one whose
    # "other" holds the run's final evaluation and checkpoint (7 steps), as if measured.
    out = tmp_path / "run"
    proc = run_train(out, cache, "train.max_steps=7", "train.profile=true")
    note = next((line for line in proc.stdout.splitlines() if line.startswith("note: train.profile")), "")
    for fact in ("ended 7 step(s) in", "(4-8 ", "nothing to report", "train.max_steps", "run.out_dir"):
        assert fact in note, proc.stdout
    assert "step time breakdown" not in proc.stdout and not (out / "profile").exists()
    # The same command again resumes at its end, so the advice names a new run.out_dir too, not
    # only raising max_steps.
    proc = run_train(out, cache, "train.max_steps=7", "train.profile=true")
    note = next((line for line in proc.stdout.splitlines() if line.startswith("note: train.profile")), "")
    assert "ended 0 step(s) in" in note and "a new run.out_dir" in note, proc.stdout


def test_the_profiler_s_own_shutdown_is_not_step_time(tmp_path, monkeypatch):
    # The trace is read after the profiled steps, inside the profiler's last step() (60 ms of a
    # 2 s window on the default config, most of a tiny model's): counted, it would go to "other".
    import time

    from loop.observe import profile

    walls = []
    monkeypatch.setattr(profile, "breakdown", lambda prof, wall_us: walls.append(wall_us) or {"other": 1.0})
    ready = profile.StepProfiler._ready
    monkeypatch.setattr(profile.StepProfiler, "_ready", lambda self, prof: time.sleep(0.5) or ready(self, prof))
    p = profile.StepProfiler(tmp_path / "profile", warmup=1, active=2)
    for _ in range(3):
        time.sleep(0.02)  # a step
        p.step()
    assert len(walls) == 1 and 0.03e6 < walls[0] < 0.3e6, walls  # two steps of 20 ms, not the 500 ms after


def test_the_gpu_side_is_kernel_time_a_step_by_kind_and_the_busy_share(capsys):
    # Kernel names as one H200 run of configs/gpt2_124m.yaml traced them (torch 2.11, compiled).
    from loop.observe.profile import StepProfiler, gpu_time

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 400),
        kernel("cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 400, 100),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 500, 200),
        kernel("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", 700, 40),
        kernel("triton_red_fused__log_softmax__to_copy_prepare_softmax_online_15", 740, 60),
        kernel("triton_per_fused__to_copy_add_native_layer_norm_backward_view_5", 800, 50),
        kernel("triton_poi_fused__unsafe_view_gelu_gelu_backward_view_4", 850, 30),
        kernel("triton_tem_fused_mm_3", 880, 20),  # max-autotune's matmul template
        kernel("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", 1000, 80),
        kernel("Memcpy HtoD (Pageable -> Device)", 1060, 40, cat="gpu_memcpy"),  # beside the optimizer
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 2000},  # host time: not the GPU's
    ]}
    gpu = gpu_time(trace, steps=2)
    assert gpu["ms_per_step"] == pytest.approx({  # microseconds summed, / 1000 / 2 steps
        "matmul": 0.26, "attention": 0.12, "softmax, loss": 0.03, "norm": 0.025, "optimizer": 0.04,
        "activation": 0.015, "copy": 0.02})
    assert list(gpu["ms_per_step"])[:2] == ["matmul", "attention"]  # largest first
    top = gpu["top"]  # by name, largest first: each kernel's own time, not its kind's
    assert [k["name"] for k in top[:3]] == [trace["traceEvents"][i]["name"] for i in (0, 2, 1)]
    assert top[0]["ms_per_step"] == pytest.approx(0.2) and top[0]["calls_per_step"] == 0.5
    assert "aten::mm" not in {k["name"] for k in top}  # host time
    many = gpu_time({"traceEvents": [kernel(f"k{i}", 100 * i, i + 1) for i in range(12)
                                     for _ in range(2)]}, steps=1)["top"]
    assert [(k["name"], k["calls_per_step"]) for k in many] == [(f"k{i}", 2) for i in range(11, 1, -1)]
    assert gpu["span_ms_per_step"] == pytest.approx(0.55)  # 0 to 1,100 us over 2 steps
    assert gpu["busy"] == pytest.approx(1000 / 1100)  # idle 900-1,000 us; the copy overlaps the optimizer's kernel
    assert gpu_time({"traceEvents": trace["traceEvents"][-1:]}, steps=2) is None  # a CPU run's trace

    StepProfiler.print_gpu(gpu)
    out = capsys.readouterr().out
    assert "90.9% of it busy" in out and "matmul" in out and "0.26 ms" in out
    assert "0.20 ms    0.5 x  nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT" in out  # the top kernel


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


@pytest.mark.parametrize("name, kind", [
    ("sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw", "convolution"),  # not a matmul
    ("void cudnn::winograd_nonfused::winogradForwardFilter4x4<float, float>", "convolution"),
    ("void cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 8, 3, 3, 5, false, 512>", "convolution"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "attention"),  # cutlass, but attention's
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", "attention"),
    ("ampere_sgemm_128x64_nn", "matmul"),
    ("void at::native::cunn_SoftMaxForward<4, float, float, float, SoftMaxForwardEpilogue>", "softmax, loss"),
    ("void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>", "softmax, loss"),
    ("cross_entropy_fwd_kernel", "softmax, loss"),
    ("triton_for_fused__foreach_add__0", "optimizer"),
    ("void at::native::vectorized_layer_norm_kernel<float, float>", "norm"),
    ("triton_per_fused__fused_rms_norm_mul_0", "norm"),
    ("void at::native::batch_norm_collect_statistics_kernel<float, float, float>", "norm"),
    ("triton_poi_fused__unsafe_view_gelu_6", "activation"),
    ("triton_poi_fused_mul_silu_0", "activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "activation"),
    ("triton_poi_fused_add_0", "other fused (torch.compile)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other")])
def test_each_kind_of_gpu_kernel_is_told_by_its_name(name, kind):
    # The kinds say where a GPU step goes (docs/performance.md's table): a kernel of a kind read
    # as another, or as "other", puts its time in the wrong row.
    from loop.observe.profile import gpu_time

    assert gpu_time({"traceEvents": [kernel(name, 0, 10)]}, steps=1)["ms_per_step"] == {kind: 0.01}


def test_the_gpu_s_busy_share_counts_overlapping_kernels_once_and_memsets_as_copies():
    # Streams overlap: a kernel (or a copy) inside another's time adds no busy time and does not
    # end the span early. Memsets are copy-engine work, as memcpys are, not kernels.
    from loop.observe.profile import gpu_time

    trace = {"traceEvents": [
        kernel("ampere_sgemm_128x64_nn", 0, 400),
        kernel("flash_fwd_kernel", 100, 100),  # on another stream, inside the matmul
        kernel("vectorized_layer_norm_kernel", 300, 200),
        kernel("multi_tensor_apply_kernel", 600, 100),  # after 100 us idle
        kernel("Memset (Device)", 620, 30, cat="gpu_memset")]}  # last to start, inside the optimizer's
    gpu = gpu_time(trace, steps=1)
    assert gpu["span_ms_per_step"] == pytest.approx(0.7)
    assert gpu["busy"] == pytest.approx(600 / 700)
    assert gpu["ms_per_step"]["copy"] == pytest.approx(0.03) and "other" not in gpu["ms_per_step"]
    assert gpu_time({"traceEvents": trace["traceEvents"][-1:]}, steps=1) is not None  # memsets alone


def test_the_gpu_side_of_the_profiled_steps_is_written_and_printed(tmp_path, monkeypatch, capsys):
    # On a GPU the kernel times per step go to profile/gpu.json beside breakdown.json, and are
    # printed, over the profiled steps only. This machine's trace has no kernels: its reading is
    # stubbed, the profiler's own steps and files are real.
    from loop.observe import profile

    gpu = {"ms_per_step": {"matmul": 1.5}, "busy": 0.5, "span_ms_per_step": 3.0,
           "top": [{"name": "ampere_sgemm_128x64_nn", "ms_per_step": 1.5, "calls_per_step": 3}]}
    steps = []
    monkeypatch.setattr(profile, "gpu_time", lambda trace, n: steps.append(n) or gpu)
    p = profile.StepProfiler(tmp_path / "profile", warmup=1, active=2)
    p.cuda = True  # as on a GPU
    for _ in range(3):
        p.step()
    assert steps == [2]  # the two profiled steps, not the warm-up's
    assert json.loads((tmp_path / "profile" / "gpu.json").read_text()) == gpu
    out = capsys.readouterr().out
    assert "50.0% of it busy" in out and "matmul" in out and "1.50 ms" in out
