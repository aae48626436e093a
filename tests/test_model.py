"""The GPT returns the summed CE over real targets, has the hand-counted parameters, and can overfit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import token_data, train_here
from data import DATASETS
from data.markov import MarkovConfig, MarkovOptions
from loop.build import build_data, build_model
from loop.config.schema import OptimConfig
from loop.contract import loss_and_sums
from loop.data.bundle import IGNORE_INDEX
from loop.data.sampler import collate, to_device
from loop.device import pick_device
from loop.errors import BadInput
from loop.optim import build_optimizer
from model import MODELS
from model.gpt import GPT, GPTOptions, build_gpt


def gpt(V=16, T=8, L=2, H=2, C=32, dropout=0.0, bias=False, seed=0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTOptions(name="gpt", n_layer=L, n_head=H, n_embd=C, dropout=dropout, bias=bias)
    return build_model(cfg, token_data(V, T), MODELS)


def random_batch(B, T, V, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randint(0, V, (B, T), generator=g), "y": torch.randint(0, V, (B, T), generator=g)}


# ------------------------------------------------------------------------------- forward / loss
def test_logits_shape_and_summed_cross_entropy():
    B, T, V = 3, 8, 16
    model = gpt(V=V, T=T).eval()
    batch = random_batch(B, T, V)
    logits = model.logits(batch["x"])
    assert logits.shape == (B, T, V) and logits.dtype == torch.float32
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
    assert per_token.shape == (B * T,)
    loss = model(batch)
    assert loss.shape == () and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(per_token.sum().item(), rel=1e-6)
    # a sum, not a mean: roughly B*T*log(V) at init (small init -> near-uniform predictions)
    assert loss.item() == pytest.approx(B * T * torch.log(torch.tensor(float(V))).item(), rel=0.05)


def test_ignored_targets_do_not_count():
    B, T, V = 3, 8, 16
    model = gpt(V=V, T=T).eval()
    batch = random_batch(B, T, V)
    y = batch["y"].clone()
    y[0, :5] = IGNORE_INDEX
    y[2, 3] = IGNORE_INDEX
    keep = y.flatten() != IGNORE_INDEX
    assert int(keep.sum()) == B * T - 6
    per_token = F.cross_entropy(model.logits(batch["x"]).flatten(0, 1), batch["y"].flatten(),
                                reduction="none")
    loss = model({"x": batch["x"], "y": y})
    assert loss.item() == pytest.approx(per_token[keep].sum().item(), rel=1e-6)
    assert loss.item() < per_token.sum().item() - 1.0  # the dropped terms are really gone

    all_ignored = model({"x": batch["x"], "y": torch.full_like(y, IGNORE_INDEX)})
    assert all_ignored.item() == 0.0


def test_causal_prefix_logits_do_not_see_the_future():
    model = gpt(V=16, T=8).eval()
    x = random_batch(1, 8, 16)["x"]
    x2 = x.clone()
    x2[0, 5:] = (x2[0, 5:] + 1) % 16
    a, b = model.logits(x), model.logits(x2)
    assert torch.equal(a[0, :5], b[0, :5])
    assert not torch.allclose(a[0, 5:], b[0, 5:])


def test_generate_continues_from_the_last_position_within_the_context():
    # Near temperature 0 a draw is the most likely next token: the argmax of the logits at the
    # prompt's last position, seeing only the last seq_len (8) tokens. Only this test catches a
    # draw from position 0's distribution (the run's sample and tools.sample use the same code).
    model = gpt(V=16, T=8).eval()
    g = torch.Generator().manual_seed(0)
    for length in (3, 8, 13):  # shorter than, as long as, and longer than the context
        for seed in range(4):
            prompt = torch.randint(0, 16, (1, length), generator=torch.Generator().manual_seed(seed))
            # 1e-39: logits / temperature overflows float32: NaN probabilities, multinomial raises.
            for temperature in (1e-6, 1e-39, 5e-324):
                out = model.generate(prompt, 1, g, temperature=temperature)
                assert out.shape == (1, length + 1) and torch.equal(out[:, :length], prompt)
                assert out[0, -1] == model.logits(prompt[:, -8:])[0, -1].argmax(), (length, seed)


def test_residual_projections_start_smaller_with_depth():
    # GPT-2's init: each block's two residual output projections have std 0.02 / sqrt(2 * n_layer),
    # so the residual stream's variance does not grow with depth; every other matrix 0.02.
    # Every bias starts at 0 (nn.Linear's own init draws them), LayerNorm weights at 1.
    model = gpt(V=64, T=8, L=8, C=256, bias=True)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            want = 0.02 / 4 if name.endswith(("attn.proj.weight", "mlp.2.weight")) else 0.02
            assert p.std().item() == pytest.approx(want, rel=0.05), name  # 2k to 262k draws each
        else:  # 1-D: biases, and LayerNorm weights (the only 1-D weights)
            assert torch.equal(p, torch.full_like(p, float(name.endswith("weight")))), name


# ------------------------------------------------------------------------------- parameter count
def expected_params(V, T, L, C, bias):
    n = V * C + T * C  # wte (tied with lm_head, counted once) + wpe
    per_layer = 2 * C + 3 * C * C + C * C + 4 * C * C + 4 * C * C  # ln1/ln2, qkv, proj, fc, fc-out
    if bias:
        per_layer += 2 * C + 3 * C + C + 4 * C + C  # ln biases, qkv, proj, fc, fc-out biases
    return n + L * per_layer + (2 * C if bias else C)  # ln_f


def test_parameter_formula_by_hand():
    # V=16, T=8, L=2, C=32: 16*32 + 8*32 + 2 * (64 + 3072 + 1024 + 4096 + 4096) + 32
    assert expected_params(16, 8, 2, 32, False) == 512 + 256 + 2 * 12_352 + 32 == 25_504


@pytest.mark.parametrize("V, T, L, H, C, bias", [
    (16, 8, 2, 2, 32, False),
    (65, 32, 3, 6, 48, False),
    (50, 16, 2, 4, 24, True),
])
def test_parameter_count_matches_formula(V, T, L, H, C, bias):
    model = gpt(V=V, T=T, L=L, H=H, C=C, bias=bias)
    got = sum(p.numel() for p in model.parameters())
    assert got == expected_params(V, T, L, C, bias)
    assert model.lm_head.weight is model.wte.weight
    # without tying the count would be V*C higher: named_parameters de-duplicates the shared tensor
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_n_embd_not_divisible_by_n_head():
    with pytest.raises(BadInput) as e:
        build_model(GPTOptions(name="gpt", n_head=3, n_embd=32), token_data(8, 4), MODELS)
    assert str(e.value) == "config key model.n_embd: expected a multiple of model.n_head=3; got 32."


def test_a_model_with_nothing_to_train_is_named(monkeypatch):
    # Every parameter frozen (requires_grad_(False) on the whole model): named as such when the
    # model is built, not at the first step as a loss detached from the weights.
    monkeypatch.setitem(MODELS, "frozen", lambda cfg, data: build_gpt(cfg, data).requires_grad_(False))
    with pytest.raises(BadInput) as e:
        build_model(GPTOptions(name="frozen", n_layer=1, n_head=2, n_embd=8), token_data(8, 4),
                    MODELS)
    assert str(e.value) == ("config key model.name=frozen: the model has no parameter to train (888 "
                            "parameters, none with requires_grad=True); expected at least one.")


class Extra(torch.nn.Module):
    def get_extra_state(self):
        return {"version": 1}

    def set_extra_state(self, state):
        pass


@pytest.mark.parametrize("add, said", [
    (lambda m: setattr(m, "lazy", torch.nn.LazyLinear(4)),
     "lazy.weight is a lazy parameter (nn.LazyLinear...), still without a shape; expected sizes given "
     "when the model is built (or one forward in its builder)."),
    (lambda m: setattr(m, "wte", torch.nn.Embedding(8, 8, sparse=True)),
     "wte makes sparse gradients (sparse=True), which gradient clipping and AdamW do not take; "
     "expected sparse=False."),
    (lambda m: setattr(m, "extra", Extra()),
     "its state_dict holds extra._extra_state, a dict (get_extra_state), not a tensor; checkpoints, "
     "params_sha256, the EMA copy and FSDP take tensors; expected tensors only (keep it in a buffer)."),
])
def test_what_the_loop_cannot_keep_is_named_when_the_model_is_built(monkeypatch, add, said):
    # Valid PyTorch, each a traceback if left to the loop: a lazy parameter at the optimizer's
    # build, sparse gradients at the first clipping, extra state (a dict) after the last step, when
    # hashing the weights (no model.pt, no summary.json) and at every resume.
    monkeypatch.setitem(MODELS, "mine", lambda cfg, data: (m := build_gpt(cfg, data), add(m))[0])
    with pytest.raises(BadInput) as e:
        build_model(GPTOptions(name="mine", n_layer=1, n_head=2, n_embd=8), token_data(8, 4),
                    MODELS)
    assert str(e.value) == f"config key model.name=mine: {said}"


def test_unknown_model_name():
    with pytest.raises(BadInput, match="model.name"):
        build_model(GPTOptions(name="rnn"), token_data(8, 4), MODELS)


# ------------------------------------------------------------------------------- device
def test_pick_device():
    if torch.cuda.is_available():
        auto = "cuda"
    elif torch.backends.mps.is_available():
        auto = "mps"
    else:
        auto = "cpu"
    assert pick_device("auto") == torch.device(auto)
    assert pick_device("cpu") == torch.device("cpu")
    for name in ("nonsense", "xpu", "meta"):  # xpu, meta: torch devices the loop does not train on
        with pytest.raises(BadInput) as e:
            pick_device(name)
        assert str(e.value).startswith("config key train.device:") and repr(name) in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_pick_cuda_without_cuda(name):
    with pytest.raises(BadInput) as e:
        pick_device(name)
    assert str(e.value) == f"config key train.device: {name!r} asked for, but this machine has no CUDA."


def test_a_cuda_index_past_the_machine_s_devices_is_named(monkeypatch):
    # Named, not "CUDA error: invalid device ordinal" from the first tensor moved there (torchrun:
    # from set_device, a LOCAL_RANK past the GPUs of the node). A machine with 2 GPUs, as CUDA says.
    from loop.distributed import group

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(BadInput) as e:
        pick_device("cuda:2")
    assert str(e.value) == ("config key train.device: 'cuda:2' asked for, but this machine has 2 visible "
                            "CUDA devices (cuda:0 to cuda:1).")
    for k, v in {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(BadInput) as e:
        group.init("cuda")
    assert str(e.value) == ("LOCAL_RANK=2, but this machine has 2 visible CUDA devices (cuda:0 to cuda:1): "
                            "one process per GPU, so expected at most 2 processes per node (torchrun "
                            "--nproc_per_node=2).")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the common case: one GPU
    with pytest.raises(BadInput, match=r"this machine has 1 visible CUDA device \(cuda:0\)\.$"):
        pick_device("cuda:1")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_pick_mps_without_mps():
    with pytest.raises(BadInput, match="train.device: 'mps' asked for, but this machine has no MPS"):
        pick_device("mps")


def test_model_and_batches_on_selected_device(tmp_path):
    device = pick_device("auto")
    data = build_data(MarkovOptions(name="markov", cache_dir=str(tmp_path), seq_len=8,
                                    markov=MarkovConfig(vocab_size=8, tokens=2000)), DATASETS)
    torch.manual_seed(0)
    model = build_model(GPTOptions(name="gpt", n_layer=1, n_head=2, n_embd=16, dropout=0.0), data, MODELS).to(device)
    assert {p.device.type for p in model.parameters()} == {device.type}
    batch = collate([data.train[i] for i in range(4)])
    assert batch["x"].shape == (4, 8) and batch["n_targets"] == 32
    batch = to_device(batch, device)  # as the loop
    assert batch["x"].device.type == batch["y"].device.type == device.type
    loss = model(batch)
    assert loss.device.type == device.type
    assert loss.item() / 32 == pytest.approx(torch.log(torch.tensor(8.0)).item(), rel=0.05)


# ------------------------------------------------------------------------------- optimizer groups
def test_adamw_param_groups():
    model = gpt(V=16, T=8, L=2, H=2, C=32, bias=True)
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    named = dict(model.named_parameters())
    want_decay = {n for n, p in named.items() if p.dim() >= 2}
    want_no = {n for n, p in named.items() if p.dim() < 2}
    by_id = {id(p): n for n, p in named.items()}
    assert {by_id[id(p)] for p in decay["params"]} == want_decay
    assert {by_id[id(p)] for p in no_decay["params"]} == want_no
    assert want_decay == {"wte.weight", "wpe.weight"} | {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}
    assert "ln_f.weight" in want_no and "ln_f.bias" in want_no and "blocks.0.attn.qkv.bias" in want_no
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(named)  # tied weight appears once
    assert ids.count(id(model.lm_head.weight)) == 1
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == \
        expected_params(16, 8, 2, 32, True)
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.95)
    # The config's betas and eps reach AdamW (eps=1e-6, not AdamW's default 1e-8, so a build that
    # leaves eps out fails here); a frozen parameter is not the optimizer's.
    model.wpe.weight.requires_grad_(False)
    opt = build_optimizer(model, OptimConfig(betas=[0.8, 0.99], eps=1e-6), torch.device("cpu"))
    assert opt.defaults["betas"] == (0.8, 0.99) and opt.defaults["eps"] == 1e-6
    assert id(model.wpe.weight) not in {id(p) for g in opt.param_groups for p in g["params"]}


def test_a_resumed_adamw_takes_its_settings_from_the_config_and_its_moments_from_the_checkpoint():
    # Every setting, betas and eps included, is this run's (a resume with optim.betas.1=0.99 uses
    # it); the moments and step counts are the checkpoint's, bit for bit.
    model = gpt(V=16, T=8, L=1, H=2, C=16, bias=True)
    cpu = torch.device("cpu")
    saved = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1), cpu)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    saved.step()
    state = saved.state_dict()
    new = OptimConfig(lr=4e-3, weight_decay=0.25, betas=[0.8, 0.99], eps=1e-6)
    resumed = build_optimizer(model, new, cpu)
    resumed.load_state_dict(state)
    for group, wd in zip(resumed.param_groups, (0.25, 0.0)):
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (4e-3, wd, (0.8, 0.99), 1e-6)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.state[p][key], saved.state[p][key]), key


# ------------------------------------------------------------------------------- it can learn
def test_overfits_one_batch():
    B, T, V = 4, 16, 16
    model = gpt(V=V, T=T, L=2, H=2, C=32, dropout=0.0).train()
    batch = random_batch(B, T, V)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(300):
        loss = model(batch) / (B * T)
        first = first if first is not None else loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    final = (model(batch) / (B * T)).item()
    assert first == pytest.approx(torch.log(torch.tensor(float(V))).item(), rel=0.05)
    assert final < 0.05, f"mean loss after 300 steps on one batch: {final:.4f} (from {first:.4f})"


# ------------------------------------------------------------ the model's contract, checked by the loop
@pytest.mark.parametrize("out, said", [
    (torch.ones(3), "returned a tensor of shape (3,);"),  # reduction="none"
    ((torch.ones(3, 4), torch.ones(())), "returned a tuple;"),  # (logits, loss)
    (2.5, "returned a float;"),  # loss.item()
    ({"ce": torch.ones(())}, 'returned a dict without "loss" (keys: ce);'),
    ({"loss": torch.ones((), requires_grad=True), "right": torch.ones(4)},
     "returned a tensor of shape (4,) under 'right';"),
    (torch.tensor(3), "returned a loss of dtype torch.int64,"),
    (torch.ones(()), "returned a loss detached from the weights (requires_grad=False),"),
])
def test_a_forward_that_breaks_the_contract_is_named(out, said):
    # Named, not tracebacks from inside the loop (torch.stack, backward, `.float` of a tuple).
    with pytest.raises(BadInput) as e:
        loss_and_sums(out)
    assert f"the model's forward(batch) {said}" in str(e.value)
    assert 'reduction="sum"' in str(e.value) and "docs/bring-your-own.md" in str(e.value)


def test_the_contract_allows_count_sums_and_a_loss_without_graph_under_no_grad():
    w = torch.ones(2, requires_grad=True)
    loss, extra = loss_and_sums({"loss": w.sum(), "right": torch.tensor(3)})  # an integer count
    assert loss.requires_grad and extra == {"right": torch.tensor(3)}
    with torch.no_grad():  # validation: no graph is built
        assert loss_and_sums(w.sum())[0] == 2.0


def test_a_broken_model_stops_the_run_before_anything_is_written(tmp_path, cache):
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.raw.forward = lambda batch: F.cross_entropy(t.raw.logits(batch["x"]).flatten(0, 1),
                                                  batch["y"].flatten(), reduction="none")
    with pytest.raises(BadInput, match=r"returned a tensor of shape \(128,\)"):
        t.run()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("loss, said", [
    # A mean over the targets (HF's .loss, reduction="mean"): unchecked, the first loss is 0.009
    # where ln(103) = 4.6 is due, and only make verify notices.
    (lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX),
     "not a sum over the batch's targets"),
    # A prediction broadcast against its targets: (B*T,) against (B*T, 1), a matrix of errors.
    (lambda logits, y: ((logits.flatten(0, 1)[:, 0] - y.flatten()[:, None].float()) ** 2).sum(),
     "not a sum over the batch's targets"),
])
@pytest.mark.parametrize("batch", [4, 1])  # 1: no halves to compare; the sample twice over is
def test_a_loss_that_is_not_a_sum_over_the_targets_stops_the_run_before_anything_is_written(tmp_path, cache, loss,
                                                                                             said, batch):
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", f"data.batch_size={batch}"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.raw.forward = lambda batch: loss(t.raw.logits(batch["x"]), batch["y"])
    with pytest.raises(BadInput) as e:
        t.run()
    assert said in str(e.value) and 'reduction=\"sum\"' in str(e.value), e.value
    assert not (tmp_path / "run").exists()


def test_a_reported_value_that_is_not_a_sum_is_named_and_a_count_passes(tmp_path, cache):
    # val_<name> is the sum over the targets' count: a perplexity returned beside the loss was
    # reported divided by it (val_ppl 0.17 for a perplexity of 88), exit 0.
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    def forward(model, batch, ppl: bool) -> dict:
        logits, y = model.logits(batch["x"]).flatten(0, 1), batch["y"].flatten()
        loss = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
        n = (y != IGNORE_INDEX).sum()
        extra = torch.exp(loss.detach() / n) if ppl else ((logits.argmax(-1) == y) & (y != IGNORE_INDEX)).sum()
        return {"loss": loss, "ppl" if ppl else "right": extra}

    for ppl in (True, False):
        out = tmp_path / f"run{ppl}"
        cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=1"])
        t = build_trainer(cfg, Dist(), torch.device("cpu"))
        t.raw.forward = lambda batch, m=t.raw, ppl=ppl: forward(m, batch, ppl)
        if ppl:
            with pytest.raises(BadInput, match=r"the model's 'ppl' \(beside its loss\) is not a sum"):
                t.run()
            assert not out.exists()
        else:
            assert 0 <= t.run()["val_right"] <= 1


def test_a_mean_at_a_micro_batch_of_one_is_found_by_halving_the_sample_s_targets():
    # No larger forward than the sample's own: under FSDP (where an out-of-memory in a forward
    # cannot be retried) as anywhere, a mean loss at data.batch_size=1 is exit 2.
    from types import SimpleNamespace

    from loop.data.sampler import target_halves
    from loop.distributed.group import Dist
    from loop.precision import Precision
    from loop.probe import sums_add_up

    class Mean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, batch):
            counted = batch["y"] != IGNORE_INDEX
            return (self.w * batch["y"].float() * counted).sum() / counted.sum()

    cpu = torch.device("cpu")
    y = torch.tensor([[3, 1, IGNORE_INDEX, 4, 1, 5]])
    batch = {"idx": torch.tensor([0]), "x": torch.zeros(1, 6, dtype=torch.long), "y": y, "n_targets": 5}
    halves = target_halves(batch)
    assert [h["y"].tolist() for h in halves] == [[[3, 1, -100, -100, -100, -100]], [[-100, -100, -100, 4, 1, 5]]]
    assert [h["n_targets"] for h in halves] == [2, 3]
    evaluator = SimpleNamespace(precision=Precision("fp32", cpu), device=cpu, dist=Dist(), sharded=True, seed=0)
    with pytest.raises(BadInput, match="not a sum over the batch's targets"):
        sums_add_up(evaluator, Mean(), batch, 1)
    Mean.forward = lambda self, b: (self.w * b["y"].float() * (b["y"] != IGNORE_INDEX)).sum()  # a sum
    sums_add_up(evaluator, Mean(), batch, 1)
    assert target_halves({**batch, "y": torch.tensor([[2]])}) is None  # one target: nothing to halve


def test_a_mean_is_found_in_a_probe_batch_whose_later_samples_hold_no_target():
    # Unlabelled samples (every y -100) after labelled ones: halves cut by sample left one without
    # targets, which compares nothing, and a mean trained without a word. The samples that hold
    # targets are halved.
    from types import SimpleNamespace

    from loop.distributed.group import Dist
    from loop.precision import Precision
    from loop.probe import sums_add_up

    class MaskedMean(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(3, 1)

        def forward(self, batch):
            real = batch["y"] != IGNORE_INDEX
            return (((self.w(batch["x"]) - batch["y"]) ** 2) * real).sum() / real.sum().clamp_min(1)

    cpu = torch.device("cpu")
    y = torch.tensor([[1.5], [2.5], [-100.0], [-100.0]])
    batch = {"idx": torch.arange(4), "x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "y": y,
             "n_targets": 2}
    evaluator = SimpleNamespace(precision=Precision("fp32", cpu), device=cpu, dist=Dist(), sharded=False, seed=0)
    with pytest.raises(BadInput, match="not a sum over the batch's targets"):
        sums_add_up(evaluator, MaskedMean(), batch, 1)


def test_a_signed_sum_and_a_value_drawn_at_random_are_not_taken_for_means():
    # A signed sum's halves can be far larger than it (bf16 rounding of 7.34 and -7.56 is more than
    # 1% of their sum -0.21); a count drawn at random differs in the halves, which draw again.
    from types import SimpleNamespace

    from loop.distributed.group import Dist
    from loop.precision import Precision
    from loop.probe import adds_up, sums_add_up

    assert adds_up(-0.214844, 7.34375, -7.5625)
    assert not adds_up(4.49, 4.49, 4.49) and not adds_up(8.0, 2.0, 2.0)  # a mean; a broadcast's half
    # bf16's rounding (1%) passes; a term added once per forward, 5% of the sum here, does not
    assert adds_up(1.009, 0.5, 0.5) and not adds_up(1.05, 0.5, 0.5)

    class Sampled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, batch):
            counted = batch["y"] != IGNORE_INDEX
            return {"loss": (self.w * batch["y"].float() * counted).sum(),
                    "sampled": ((torch.rand(batch["y"].shape) < 0.5) & counted).sum()}

    cpu = torch.device("cpu")
    y = torch.arange(64).reshape(4, 16)
    batch = {"idx": torch.arange(4), "x": torch.zeros(4, 16, dtype=torch.long), "y": y, "n_targets": 64}
    evaluator = SimpleNamespace(precision=Precision("fp32", cpu), device=cpu, dist=Dist(), sharded=False, seed=0)
    sums_add_up(evaluator, Sampled(), batch, 1)


def test_a_value_drawn_at_random_beside_a_mean_loss_does_not_excuse_the_loss():
    # Only a loss that differs under other draws cannot be compared: a count drawn at random beside
    # it is left out of the comparison, and the loss still checked. Were any random value to skip
    # the whole probe, a mean loss with, say, a sampled metric beside it trained without a word.
    from types import SimpleNamespace

    from loop.distributed.group import Dist
    from loop.precision import Precision
    from loop.probe import sums_add_up

    class MeanAndSampled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, batch):
            counted = batch["y"] != IGNORE_INDEX
            return {"loss": (self.w * batch["y"].float())[counted].mean(),
                    "sampled": ((torch.rand(batch["y"].shape) < 0.5) & counted).sum()}

    cpu = torch.device("cpu")
    y = torch.arange(64).reshape(4, 16)
    batch = {"idx": torch.arange(4), "x": torch.zeros(4, 16, dtype=torch.long), "y": y, "n_targets": 64}
    evaluator = SimpleNamespace(precision=Precision("fp32", cpu), device=cpu, dist=Dist(), sharded=False, seed=0)
    with pytest.raises(BadInput, match="the model's loss is not a sum over the batch's targets"):
        sums_add_up(evaluator, MeanAndSampled(), batch, 1)


def test_a_model_that_draws_random_numbers_in_eval_mode_trains_and_evaluating_changes_nothing(tmp_path, cache,
                                                                                               capsys):
    # A diffusion model's noise, drawn from torch's global stream in eval mode too: its loss is a
    # sum, which halves under other draws cannot show (compared, it would be refused), and a
    # validation that drew from training's stream would change the draws of every step after it.
    from conftest import TINY, build_trainer, load_config, metrics
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    def run(out, *overrides):
        cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=4",
                                           "model.dropout=0", *overrides])
        t = build_trainer(cfg, Dist(), torch.device("cpu"))
        noisy = t.raw.forward

        def forward(batch):
            per = F.cross_entropy(t.raw.logits(batch["x"]).transpose(1, 2), batch["y"], reduction="none")
            return (per * 2 * torch.rand(len(per), 1)).sum()  # per: (B, T), a weight per sample

        t.raw.forward = forward
        summary = t.run()
        t.raw.forward = noisy
        return [r["loss"] for r in metrics(out)], summary["val_loss"]

    every, final = run(tmp_path / "every", "train.eval_every=1"), run(tmp_path / "end", "train.eval_every=0")
    assert every == final  # the same training losses, bit for bit, and the same last validation
    assert "note: the model draws random numbers in eval mode" in capsys.readouterr().out


def test_a_text_sample_from_torch_s_own_streams_changes_no_training_step(tmp_path, cache):
    # A generate() that draws from torch's global stream, not the generator it is given (as
    # torch.multinomial does without one): the sample after each validation must leave training's
    # draws (dropout here) as a run that never evaluated has them.
    from conftest import TINY, build_trainer, load_config, metrics
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    def run(out, *overrides):
        cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=4",
                                           "model.dropout=0.2", "train.sample_tokens=4", *overrides])
        t = build_trainer(cfg, Dist(), torch.device("cpu"))
        given = t.raw.generate
        t.raw.generate = lambda prompt, n, generator: given(prompt, n, None)  # multinomial: torch's stream
        t.run()
        return [r["loss"] for r in metrics(out)]

    assert run(tmp_path / "every", "train.eval_every=1") == run(tmp_path / "end", "train.eval_every=0")


def test_validation_without_any_target_stops_the_run_before_anything_is_written(tmp_path, cache):
    # Every y masked (a label mapping gone wrong): named, not val_loss divided by a count of 0 (a
    # ZeroDivisionError traceback). A first batch without targets alone is fine: the probe takes
    # one that has some.
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    def trainer(out: str, masked: int | None):  # the first `masked` validation batches; None: all
        cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / out}", "train.max_steps=2"])
        t = build_trainer(cfg, Dist(), torch.device("cpu"))
        for b in t.evaluator.batches[:masked]:
            b["y"][:] = IGNORE_INDEX
            b["n_targets"] = 0
        return t

    trainer("first", masked=1).run()
    assert (tmp_path / "first" / "summary.json").exists()
    with pytest.raises(BadInput, match=r"^data: the validation batches hold no targets \(every y is -100"):
        trainer("all", masked=None).run()
    assert not (tmp_path / "all").exists()


def test_a_best_metric_the_model_does_not_report_stops_the_run_before_anything_is_written(tmp_path, cache):
    # Which metrics a model reports is known only once it has run: a misspelt train.best_metric is
    # named by the probe, with the ones there are, before run.out_dir is made, not found at the
    # first evaluation, after training and writing.
    out = tmp_path / "run"
    proc = train_here(out, cache, "train.max_steps=4", "train.best_metric=val_los", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config key train.best_metric" in proc.stderr and "(val_loss)" in proc.stderr, proc.stderr
    assert "'val_los'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists(), "nothing is written on the bad-input path"


def test_frozen_parameters_are_counted_apart_and_stay_unchanged(tmp_path, cache, capsys):
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path}", "train.max_steps=3"])
    t = build_trainer(cfg, Dist(), torch.device("cpu"))
    t.raw.wpe.requires_grad_(False)  # position embeddings: 32 positions x 32 wide
    before = t.raw.wpe.weight.detach().clone()
    t.run()
    assert " parameters (1,024 frozen) | cpu | fp32 |" in capsys.readouterr().out
    assert torch.equal(t.raw.wpe.weight, before)  # no gradient, so no update and no weight decay


class PositionsOfItsOwn(torch.nn.Module):
    """A model of a user's own that names its position parameter `wpe`, as the GPT names its table."""

    def __init__(self, vocab_size: int, seq_len: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab_size, 16), torch.nn.Parameter(torch.zeros(seq_len, 16))
        self.head = torch.nn.Linear(16, vocab_size)

    def forward(self, batch: dict) -> torch.Tensor:
        logits = self.head(self.wte(batch["x"]) + self.wpe[: batch["x"].shape[1]])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")


