"""MFU arithmetic on the example GPT (its flops_per_token) equals a hand computation, and the peak table maps the device names torch reports to the right datasheet peaks."""
from __future__ import annotations

import json

import pytest

from loop.observe.mfu import mfu, peak_flops
from model.gpt import GPT


def test_gpt_flops_per_token_matches_hand_count():
    V, T, L, H, C = 65, 64, 2, 4, 32
    m = GPT(vocab_size=V, seq_len=T, n_layer=L, n_head=H, n_embd=C, dropout=0, bias=False)
    # Parameters by hand (bias=False: LayerNorms have weights only; lm_head is tied to wte, counted once).
    wte, wpe = 65 * 32, 64 * 32                                   # 2080, 2048
    block = 32 + 32 + 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32     # ln1, ln2, qkv, proj, fc, fc-proj = 12352
    n_params = wte + wpe + 2 * block + 32                        # + ln_f = 28864
    assert n_params == 28864 == sum(p.numel() for p in m.parameters())
    assert wpe == m.wpe.weight.numel()
    # 6*N with N = all params minus position embeddings, + 12*L*H*Q*T with Q = 32 // 4 = 8.
    hand = 6 * (28864 - 2048) + 12 * 2 * 4 * 8 * 64              # 160896 + 49152
    assert hand == 210048
    assert m.flops_per_token() == hand


def test_mfu_round_numbers():
    assert mfu(2500.0, 2e8, 1e12) == 0.5          # 5e11 FLOP/s achieved of 1e12
    assert mfu(1000.0, 1e9, 1e12) == 1.0
    # 100k tok/s at 312 MFLOP/token on an A100 in bf16 (312 TFLOPS) is 10%.
    assert mfu(1e5, 312e6, peak_flops("NVIDIA A100-SXM4-80GB", "bf16")) == pytest.approx(0.1, rel=1e-12)
    assert mfu(1e5, 312e6, None) is None
    assert mfu(1e5, 312e6, peak_flops("cpu", "fp32")) is None


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),     # the SXM part
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 PCIe", "fp16", 756.5),
    ("NVIDIA H100 PCIe", "tf32", 378.0),
    ("NVIDIA H100 PCIe", "fp32", 51.2),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156.0),
    ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L4", "tf32", 60.0),
    ("NVIDIA L4", "fp32", 30.3),
    ("NVIDIA L40S", "bf16", 362.05),              # not mistaken for the L4
    ("nvidia h100 pcie", "bf16", 756.5),          # case-insensitive
])
def test_peak_lookup_by_name(name, precision, tflops):
    assert peak_flops(name, precision) == pytest.approx(tflops * 1e12, rel=1e-12)


@pytest.mark.parametrize("name", ["Tesla T4", "cpu", "", "NVIDIA A10G", "NVIDIA L40", "mps"])
def test_unknown_device_is_none(name):
    assert peak_flops(name, "bf16") is None


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        peak_flops("NVIDIA H100 80GB HBM3", "fp8")


def test_a_runs_mfu_divides_global_tokens_per_s_by_every_process_device(monkeypatch):
    # tokens/s in the log is global (summed over ranks): its MFU is over the peak of all the run's
    # devices, one per process, or 8 processes would read 8 times their true utilisation.
    import torch

    from loop.observe import telemetry

    monkeypatch.setattr(telemetry, "peak_flops", lambda name, precision: 1e12)  # a device in the table
    m = GPT(vocab_size=65, seq_len=64, n_layer=2, n_head=4, n_embd=32, dropout=0, bias=False)
    for world in (1, 8):
        t = telemetry.Telemetry(m, torch.device("cpu"), "bf16", world, positions=64)
        assert t.mfu(1e6 / 64) == 1e6 * 210048 / (world * 1e12)  # 210048 FLOPs a token: the hand count above
        t.close()
    assert telemetry.Telemetry(torch.nn.Linear(2, 2), torch.device("cpu"), "bf16", 1).mfu(1e6) is None


def test_mfu_counts_every_input_position_not_only_the_targets(tmp_path):
    # A sample's positions are all computed, whether or not their targets count (-100): MFU from
    # targets/s read half the true figure for data masked half-way.
    import torch

    from loop.observe.metrics import MetricsLog

    class Rate:
        def mfu(self, samples_per_s):
            return samples_per_s

        def read(self, now=False):
            return {}

        def close(self):
            pass

    log = MetricsLog(tmp_path, 0, 0, 0, max_steps=2, tensorboard=False, telemetry=Rate())
    for step in (1, 2):
        log.record({"step": step, "lr": 0.1, "tokens": 50 * step, "samples": 4 * step, "skipped": False,
                    "data_ms": 0.0, "micro_batch": 4}, torch.tensor(1.0), torch.tensor(1.0))
    log.flush()
    log.close()
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["mfu"] == rec["samples_per_s"] and rec["tokens_per_s"] != rec["samples_per_s"]


def test_fp32_on_cuda_with_tf32_matmuls_is_measured_against_the_tf32_peak(monkeypatch):
    # With TF32 matmuls allowed an fp32 run's matmuls run on the tensor cores: against the plain
    # fp32 peak (66.9 TFLOP/s on an H100 SXM; TF32 494.7) its MFU would read up to 7x too high. No GPU here:
    # the device name and the precision setting are what Telemetry reads, so they are set.
    import torch

    from loop.observe import telemetry

    monkeypatch.setattr(telemetry, "node_gpus", lambda device: None)  # no NVML sampler
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    m, cuda = torch.nn.Linear(2, 2), torch.device("cuda", 0)
    peaks, before = {}, torch.backends.cuda.matmul.fp32_precision  # monkeypatch cannot undo this one
    try:
        for setting in ("tf32", "ieee"):
            torch.backends.cuda.matmul.fp32_precision = setting
            peaks[setting] = telemetry.Telemetry(m, cuda, "fp32", 2).peak
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert peaks == {"tf32": 2 * peak_flops("NVIDIA H100 80GB HBM3", "tf32"),
                     "ieee": 2 * peak_flops("NVIDIA H100 80GB HBM3", "fp32")}
    assert telemetry.Telemetry(m, cuda, "bf16", 1).peak == peak_flops("NVIDIA H100 80GB HBM3", "bf16")  # as is
