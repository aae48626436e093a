"""Precision picks the right autocast dtype and GradScaler per mode, and the scaler state round-trips."""
from __future__ import annotations

import pytest
import torch

from loop.precision import Precision, resolve

CPU = torch.device("cpu")


def test_resolve_on_cpu():
    assert resolve("auto", CPU) == "fp32"
    for name in ("bf16", "fp16", "fp32"):
        assert resolve(name, CPU) == name
    p = Precision("auto", CPU)
    assert p.name == "fp32" and p.dtype is None


@pytest.mark.parametrize("native, picked", [(True, "bf16"), (False, "fp16")])
def test_auto_picks_bf16_only_on_a_card_that_computes_in_it(monkeypatch, native, picked):
    # A card before Ampere emulates bf16, and torch's check says yes to it unless asked not to.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or including_emulation)
    assert resolve("auto", torch.device("cuda")) == picked


def test_bf16_autocast_on_cpu():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    lin = torch.nn.Linear(16, 4)
    p = Precision("bf16", CPU)
    assert p.dtype is torch.bfloat16
    with p.autocast():
        out, y = a @ b, lin(a)
    assert out.dtype is torch.bfloat16 and y.dtype is torch.bfloat16
    assert lin.weight.dtype is torch.float32  # autocast casts per op; the weights stay fp32
    # bf16 keeps ~3 significant digits: close to the fp32 product, but not equal to it
    exact = a @ b
    assert torch.allclose(out.float(), exact, rtol=2e-2, atol=5e-2)
    assert not torch.equal(out.float(), exact)


def test_fp32_has_no_autocast():
    a = torch.randn(4, 4)
    with Precision("fp32", CPU).autocast():
        assert (a @ a).dtype is torch.float32


@pytest.mark.parametrize("name, enabled", [("fp16", True), ("bf16", False), ("fp32", False),
                                           ("auto", False)])
def test_grad_scaler_only_for_fp16(name, enabled):
    p = Precision(name, CPU)
    assert p.scaler.is_enabled() is enabled
    if enabled:
        assert p.scaler.get_scale() == 65536.0
    else:
        assert p.scaler.state_dict() == {}  # what the trainer checkpoints when fp16 is off
        loss = torch.tensor(3.0)
        assert p.scaler.scale(loss) is loss  # a no-op


