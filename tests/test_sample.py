"""Proves `python -m tools.sample` rebuilds the trained model from what a run leaves: from model.pt
(its weights or its EMA) and from a checkpoint, it draws the very text the run drew at its end
(summary.json's sample: same prompt, seed and length), a model on token files takes and prints
token ids, an empty prompt starts from token 0, and bad input is exit 2 naming it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, run_train, summary, train_here
from tools import sample

# The run's train.sample_tokens (set below) and run.seed. 300 tokens: 16 drawn from the EMA and the
# raw weights of a near-random model with one generator come out the same, so a sample drawn from
# the raw weights would pass for the EMA's.
SAMPLE = ["--tokens", "300", "--seed", "1337"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("sample") / "run"
    run_train(out, cache, "train.max_steps=20", "train.ckpt_every=20", "ema.enabled=true",
              "train.sample_tokens=300")
    return out


def drawn(capsys, *argv: str) -> tuple[int, str, str]:
    code = sample.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_the_exported_ema_and_the_checkpoint_draw_the_runs_own_text(run, capsys):
    text = summary(run)["sample"]  # drawn from the EMA weights (validation's), after 8 prompt characters
    code, out, _ = drawn(capsys, run, "--ema", "--prompt", text[:8], *SAMPLE)
    assert code == 0 and out == text + "\n"
    assert drawn(capsys, run / "model.pt", "--prompt", text[:8], *SAMPLE)[1] != out  # not the raw weights'
    # The raw weights, then the step-20 checkpoint's (the same).
    longer = ["--prompt", text[:8], "--tokens", "300"]
    code, ema, _ = drawn(capsys, run, "--ema", *longer)
    code, from_model, _ = drawn(capsys, run / "model.pt", *longer)
    assert code == 0 and from_model.startswith(text[:8]) and len(from_model) == 309 and from_model != ema
    code, from_ckpt, _ = drawn(capsys, run / "checkpoints" / "latest", *longer)
    assert code == 0 and from_ckpt == from_model
    assert drawn(capsys, run, *longer, "--seed", "1")[1] != from_model
    assert drawn(capsys, run, *longer, "--temperature", "0.3")[1] != from_model


@pytest.mark.slow
def test_a_model_whose_generate_takes_no_temperature(run, capsys, monkeypatch):
    # The trainer's sample calls generate(prompt, n, generator), so a model of yours may have no
    # temperature; this command passes one only when asked, or such a model is a TypeError
    # traceback.
    from model.gpt import GPT

    text = summary(run)["sample"]
    own = GPT.generate
    monkeypatch.setattr(GPT, "generate", lambda self, idx, n, generator: own(self, idx, n, generator))
    assert drawn(capsys, run, "--ema", "--prompt", text[:8], *SAMPLE)[:2] == (0, text + "\n")
    assert drawn(capsys, run, "--temperature", "0.5") == (
        2, "", "error: option --temperature: this model's generate() (GPT) takes no temperature; "
               "leave the option out.\n")


@pytest.mark.slow
@pytest.mark.parametrize("argv, says", [
    (["--prompt", "☃"], "error: option --prompt: '☃' not in the model's vocabulary (the 103 characters "
                        "of its training text).\n"),
    (["--device", "nope"], "error: option --device: expected auto, cpu, cuda, cuda:N or mps; got 'nope'.\n"),
])
def test_bad_input_is_exit_2_naming_it(run, capsys, argv, says):
    assert drawn(capsys, run, *argv) == (2, "", says)


@pytest.mark.slow
def test_what_holds_no_model_is_exit_2(run, capsys, tmp_path):
    for checkpoint in (run / "checkpoints" / "latest", run / "checkpoints" / "step_00000020" / "state.pt"):
        code, out, err = drawn(capsys, checkpoint, "--ema")  # a state.pt is its checkpoint's
        assert (code, out) == (2, "") and "--ema reads a finished run's model.pt" in err, err
    code, out, err = drawn(capsys, tmp_path)
    assert (code, out, err) == (2, "", f"error: {tmp_path}: expected a run directory with model.pt, "
                                       f"a model.pt, or a checkpoint directory.\n")
    code, out, err = drawn(capsys, run / "checkpoints")  # the folder, not one of its checkpoints
    assert code == 2 and f"holds checkpoints: the newest is {run / 'checkpoints' / 'step_00000020'}" in err, err
    # A seed past 64 bits or a negative one: exit 2, not a ValueError traceback from manual_seed.
    for bad, says in ((["--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
                      (["--temperature", "0"], "--temperature: expected a finite number > 0, got '0'"),
                      (["--temperature", "-1"], "--temperature: expected a finite number > 0, got '-1'"),
                      (["--seed", str(2**64)], f"--seed: expected an integer from 0 to {2**64 - 1}, got {2**64}"),
                      (["--seed", "-1"], f"--seed: expected an integer from 0 to {2**64 - 1}, got -1")):
        with pytest.raises(SystemExit) as e:
            sample.main([str(run), *bad])
        assert e.value.code == 2 and says in capsys.readouterr().err, bad
    assert drawn(capsys, run, "--seed", str(2**64 - 1), "--tokens", "5")[0] == 0


@pytest.mark.slow
def test_a_model_pt_the_run_has_trained_past_is_sampled_and_said(run, capsys, tmp_path):
    # A finished run resumed for more steps: its model.pt (and summary.json) are from its first
    # end, checkpoints/latest is newer. The weights asked for are sampled, and the note says so.
    shutil.copytree(run, tmp_path / "run")
    end = json.loads((tmp_path / "run" / "summary.json").read_text())
    (tmp_path / "run" / "summary.json").write_text(json.dumps({**end, "steps": 10}))  # its first end
    code, out, err = drawn(capsys, tmp_path / "run", "--tokens", "5")
    assert code == 0 and out == drawn(capsys, run, "--tokens", "5")[1]
    assert "holds step 10's weights" in err and "step_00000020" in err
    assert "note" not in drawn(capsys, run, "--tokens", "5")[2]  # the run as it ended: nothing to say


@pytest.mark.slow
def test_weights_that_do_not_fit_their_own_config_blame_the_code(run, capsys, tmp_path):
    # Its config rebuilds the model; if the model code changed since, the shapes say so (exit 2).
    export = torch.load(run / "model.pt", weights_only=True)
    export["config"]["model"]["n_layer"] = 3  # what a builder that now makes one block more would do
    torch.save(export, tmp_path / "model.pt")
    code, out, err = drawn(capsys, tmp_path / "model.pt")
    assert (code, out) == (2, "") and "blocks.2.attn.qkv.weight: missing from checkpoint" in err
    assert err.endswith("\nIt was trained with this config's model.* keys and data.seq_len: the data's "
                        "vocabulary or the model code differs. Use the model code it was trained with.\n")


@pytest.mark.slow
def test_an_empty_prompt_starts_from_token_0(run, capsys):
    first = sample.load(run, False, torch.device("cpu"))[1].meta["chars"][0]  # "\n" in most texts
    code, out, _ = drawn(capsys, run, *SAMPLE)
    assert code == 0 and len(out) == 1 + 300 + 1 and out == drawn(capsys, run, "--prompt", first, *SAMPLE)[1]


def test_a_token_file_model_takes_and_prints_token_ids(tmp_path, cache, capsys):
    # data.name=markov: token files (16 ids) with no characters to them, as a tokenizer's output.
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    out = tmp_path / "run"
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={out}", "data.name=markov",
                                       "data.markov.vocab_size=16", "train.max_steps=2"])
    build_trainer(cfg, Dist(), torch.device("cpu")).run()
    capsys.readouterr()  # the run's console
    code, text, _ = drawn(capsys, out, "--prompt", "3 1 4", "--tokens", "16")
    ids = [int(i) for i in text.split()]
    assert code == 0 and ids[:3] == [3, 1, 4] and len(ids) == 3 + 16 and set(ids) <= set(range(16))
    code, text, _ = drawn(capsys, out, "--tokens", "16")  # no prompt: token 0
    assert code == 0 and text.split()[0] == "0" and len(text.split()) == 1 + 16
    for prompt, says in [("3 x", "'3 x'; this model reads token ids, expected integers separated by spaces."),
                         ("15 16", "token ids [16] outside the vocabulary (0 to 15)."),
                         ("-1", "token ids [-1] outside the vocabulary (0 to 15).")]:
        assert drawn(capsys, out, "--prompt", prompt) == (2, "", f"error: option --prompt: {says}\n")


def test_a_corpus_edited_since_training_is_exit_2(tmp_path, cache, capsys):
    # Its characters are the vocabulary: "w" replaced by "q" gives as many characters in another
    # order, and the text would come out decoded with the wrong ones ("hir yella uuuoq" for "his
    # yella wwwor"), exit 0. The sha256 the run recorded names the change, for model.pt and a
    # checkpoint.
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; a wolf howls\n" * 40)
    out = tmp_path / "run"
    train_here(out, *TINY, cache, f"data.path={text}", "train.max_steps=2")
    assert drawn(capsys, out, "--tokens", "5")[0] == 0
    trained = text.read_text()
    text.write_text(trained.replace("w", "q"))
    for where in (out, out / "checkpoints" / "latest"):
        code, printed, err = drawn(capsys, where, "--tokens", "5")
        assert (code, printed) == (2, ""), err
        assert "now holds" in err and "expected the text it was trained on there" in err, err
    # Resumed on the edited corpus and killed before its end: metadata.json names the new corpus,
    # but model.pt is still the finished run's, trained on the old one. ("ж" for "w": as many
    # characters, so the checkpoint fits.)
    text.write_text(trained.replace("w", "ж"))
    killed = run_train(out, *TINY, cache, f"data.path={text}", "train.max_steps=4", "faults.kill_in_ckpt_at_step=4",
                       check=False)
    assert killed.returncode == -9 and "data differs" in killed.stdout, killed.stdout + killed.stderr
    code, printed, err = drawn(capsys, out, "--tokens", "5")
    assert (code, printed) == (2, "") and "now holds" in err, err


@pytest.mark.slow
def test_a_long_text_is_printed_as_it_comes_and_is_the_text_of_one_call(run, capsys):
    # --tokens 100000000000000000000 is accepted and prints at once, not nothing for minutes: the
    # text comes in chunks of 64 tokens, each printed as it is drawn, from one generator drawn in
    # order.
    from tools.sample import load, stream

    model, data = load(run, False, torch.device("cpu"))
    prompt = torch.tensor([[0]])
    whole = model.generate(prompt, 150, torch.Generator().manual_seed(3))[0].tolist()
    calls, generate = [], model.generate
    model.generate = lambda ids, n, g, **o: calls.append(n) or generate(ids, n, g, **o)
    stream(model, prompt, 150, torch.Generator().manual_seed(3), {}, data.decode)
    assert calls == [64, 64, 22]
    assert capsys.readouterr().out == data.decode(whole) + "\n"


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_it_quietly(run):
    # `tools.sample RUN | head -c 100`: exit 141 (SIGPIPE's), as train.py's, without a traceback.
    proc = subprocess.run(f"{sys.executable} -m tools.sample {run} --tokens 100000 | head -c 100; "
                          f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", cwd=ROOT,
                          capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 141 and len(proc.stdout) == 100, err  # bytes: head -c cut a character
    assert "Traceback" not in err and "Exception" not in err, err


@pytest.mark.slow
def test_a_diverged_model_is_exit_2_not_a_traceback(run, capsys, tmp_path):
    # Finite weights whose forward overflows, as a run that diverged in its last steps exports them
    # (its val_loss not finite): torch.multinomial refuses the NaN probabilities. Embeddings near
    # float32's largest overflow in every sum that reads them (the layer norms' means; attention
    # scores may not, as the CPU's fused attention kernels treat an infinite score their own way).
    export = torch.load(run / "model.pt", weights_only=True)
    for name in ("wte.weight", "lm_head.weight"):
        export["model"][name].fill_(3e38)
    torch.save(export, tmp_path / "model.pt")
    code, out, err = drawn(capsys, tmp_path / "model.pt", "--tokens", "5")
    assert code == 2 and str(tmp_path / "model.pt") in err and "Traceback" not in err, err


def test_a_prompt_is_read_as_the_data_set_decodes():
    # A token directory whose meta.json lists characters without saying kind: chars trains on ids
    # and prints ids (data/tokens.py); its prompt is ids too, not characters.
    from types import SimpleNamespace

    ids = SimpleNamespace(meta={"kind": "tokens", "chars": "abcdefghij"}, vocab_size=10)
    assert sample.encode("1 2", ids) == [1, 2]
    chars = SimpleNamespace(meta={"kind": "chars", "chars": "abcdefghij"}, vocab_size=10)
    assert sample.encode("cab", chars) == [2, 0, 1]
