"""Gradient accumulation with the loop's rule (sum / step target count) equals one big batch, exactly."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from conftest import Mapped, build_data, build_model, load_config
from data import DATASETS
from data.markov import MarkovOptions, build_markov
from loop.data.bundle import IGNORE_INDEX
from loop.data.sampler import collate, train_loader
from loop.device import pick_device
from loop.distributed.wrap import ddp
from loop.optim import build_optimizer
from loop.precision import Precision
from loop.rng import seed_everything
from loop.schedule import build_scheduler
from loop.trainer import Trainer
from model.gpt import GPT

ROOT = Path(__file__).resolve().parents[1]
B, ACCUM, T, V = 8, 4, 12, 16


def tiny_gpt_f64() -> GPT:
    torch.manual_seed(0)
    return GPT(V, T, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True).double()


def summed_ce_f64(model: GPT, batch: dict) -> torch.Tensor:
    """GPT.forward in float64: forward() casts logits to float32 before the CE (so bf16/fp16
    logits get an fp32 loss), which would cap agreement at ~1e-7; this keeps every op in float64."""
    logits = model.logits(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def batch_of_8(uneven: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    if uneven:  # micro-batches (rows 0-1, 2-3, 4-5, 6-7) keep 24, 17, 11 and 2 of 24 targets
        y[2, :7] = IGNORE_INDEX
        y[4, :] = IGNORE_INDEX
        y[5, 11:] = IGNORE_INDEX
        y[6, 1:] = IGNORE_INDEX
        y[7, 1:] = IGNORE_INDEX
    return {"x": x, "y": y}


def micro_batches(batch: dict) -> list[dict]:
    b = B // ACCUM
    return [collate([{"x": batch["x"][i], "y": batch["y"][i], "idx": i} for i in range(k, k + b)])
            for k in range(0, B, b)]


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def big_batch_grads(model, batch) -> dict:
    n = int((batch["y"] != IGNORE_INDEX).sum())
    (summed_ce_f64(model, batch) / n).backward()
    return grads(model)


def loop_rule_grads(model, batch) -> dict:
    micro = micro_batches(batch)
    n_targets = sum(m["n_targets"] for m in micro)  # as Trainer.step: the whole step's count
    for m in micro:
        (summed_ce_f64(model, m) / n_targets).backward()
    return grads(model)


def naive_rule_grads(model, batch) -> dict:
    micro = micro_batches(batch)
    for m in micro:  # mean over each micro-batch's own targets, divided by the accumulation count
        (summed_ce_f64(model, m) / m["n_targets"] / ACCUM).backward()
    return grads(model)


@pytest.mark.parametrize("uneven", [False, True])
def test_loop_rule_equals_one_big_batch_float64(uneven):
    model = tiny_gpt_f64()
    batch = batch_of_8(uneven)
    counts = [m["n_targets"] for m in micro_batches(batch)]
    assert counts == ([24, 17, 11, 2] if uneven else [24] * 4)
    ref = big_batch_grads(model, batch)
    scale = max(g.abs().max().item() for g in ref.values())
    assert scale > 1e-2  # real gradients, not zeros
    assert max_diff(loop_rule_grads(model, batch), ref) < 1e-12


def test_naive_rule_is_wrong_when_target_counts_differ():
    model = tiny_gpt_f64()
    even, uneven = batch_of_8(False), batch_of_8(True)
    # With equal counts per micro-batch the naive rule happens to coincide ...
    assert max_diff(naive_rule_grads(model, even), big_batch_grads(model, even)) < 1e-12
    # ... with unequal counts it over-weights the 2-target micro-batch and is far off.
    ref = big_batch_grads(model, uneven)
    scale = max(g.abs().max().item() for g in ref.values())
    diff = max_diff(naive_rule_grads(model, uneven), ref)
    assert diff > 0.1 * scale, (diff, scale)
    assert max_diff(loop_rule_grads(model, uneven), ref) < 1e-12


def test_loop_rule_through_model_forward_float32():
    # The real forward() in float32: summation order differs between one batch and four, so the
    # two agree to float32 rounding (~1e-7 relative), not bit for bit.
    torch.manual_seed(0)
    model = GPT(V, T, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    batch = batch_of_8(True)
    n = int((batch["y"] != IGNORE_INDEX).sum())
    (model(batch) / n).backward()
    ref = grads(model)
    for m in micro_batches(batch):
        (model(m) / n).backward()
    scale = max(g.abs().max().item() for g in ref.values())
    assert max_diff(grads(model), ref) < 1e-5 * scale


# -------------------------------------------------------------------------------- the real step
def mask_some(i: int, item: dict) -> dict:
    """Hide a sample-dependent number of targets, so the micro-batches of one step hold different
    target counts (the case where only the loop's rule is exact)."""
    y = item["y"].clone()
    y[: (i * 7) % len(y)] = IGNORE_INDEX
    return {**item, "y": y}


def one_trainer_step(tmp_path, batch_size: int, grad_accum: int, optimizer: str, mask: bool,
                     reduced: list | None = None):
    """One Trainer.step. With `reduced` (a list), the model is in DDP over a one-process gloo
    group, and each bucket the step all-reduces is appended to it."""
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "data.name=markov", f"data.cache_dir={tmp_path / 'cache'}", "data.markov.vocab_size=16",
        "data.markov.tokens=4000", "data.seq_len=16", f"data.batch_size={batch_size}",
        f"train.grad_accum={grad_accum}", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
        "model.dropout=0", "train.precision=fp32", "train.device=cpu", "train.max_steps=1",
        f"run.out_dir={tmp_path / 'run'}", "train.eval_batches=1",
        # SGD runs: no clipping either, so the update is the raw accumulated gradient (clipping
        # to norm 1 would hide a gradient that is off by a constant factor).
        f"train.clip_grad={1.0 if optimizer == 'adamw' else 0}",
    ])
    # As train.py wires it:
    device = pick_device(cfg.train.device)
    seed_everything(cfg.run.seed)
    data = build_data(cfg.data)
    model = build_model(cfg.model, data).to(device)
    if optimizer == "adamw":
        opt = build_optimizer(model, cfg.optim, device)
    else:  # plain SGD: the update is exactly -lr * grad, so the parameters read out the gradient
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_scheduler(opt, cfg.schedule, cfg.train.max_steps)
    precision = Precision(cfg.train.precision, device)
    if mask:
        data.train = Mapped(data.train, mask_some)
    if reduced is not None:
        model = ddp(model, device, find_unused=False)
        model.register_comm_hook(None, lambda group, bucket: reduced.append(bucket.index())
                                 or allreduce_hook(group, bucket))
    trainer = Trainer(cfg, model, data, opt, scheduler, precision, device)
    records = []
    trainer.log = SimpleNamespace(record=lambda fields, loss, gnorm: records.append(
        (fields, loss.item(), gnorm.item())))
    start = {n: p.detach().clone() for n, p in trainer.raw.named_parameters()}
    # As Trainer.run builds the loader (fresh run: position 0).
    loader = iter(train_loader(data.train, cfg.data.batch_size, cfg.run.seed, 0,
                               cfg.data.num_workers, cfg.data.prefetch_factor, False))
    seen = []  # (sample indices, target count) of each micro-batch the step takes
    trainer.feed.batches = (seen.append((b["idx"].tolist(), b["n_targets"])) or b for b in loader)
    trainer.step()
    assert trainer.progress.step == 1 and trainer.progress.samples == 8
    end = {n: p.detach().clone() for n, p in trainer.raw.named_parameters()}
    return start, end, records[0], trainer.progress.tokens, seen


