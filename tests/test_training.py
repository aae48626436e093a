"""End-to-end training proofs: the run directory honours its contract, the model reaches the known
optimum of the synthetic task, bf16 learns on CPU, and fp16's GradScaler state survives a resume."""
from __future__ import annotations

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    assert_wall_time_sums_the_steps,
    load_config,
    metrics,
    run_and_kill,
    run_train,
    summary,
    train_here,
)

MARKOV = ["data.name=markov", "model.n_embd=64", "model.dropout=0", "data.batch_size=16",
          "train.log_every=50", "train.eval_every=50", "train.eval_batches=4"]


@pytest.mark.slow
def test_run_directory_contract(tmp_path, cache):
    out = tmp_path / "run"
    proc = run_train(out, cache, "train.max_steps=20", "train.ckpt_every=10", "optim.betas.1=0.99")
    assert load_config(out / "config.yaml").optim.betas == [0.9, 0.99]
    meta = json.loads((out / "metadata.json").read_text())
    assert len(meta["git"]["commit"]) == 40 and meta["versions"]["torch"] == torch.__version__
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 21))
    assert all({"step", "loss", "lr", "grad_norm"} <= r.keys() for r in recs)
    assert [r["step"] for r in recs if "val_loss" in r] == [10, 20]
    assert [r["step"] for r in recs if "sample" in r] == [10, 20]  # a text sample at each eval
    s = summary(out)
    assert {"steps", "final_loss", "val_loss", "params_sha256", "wall_s", "tokens_per_s"} <= s.keys()
    assert s["steps"] == 20 and s["final_loss"] == recs[-1]["loss"] and s["val_loss"] == recs[-1]["val_loss"]
    assert s["tokens"] == 20 * 8 * 32 and isinstance(s["sample"], str) and len(s["sample"]) == 24
    assert s["tokens_per_s"] == s["tokens"] / s["wall_s"]  # tokens, not samples, over training time
    assert_wall_time_sums_the_steps(s, recs)

    # TensorBoard holds the same losses (TB stores float32; our losses are float32 values).
    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(r["step"], r["loss"]) for r in recs]
    # The samples, in TensorBoard's text tab: one at each evaluation, the last not again at the end.
    assert [e.step for e in ea.Tensors("sample/text_summary")] == [10, 20]
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    assert [e.value for e in ea.Scalars("val/loss")] == pytest.approx(val, rel=1e-6)  # float32 there
    assert not [t for t in ea.Tags()["scalars"] if t.startswith("train/val")]  # one tag for each value
    # The console says every evaluation's metrics, beside the step lines.
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("eval ")] == \
        [f"val_loss {v:.4f}" for v in val], proc.stdout

    # Checkpoints: manifest, only tensors and primitives (weights_only load), the final weights.
    ckpt = out / "checkpoints" / "step_00000020"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["progress"]["step"] == 20 and state["progress"]["samples"] == 20 * 8
    assert set(torch.load(ckpt / "rng_rank0.pt", weights_only=True)) >= {"python", "numpy", "torch"}
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert (out / "checkpoints" / "latest").read_text() == "step_00000020"
    report = (out / "report.md").read_text()  # written at the end of every run
    assert "| run | finished | cpu x1 | 20 | 5,120 |" in report, report
    assert "## Samples" in report and s["sample"] in report


@pytest.mark.slow
def test_markov_reaches_its_entropy_rate(tmp_path, cache):
    out = tmp_path / "run"
    train_here(out, cache, *MARKOV, "train.max_steps=300")
    s = summary(out)
    # The chain's entropy rate is the best possible loss; 300 steps get within 0.05 nats of it
    # (seen: ~1.12 vs 1.09).
    assert s["optimal_loss"] < s["val_loss"] < s["optimal_loss"] + 0.05, s


def test_bf16_autocast_on_cpu_learns(tmp_path, cache):
    out = tmp_path / "run"
    train_here(out, cache, *MARKOV, "train.max_steps=100", "train.precision=bf16", "train.log_every=1")
    recs, s = metrics(out), summary(out)
    assert s["precision"] == "bf16"
    assert recs[0]["loss"] > math.log(32) - 0.2  # starts near uniform over 32 tokens
    assert s["val_loss"] < s["optimal_loss"] + 0.35, s