def test_a_model_of_ones_own_trains_whatever_its_attributes_are_named(tmp_path, cache, monkeypatch):
    # Telemetry must not take any model with a `wpe` for the GPT and read `wpe.weight`: an
    # AttributeError after config.yaml and metadata.json are written (and, with an nn.Embedding
    # there, an MFU from the GPT's FLOP formula for a model it does not describe).
    from conftest import summary, train_here

    def mine(cfg: GPTOptions, data) -> PositionsOfItsOwn:  # takes the GPT's keys, which TINY sets
        return PositionsOfItsOwn(data.vocab_size, data.seq_len)

    def extra(cfg: GPTOptions, data) -> PositionsOfItsOwn:
        m = PositionsOfItsOwn(data.vocab_size, data.seq_len)
        m.extra = Extra()
        return m

    monkeypatch.setitem(MODELS, "mine", mine)
    out = tmp_path / "run"
    train_here(out, cache, "model.name=mine", "train.max_steps=2")
    assert summary(out)["steps"] == 2
    # Extra state is refused before anything is written.
    monkeypatch.setitem(MODELS, "extra", extra)
    bad = train_here(tmp_path / "extra", cache, "model.name=extra", check=False)
    assert bad.returncode == 2 and "extra._extra_state, a dict" in bad.stderr and not (tmp_path / "extra").exists()