@pytest.mark.parametrize("optimizer, mask", [("adamw", False), ("sgd", False), ("sgd", True)])
def test_trainer_step_accum4x2_equals_accum1x8(tmp_path, optimizer, mask):
    s4, e4, rec4, tok4, seen4 = one_trainer_step(tmp_path, 2, 4, optimizer, mask)
    s1, e1, rec1, tok1, seen1 = one_trainer_step(tmp_path, 8, 1, optimizer, mask)
    assert all(torch.equal(s4[k], s1[k]) for k in s4)  # same seed -> same initial weights
    assert len(seen4) == 4 and len(seen1) == 1
    assert [i for idx, _ in seen4 for i in idx] == seen1[0][0]  # the same 8 samples, same order
    assert tok4 == tok1 == sum(n for _, n in seen4) == seen1[0][1]
    counts = [n for _, n in seen4]
    if mask:  # the micro-batches really hold different numbers of targets
        assert len(set(counts)) > 1 and tok1 < 8 * 16, counts
    else:
        assert counts == [2 * 16] * 4
    moved = max((e1[k] - s1[k]).abs().max().item() for k in e1)
    assert moved > 5e-5  # the step really moved the weights (AdamW: ~lr = 2e-3/20 in warmup)
    # AdamW's first step is ~lr * sign(grad), blind to the gradient's scale; the SGD runs make
    # the parameters a direct readout of the accumulated gradient.
    # fp32: four micro-batch sums vs one batch sum accumulate in a different order, so the
    # results agree to float32 rounding of values of order 1 (~1e-7), not bit for bit.
    diff = max((e4[k] - e1[k]).abs().max().item() for k in e1)
    assert diff < 1e-6, diff
    assert rec4[1] == pytest.approx(rec1[1], rel=1e-6)  # logged step loss (mean per target)
    assert rec4[2] == pytest.approx(rec1[2], rel=1e-5)  # grad norm before clipping
    assert rec4[0]["lr"] == rec1[0]["lr"]