@pytest.mark.slow
def test_fp16_grad_scaler_state_survives_resume(tmp_path, cache):
    args = [cache, "train.precision=fp16", "train.max_steps=20", "train.ckpt_every=10"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, *args)
    scaler = torch.load(ref / "checkpoints" / "step_00000010" / "state.pt", weights_only=True)["scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] == 10  # ten clean steps since start
    run_and_kill(out, 14, *args)
    run_train(out, *args)
    assert summary(out)["precision"] == "fp16"
    assert summary(out)["params_sha256"] == summary(ref)["params_sha256"]
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]
    # The losses alone cannot tell a fresh scaler (nothing overflows in 20 steps): its state can.
    last = [torch.load(d / "checkpoints" / "step_00000020" / "state.pt", weights_only=True)["scaler"]
            for d in (ref, out)]
    assert last[0] == last[1] and last[0]["_growth_tracker"] == 20


def test_sample_tokens_0_draws_no_sample(tmp_path, cache):
    # As the benchmarks run: no text at all, not the prompt decoded alone.
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=2", "train.sample_tokens=0")
    assert summary(out)["sample"] is None and not any("sample" in r for r in metrics(out))


def test_a_run_of_no_steps_has_no_rate(tmp_path, cache):
    # No training time: tokens_per_s is null (no rate was measured), not a measured 0 tokens/s.
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=0")
    s = summary(out)
    assert (s["steps"], s["tokens"], s["wall_s"], s["tokens_per_s"]) == (0, 0, 0.0, None)


def test_rerunning_a_finished_run_logs_its_sample_once(tmp_path, cache):
    # The rerun resumes at the last step and validates for summary.json; the sample of that step
    # is in TensorBoard already (TensorBoard keeps the resumed step's events), so not again.
    out = tmp_path / "run"
    for _ in range(2):
        train_here(out, cache, "train.max_steps=3")
    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    assert [e.step for e in ea.Tensors("sample/text_summary")] == [3]
    assert metrics(out)[-1]["sample"] == summary(out)["sample"]


def test_the_summary_validates_the_final_weights(tmp_path, cache, monkeypatch):
    # Evaluations at steps 10 and 20 of a 25-step run, and at its last: summary.json's val_loss is
    # that of the weights the run ends with, logged like the others, equal to a run that evaluates
    # every 5 steps (evaluating does not change training), not step 20's; and measured once.
    from loop.evaluate import Evaluator

    validate, validated = Evaluator.validate, []
    monkeypatch.setattr(Evaluator, "validate", lambda e: validated.append(e.progress.step) or validate(e))
    every10, every5 = tmp_path / "every10", tmp_path / "every5"
    train_here(every10, cache, "train.max_steps=25", "train.eval_every=10")
    train_here(every5, cache, "train.max_steps=25", "train.eval_every=5")
    at = {r["step"]: r["val_loss"] for r in metrics(every10) if "val_loss" in r}
    assert sorted(at) == [10, 20, 25]
    assert summary(every10)["val_loss"] == at[25] == metrics(every5)[-1]["val_loss"] != at[20]
    assert summary(every10)["params_sha256"] == summary(every5)["params_sha256"]
    assert validated == [10, 20, 25, 5, 10, 15, 20, 25]


def test_the_console_says_a_step_line_every_log_interval_and_at_the_last_only(tmp_path, cache):
    # A checkpoint writes the metrics before it: its flush printed a step line too (at every
    # checkpoint and new best), and the console lines came at 3, 4, 5, 6, 8, ...
    import re

    proc = train_here(tmp_path / "run", cache, "train.max_steps=13", "train.log_every=4", "train.ckpt_every=5",
                      "train.eval_every=3")
    assert [int(s) for s in re.findall(r"^step +(\d+)/", proc.stdout, re.M)] == [4, 8, 12, 13], proc.stdout
    assert [int(s) for s in re.findall(r"^eval +(\d+)/", proc.stdout, re.M)] == [3, 6, 9, 12, 13], proc.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 14))


def test_the_start_line_s_global_batch_counts_every_process(monkeypatch):
    # What a run says it trains on: data.batch_size x train.grad_accum is one process's share, and
    # the global batch (what the learning rate is tuned for) is that share over every process.
    from loop.observe.summary import start_line

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # no backend to name
    m = torch.nn.Linear(3, 2)
    line = start_line(m, m, False, torch.device("cpu"), "fp32", world=2, batch=8, seq_len=32)
    assert "| 2 process(es)," in line and line.endswith("| global batch 16 samples of 32 target(s)"), line
    one = start_line(m, m, False, torch.device("cpu"), "fp32", world=1, batch=8, seq_len=32)
    assert one.endswith("global batch 8 samples of 32 target(s)"), one
    m.bias.requires_grad_(False)  # a frozen part is counted apart: 8 parameters, 2 of them not trained
    assert start_line(m, m, False, torch.device("cpu"), "fp32", world=1, batch=8, seq_len=32) \
        .startswith("8 parameters (2 frozen) | cpu | fp32 | 1 process(es), no process group |")