def test_grad_scaler_state_round_trips(tmp_path):
    scaler = Precision("fp16", CPU).scaler
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    # One overflow (the step is skipped, the scale halves), then three good steps.
    scaler.scale((w * torch.tensor([1.0, float("inf"), 0.0])).sum()).backward()
    assert not torch.isfinite(w.grad).all()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach(), torch.ones(3))  # the overflow step was skipped
    for _ in range(3):
        opt.zero_grad()
        scaler.scale((w * 2).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert torch.allclose(w.detach(), torch.full((3,), 1 - 3 * 0.1 * 2))  # unscaled gradients
    state = scaler.state_dict()
    assert state == {"scale": 32768.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                     "growth_interval": 2000, "_growth_tracker": 3}

    torch.save({"scaler": state}, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)["scaler"]
    assert loaded == state
    fresh = Precision("fp16", CPU).scaler
    assert fresh.get_scale() == 65536.0
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == state and fresh.get_scale() == 32768.0


@pytest.mark.parametrize("weights, precision, said", [
    (torch.float16, "fp16", "keeps wte.weight in torch.float16, and its GradScaler does not unscale "
                            "float16 gradients; expected float32 weights"),
    (torch.bfloat16, "fp16", "keeps wte.weight in torch.bfloat16, and autocast to torch.float16 does "
                             "not mix with torch.bfloat16 weights"),
    (torch.float16, "bf16", "keeps wte.weight in torch.float16, and autocast to torch.bfloat16 does "
                            "not mix with torch.float16 weights")])
def test_16_bit_weights_autocast_cannot_train_are_refused(tmp_path, cache, monkeypatch, weights, precision, said):
    # Refused up front; left to PyTorch, each is a traceback: fp16's GradScaler at the first step,
    # after the run directory is written ("Attempting to unscale FP16 gradients."), the two mixes
    # from LayerNorm in the first forward.
    from conftest import TINY, build_trainer, gpt_then, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist
    from loop.errors import BadInput
    from model import MODELS

    monkeypatch.setitem(MODELS, "gpt16", gpt_then(lambda m: m.to(weights)))
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt16", f"train.precision={precision}",
                                       f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(BadInput) as e:
        build_trainer(cfg, Dist(), CPU)
    assert str(e.value).startswith(f"config key train.precision={precision}: the model {said}"), e.value
    assert not (tmp_path / "run").exists()


def test_a_frozen_float16_base_trains_under_fp16(tmp_path, cache, monkeypatch):
    # A frozen base kept in float16 (a LoRA-style fine-tune) has no gradient for the GradScaler to
    # unscale: the rest trains under fp16, and the base stays as it was.
    from conftest import TINY, build_trainer, gpt_then, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist
    from model import MODELS

    def frozen_half(m):
        m.wte.weight.requires_grad_(False)
        m.wte.half()
        return m

    monkeypatch.setitem(MODELS, "gpt16", gpt_then(frozen_half))
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt16", "train.precision=fp16", "train.max_steps=3",
                                       "train.sample_tokens=0", f"run.out_dir={tmp_path / 'run'}"])
    t = build_trainer(cfg, Dist(), CPU)
    base, head = t.raw.wte.weight.detach().clone(), t.raw.blocks[0].attn.qkv.weight.detach().clone()
    assert t.run()["steps"] == 3
    assert t.raw.wte.weight.dtype is torch.float16 and torch.equal(t.raw.wte.weight, base)
    assert not torch.equal(t.raw.blocks[0].attn.qkv.weight, head)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weights_kept_in_bf16_train_under_fp32_and_bf16(tmp_path, cache, monkeypatch, precision):
    # The weights' own dtype (fp32: no autocast), or bf16 autocast over bf16 weights: nothing to cast.
    from conftest import TINY, build_trainer, gpt_then, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist
    from model import MODELS

    monkeypatch.setitem(MODELS, "gpt16", gpt_then(lambda m: m.bfloat16()))
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt16", f"train.precision={precision}",
                                       f"run.out_dir={tmp_path / 'run'}", "train.max_steps=3"])
    t = build_trainer(cfg, Dist(), CPU)
    before = t.raw.wte.weight.detach().clone()
    t.run()
    assert t.raw.wte.weight.dtype is torch.bfloat16 and not torch.equal(t.raw.wte.weight, before)


def test_micro_batch_losses_a_model_gives_in_bf16_are_added_in_float32(tmp_path, cache, monkeypatch):
    # A model of yours may return its loss in bf16 (computed in bf16, no .float()). The step's loss
    # adds its micro-batches' losses in float32: added in bf16, the sum would be rounded to 8 bits
    # again (4 micro-batches of ~590 here: steps of 16 instead of 4; 4.59375 logged for 4.5859375).
    from conftest import TINY, build_trainer, gpt_then, load_config, metrics
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist
    from model import MODELS

    seen = []  # every training micro-batch's bf16 loss, in order (not the no-grad evaluations)

    class Bf16Loss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            loss = self.inner(batch).bfloat16()
            if torch.is_grad_enabled():
                seen.append(loss.item())
            return loss

    monkeypatch.setitem(MODELS, "gpt_bf16_loss", gpt_then(Bf16Loss))
    out = tmp_path / "run"
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, "model.name=gpt_bf16_loss", f"run.out_dir={out}",
                                       "train.max_steps=4", "train.grad_accum=4", "train.eval_every=0",
                                       "train.sample_tokens=0"])
    build_trainer(cfg, Dist(), CPU).run()
    n = 4 * 4 * 32  # targets in a step: 4 micro-batches of 4 samples of 32
    # Each bf16 value is exact in float32, so is their sum (a few bits more), and so is / 512.
    want = [(torch.tensor(seen[4 * k : 4 * k + 4]).sum() / n).item() for k in range(4)]
    assert [r["loss"] for r in metrics(out)] == want