def test_ddp_reduces_the_gradients_once_a_step_not_once_a_micro_batch(tmp_path):
    # Every micro-batch but the last runs forward and backward under DDP's no_sync (DDP decides in
    # forward whether the backward reduces): otherwise each of the k micro-batches all-reduces every
    # bucket, k times the traffic for the same sums. One process: the sums are the gradients
    # themselves, so the weights also come out as without DDP, bit for bit.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        once, by4 = [], []
        one_trainer_step(tmp_path, 8, 1, "adamw", False, reduced=once)
        s4, e4, *_ = one_trainer_step(tmp_path, 2, 4, "adamw", False, reduced=by4)
    finally:
        dist.destroy_process_group()
    assert by4 == once and sorted(once) == list(range(len(once))), (by4, once)  # each bucket once
    _, plain, *_ = one_trainer_step(tmp_path, 2, 4, "adamw", False)
    assert all(torch.equal(e4[k], plain[k]) for k in plain)
    assert not all(torch.equal(e4[k], s4[k]) for k in s4)  # and the step moved them


def prompt_masked(i: int, item: dict) -> dict:
    """A prompt-and-answer sample: the first half of its targets are the prompt, not trained on."""
    y = item["y"].clone()
    y[: len(y) // 2] = IGNORE_INDEX
    return {**item, "y": y}


def markov_prompted(cfg: MarkovOptions):
    d = build_markov(cfg)
    d.train = Mapped(d.train, prompt_masked)
    return d


@pytest.mark.parametrize("lab_break", ["", "mean_loss_per_microbatch"])
def test_the_accumulation_audit_keeps_a_real_target_when_prompts_are_masked(tmp_path, monkeypatch, lab_break):
    # make verify keeps a quarter of the targets in each micro-batch after the first, so the counts
    # differ. Those it keeps must be real targets, not the first *positions*: with masked prompts
    # those are -100 already, the micro-batches could hold no target at all ([64, 0]), and
    # the naive per-micro-batch mean the audit is there to catch would divide 0 by 0 ("no
    # optimizer step was taken", pointing at the learning rate) instead of failing the audit.
    from tools.audit_grads import gradient_audits

    monkeypatch.setitem(DATASETS, "markov_prompted", markov_prompted)
    overrides = ["data.name=markov_prompted", f"data.cache_dir={tmp_path}", "data.markov.tokens=4000",
                 "data.seq_len=32", "data.batch_size=4", "train.grad_accum=2", "model.n_layer=1",
                 "model.n_head=2", "model.n_embd=16", "train.device=cpu", f"run.out_dir={tmp_path / 'run'}",
                 f"lab.break={lab_break}"]
    [result] = gradient_audits(str(ROOT / "configs" / "default.yaml"), overrides, {"accumulation"})
    assert "2 x 4 vs 1 x 8 (targets per micro-batch [64, 16])" in result.numbers, result
    assert result.ok == (not lab_break) and "gradient, norm and loss rel. difference" in result.numbers, result


def micro_batch_trainer(out, cache, *overrides):
    """A TINY trainer (no dropout: two passes over a batch draw the same), its data feed started."""
    from conftest import TINY, build_trainer
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={out}", "model.dropout=0", *overrides])
    trainer = build_trainer(cfg, Dist(), torch.device("cpu"))
    trainer.feed.start()
    return trainer


def spied_forward(trainer) -> list:
    """What each micro-batch's forward got and gave, as (batch, loss), in order."""
    seen, forward = [], trainer.forward

    def spy(batch):
        seen.append((batch, forward(batch)))
        return seen[-1][1]

    trainer.forward = spy
    return seen


def test_the_step_s_micro_batch_losses_are_float32_for_a_model_whose_loss_is_bf16(tmp_path, cache, monkeypatch):
    # Each micro-batch's loss is a sum over its targets (hundreds): kept in the dtype a model returns
    # it in (bf16 from a model kept in bf16), its 8 bits of mantissa would round the step's sum of
    # them, which the logged loss and the finite check read.
    from conftest import gpt_then
    from model import MODELS

    def bf16_loss(m):
        forward = m.forward
        m.forward = lambda batch: forward(batch).to(torch.bfloat16)  # the GPT returns the loss alone
        return m

    monkeypatch.setitem(MODELS, "gpt_bf16_loss", gpt_then(bf16_loss))
    trainer = micro_batch_trainer(tmp_path / "run", cache, "model.name=gpt_bf16_loss")
    trainer.progress.micro_split = 4
    seen, summed, sum_ = spied_forward(trainer), [], trainer.dist.sum_
    trainer.dist.sum_ = lambda t: summed.append(t.clone()) or sum_(t)
    assert trainer.step()
    assert len(seen) > 2 and all(loss.dtype == torch.bfloat16 for _, loss in seen)
    assert summed[0][0].item() == torch.stack([loss.float() for _, loss in seen]).sum().item()


def test_lab_mean_loss_per_microbatch_divides_by_the_step_s_micro_batch_count(tmp_path, cache):
    # lab.break=mean_loss_per_microbatch: each micro-batch's own mean over the micro-batches the
    # step runs, grad_accum x the OOM split (loop/lab.py). Where every micro-batch holds as many
    # targets, that is the true mean: a split into halves leaves the gradients as they were, not
    # doubled (a divisor of grad_accum alone).
    grads = []
    for split in (1, 2):  # two trainers from one seed: the same weights and first batches
        trainer = micro_batch_trainer(tmp_path / str(split), cache, "lab.break=mean_loss_per_microbatch",
                                      "train.clip_grad=0")  # the gradients as made, not clipped to one norm
        trainer.progress.micro_split = split
        seen = spied_forward(trainer)
        trainer.optimizer.register_step_pre_hook(lambda opt, *_: grads.append(
            torch.cat([q.grad.flatten() for g in opt.param_groups for q in g["params"] if q.grad is not None])))
        assert trainer.step()
        assert len({int(batch["n_targets"]) for batch, _ in seen}) == 1  # the mean of means is the mean
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_the_ranks_agree_on_an_out_of_memory_once_per_try_after_its_last_forward(tmp_path, cache, monkeypatch):
    # Attempt.agree is a collective (a host read), once per try, before the backward in which DDP
    # reduces. At every micro-batch it would sync the host that often, and an out of memory in a
    # later micro-batch's forward would count as one amid the gradients' collectives: a run with
    # several processes would end instead of retrying in halves.
    from loop.guards import oom

    trainer = micro_batch_trainer(tmp_path / "run", cache)
    seen, agreed, agree = spied_forward(trainer), [], oom.Attempt.agree

    def counted_agree(self):
        agreed.append(len(seen))  # micro-batches through their forward so far
        agree(self)

    monkeypatch.setattr(oom.Attempt, "agree", counted_agree)
    trainer.progress.micro_split = 2
    assert trainer.step()
    assert len(seen) == 2 * trainer.cfg.train.grad_accum > 2 and agreed == [len(seen)]
