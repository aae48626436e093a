"""AsyncSaver writes the same bytes as store.save, from a real copy taken when save() returns (later
changes to the live tensors do not leak in), re-raises a failed background write in the training
thread, and lands consecutive checkpoints in order, each verifying, with retention applied."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from loop import rng
from loop.checkpoint import store
from loop.checkpoint.async_save import AsyncSaver, snapshot
from loop.ema import EMA
from loop.errors import GaveUp
from model.gpt import GPT

META = {"config_sha256": "abc", "world_size": 1}


def trained_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, object]]:
    """A small GPT after two AdamW steps, and checkpoint files shaped like loop/checkpoint/state.py's."""
    torch.manual_seed(seed)
    model = GPT(vocab_size=17, seq_len=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ema = EMA(model, decay=0.9, warmup=1)
    for _ in range(2):
        x = torch.randint(0, 17, (4, 8))
        model({"x": x, "y": x}).backward()
        opt.step()
        sched.step()
        ema.update(model)
        opt.zero_grad(set_to_none=True)
    base = torch.arange(12.0)
    files = {
        "state.pt": {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "scaler": {}, "ema": ema.state_dict(),
                     "views": {"whole": base, "part": base[3:7]},  # one storage, two tensors
                     "progress": {"step": 2, "skip_windows": [5, 9]}, "config": {"a": {"b": (1, "x")}}},
        "rng_rank0.pt": rng.RngStreams().state_dict(),
    }
    return model, opt, files


def hashes(path: Path) -> dict[str, str]:
    return {k: v["sha256"] for k, v in json.loads((path / store.MANIFEST).read_text())["files"].items()}


def test_same_bytes_as_synchronous_save(tmp_path):
    _, _, files = trained_state()
    sync = store.save(tmp_path / "sync", 2, files, 3, META)
    saver, done = AsyncSaver(), []
    saver.save(tmp_path / "async", 2, files, 3, META, then=done.append)
    saver.close()
    path = tmp_path / "async" / "step_00000002"
    assert done == [path] and store.verify(path) is None
    assert hashes(path) == hashes(sync)
    assert (path / store.MANIFEST).read_bytes() == (sync / store.MANIFEST).read_bytes()


def test_snapshot_keeps_shared_storage_and_is_a_copy():
    model, _, files = trained_state()
    snap = snapshot(files)["state.pt"]
    m = snap["model"]
    assert m["wte.weight"].untyped_storage()._cdata == m["lm_head.weight"].untyped_storage()._cdata
    assert snap["views"]["part"].storage_offset() == 3
    assert m["wte.weight"].data_ptr() != model.wte.weight.data_ptr()
    assert m._metadata == files["state.pt"]["model"]._metadata


def test_changes_after_save_returns_are_not_written(tmp_path, monkeypatch):
    model, opt, files = trained_state()
    expected = store.save(tmp_path / "expected", 2, files, 3, META)  # before any change
    gate, real_save = threading.Event(), store.save

    def gated_save(*args, **kwargs):
        assert gate.wait(60), "the test never released the write"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(store, "save", gated_save)
    saver = AsyncSaver()
    saver.save(tmp_path / "async", 2, files, 3, META)
    # The write is blocked: change everything the training thread could change, in place.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for s in opt.state.values():
        for t in s.values():
            t.mul_(-3.0)
    files["state.pt"]["views"]["whole"].fill_(7.0)
    files["state.pt"]["progress"]["skip_windows"].append(11)
    files["state.pt"]["progress"]["step"] = 99
    assert not (tmp_path / "async" / "step_00000002").exists()
    gate.set()
    saver.close()
    path = tmp_path / "async" / "step_00000002"
    assert store.verify(path) is None
    assert hashes(path) == hashes(expected)
    written = store.load(path, "state.pt")
    assert written["progress"] == {"step": 2, "skip_windows": [5, 9]}
    assert not torch.equal(written["model"]["wte.weight"], model.wte.weight.detach())


@pytest.mark.parametrize("surfaces_in", ["wait", "save", "close"])
def test_background_failure_is_reraised(tmp_path, surfaces_in):
    _, _, files = trained_state()
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("a file where the checkpoint root should be")
    saver = AsyncSaver()
    saver.save(blocked, 1, files, 3, META)  # returns: the failure happens in the background
    with pytest.raises(GaveUp, match=r"cannot write it in .*not_a_dir \(File exists\)"):
        if surfaces_in == "wait":
            saver.wait()
        elif surfaces_in == "save":
            saver.save(tmp_path / "ok", 2, files, 3, META)
        else:
            saver.close()
    saver.wait()  # raised once, then cleared
    assert not (tmp_path / "ok").exists()  # a save that re-raises does not start a new write


def test_saves_land_in_order_and_retention_applies(tmp_path):
    model, _, files = trained_state()
    saver, done, root = AsyncSaver(), [], tmp_path / "ckpt"
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            model.wte.weight.fill_(float(step))
        files["state.pt"]["progress"]["step"] = step
        saver.save(root, step, files, 2, META, keep={"step_00000001"}, then=done.append)
    saver.close()
    names = [f"step_{s:08d}" for s in (1, 2, 3, 4)]
    assert done == [root / n for n in names]  # `then` ran once per save, in order
    assert [p.name for p in store.step_dirs(root)] == [names[0], names[2], names[3]]
    assert (root / "latest").read_text() == names[3]
    for path in store.step_dirs(root):
        assert store.verify(path) is None
        state, step = store.load(path, "state.pt"), int(path.name[5:])
        assert state["progress"]["step"] == step
        assert torch.all(state["model"]["wte.weight"] == step)
        assert torch.all(state["model"]["lm_head.weight"] == step)  # still tied in the file
    with pytest.raises(RuntimeError, match="after close"):
        saver.save(root, 5, files, 2, META)


def test_a_run_whose_last_background_write_fails_fails_too(tmp_path, cache, monkeypatch):
    # train.async_save: the end-of-run checkpoint is written after the last step; a write that fails
    # there is raised by the run's close, not lost with its thread (exit 0 and no last checkpoint).
    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    def refused(root, step, *args):
        raise GaveUp(f"checkpoint step {step}: disk full")

    monkeypatch.setattr(store, "save", refused)  # looked up at call time by the writer thread
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=2",
                                       "train.ckpt_every=0", "train.eval_every=0", "train.async_save=true"])
    with pytest.raises(GaveUp, match="checkpoint step 2: disk full"):
        build_trainer(cfg, Dist(), torch.device("cpu")).run()
