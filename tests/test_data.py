"""The data order is a pure function of (seed, position), loaders leave global RNG alone, prep is exact."""
from __future__ import annotations

import errno
import json
import math
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

from conftest import build_data, data_options, load_config
from data import corpus
from data.corpus import held_out, prepare_text
from data.markov import MarkovConfig, entropy_rate, prepare_markov, transition_matrix
from data.tokens import TokenWindows
from loop.config.load import DEFAULT_CONFIG
from loop.config.runtime import idle_settings
from loop.data.bundle import Data, check_samples
from loop.data.sampler import StreamSampler, collate, epoch_order, split_batch, train_loader, val_batches
from loop.data.seeded import SeededSamples
from loop.errors import BadInput
from loop.precision import Precision

SEQ, BS = 16, 8


@pytest.fixture(scope="module")
def markov(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return build_data(data_options("markov", cache_dir=str(cache), seq_len=SEQ,
                                 markov=MarkovConfig(vocab_size=16, tokens=4000)))


# ------------------------------------------------------------------------------- sampler
def take(n: int, seed: int, start: int, count: int) -> list[int]:
    pairs = list(islice(iter(StreamSampler(n, seed, start)), count))
    assert [g for g, _ in pairs] == list(range(start, start + count))  # global positions
    return [i for _, i in pairs]


def test_stream_from_g_is_the_tail_of_the_stream_from_0():
    full = take(10, 7, 0, 35)
    for g in (1, 9, 10, 12, 20, 29):  # mid-epoch, at and across epoch boundaries
        assert take(10, 7, g, 35 - g) == full[g:], g
    assert take(10, 7, 12, 23) == full[12:]


def test_each_epoch_is_a_fresh_permutation():
    full = take(10, 7, 0, 40)
    epochs = [full[k : k + 10] for k in range(0, 40, 10)]
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(10))
        assert order == epoch_order(10, 7, e).tolist()
    assert len({tuple(e) for e in epochs}) == 4  # every epoch differs
    assert take(10, 8, 0, 10) != epochs[0]  # and the seed matters
    assert take(1000, 7, 0, 1000) != list(range(1000))  # it shuffles


# ------------------------------------------------------------------------------- loader
def batches(ds, start: int, workers: int, count: int) -> list[dict]:
    loader = train_loader(ds, BS, seed=5, start=start, num_workers=workers, prefetch_factor=2,
                          pin_memory=False)
    it = iter(loader)
    out = [next(it) for _ in range(count)]
    del it  # shuts persistent workers down
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["idx"], y["idx"]) and torch.equal(x["x"], y["x"]) and torch.equal(x["y"], y["y"])
        and x["n_targets"] == y["n_targets"] for x, y in zip(a, b))


def test_loader_workers_and_start_position(markov):
    ds = markov.train
    n = len(ds)
    assert n == (3600 - 1) // SEQ == 224  # 4000 tokens, 10% to validation
    count = 40  # 320 samples: crosses the epoch boundary at 224
    rng_before = torch.get_rng_state()
    b0 = batches(ds, 0, 0, count)
    b2 = batches(ds, 0, 2, count)
    assert same(b0, b2)
    assert [i for b in b0 for i in b["idx"].tolist()] == take(n, 5, 0, count * BS)
    assert all(b["x"].shape == (BS, SEQ) and b["n_targets"] == BS * SEQ for b in b0)
    assert torch.equal(b0[3]["x"][1], ds[int(b0[3]["idx"][1])]["x"])
    for p in (3 * BS, 30 * BS):  # mid-epoch, and past the epoch boundary
        assert same(batches(ds, p, 0, count - p // BS), b0[p // BS :]), p
    assert same(batches(ds, 3 * BS, 2, 10), b0[3:13])
    # The loader seeds its workers from its own generator, never from the global stream.
    assert torch.equal(torch.get_rng_state(), rng_before)
    # ...and the global stream does not steer the order either.
    torch.manual_seed(12345)
    assert same(batches(ds, 0, 0, 5), b0[:5])


def test_augmentation_is_a_function_of_the_sample_position(markov):
    # A Dataset that augments from the global streams: loop/data/seeded.py seeds each sample's draws
    # from its position. DataLoader workers' own streams are reseeded at every iterator start and
    # dealt round-robin: drawn from those, workers=2 and a start mid-stream would each give other
    # masks than workers=0 from the top (and a resumed run other ones).
    from conftest import Mapped, augment

    ds = Mapped(markov.train, augment)
    streams = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    b0 = batches(ds, 0, 0, 12)
    # num_workers=0 fetches in this process: its own streams (dropout's) are left as they were.
    assert random.getstate() == streams[0]
    assert np.array_equal(np.random.get_state()[1], streams[1])
    assert torch.equal(torch.get_rng_state(), streams[2])
    masked = [float((b["x"] == 0).float().mean()) for b in b0]
    assert all(0.2 < m < 0.4 for m in masked), masked  # ~0.28 masked: the augmentation does run
    assert same(batches(ds, 0, 2, 12), b0)
    assert same(batches(ds, 5 * BS, 2, 7), b0[5:])
    assert same(batches(ds, 5 * BS, 0, 7), b0[5:])
    # Whatever the process count: rank r's slice of a global batch gets the same draws.
    for k in range(3):
        halves = [next(iter(train_loader(ds, BS // 2, 5, k * BS, 0, 2, False, rank=r, world=2)))
                  for r in (0, 1)]
        assert torch.equal(torch.cat([h["x"] for h in halves]), b0[k]["x"]), k
    # The same sample draws anew at another position (its next epoch) and with another run.seed.
    g, i = 3, int(b0[0]["idx"][3])
    assert torch.equal(SeededSamples(ds, 5)[(g, i)]["x"], b0[0]["x"][3])
    assert not torch.equal(SeededSamples(ds, 5)[(g + len(ds), i)]["x"], b0[0]["x"][3])
    assert not torch.equal(SeededSamples(ds, 6)[(g, i)]["x"], b0[0]["x"][3])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_error_ends_the_run_with_its_traceback(tmp_path, cache, workers):
    # With workers, the error's traceback must not keep the DataLoader iterator alive to the
    # interpreter's exit, whose terminate cannot stop workers that ignore SIGTERM: train.py would
    # hang forever.
    from conftest import ROOT, TINY

    cmd = [sys.executable, "tests/more_models.py", f"run.out_dir={tmp_path / 'run'}", *TINY,
           cache, "data.name=text_broken", "train.max_steps=2000",
           f"data.num_workers={workers}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"ValueError: sample \d+ cannot be read$", proc.stderr.rstrip()), proc.stderr[-2000:]


def test_val_batches_fixed_and_rng_free(markov):
    ds = markov.val
    assert len(ds) == (400 - 1) // SEQ == 24
    rng_before = torch.get_rng_state()
    a = val_batches(ds, 4, 3, seed=1337)
    torch.manual_seed(0)  # whatever the global stream does in between
    b = val_batches(ds, 4, 3, seed=1337)
    torch.set_rng_state(rng_before)
    c = val_batches(ds, 4, 3, seed=1337)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert len(a) == 3 and same(a, b) and same(a, c)
    idx = [i for batch in a for i in batch["idx"].tolist()]
    assert len(set(idx)) == 12 and all(0 <= i < 24 for i in idx)
    assert not same(a, val_batches(ds, 4, 3, seed=1))


def test_the_validation_set_is_eval_batches_micro_batches_whatever_grad_accum(markov):
    # Without train.global_batch the set is train.eval_batches x data.batch_size samples (x the
    # processes): train.grad_accum leaves it alone, so runs that accumulate differently report
    # val_loss on one set. With train.global_batch it is eval_batches steps' samples.
    from types import SimpleNamespace

    from loop.distributed.group import Dist
    from loop.evaluate import Evaluator

    def batches(*overrides):
        cfg = load_config(DEFAULT_CONFIG, ["data.batch_size=2", "train.eval_batches=3", *overrides])
        ev = Evaluator(None, SimpleNamespace(val=markov.val), cfg, None, torch.device("cpu"), Dist(),
                       False, None)
        return ev.batches

    one = batches("train.grad_accum=1")
    assert len(one) == 3 and same(one, batches("train.grad_accum=4"))
    assert len(batches("train.grad_accum=4", "train.global_batch=8")) == 12


def test_preparing_never_touches_another_process_s_temp_dir(tmp_path):
    # The same PID in another PID namespace (a container sharing the cache): a temp dir named by
    # the PID alone was deleted by one process while the other wrote into it.
    theirs = tmp_path / f".corpus.tmp-{os.getpid()}"
    theirs.mkdir()
    (theirs / "train.bin").write_bytes(b"half written")
    out = corpus.write_tokens(tmp_path / "corpus", np.arange(100, dtype=np.uint16), 0.1, {})
    assert (out / "meta.json").exists() and (theirs / "train.bin").read_bytes() == b"half written"


def test_an_augmenting_validation_split_draws_from_streams_of_its_own(markov):
    # Drawn unseeded, the validation set's augmentation took from the training streams: the
    # number of samples fetched (train.eval_batches, the batch size, the process count) changed
    # training's dropout from step 1, and each set's draws depended on where the streams stood.
    from conftest import Mapped, augment

    ds = Mapped(markov.val, augment)
    streams = lambda: (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())  # noqa: E731
    before = streams()
    one = val_batches(ds, 4, 1, seed=1337)
    three = val_batches(ds, 4, 3, seed=1337)
    after = streams()
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]
    assert not same(one, val_batches(markov.val, 4, 1, seed=1337))  # it augments
    every = {i: x for b in val_batches(ds, 4, 6, seed=1337) for i, x in zip(b["idx"].tolist(), b["x"])}
    assert len(every) == len(ds)  # a sample is drawn the same in any set: one, three or six batches
    halves = [val_batches(ds, 4, 3, 1337, r, 2) for r in range(2)]  # or either of two processes
    for batches in (one, three, *halves):
        assert all(torch.equal(every[i], x) for b in batches for i, x in zip(b["idx"].tolist(), b["x"]))


def test_val_batches_give_every_rank_as_many_batches(markov):
    # 24 samples, batch 8, 2 batches asked: with 3 processes each rank evaluates 8 samples (one
    # batch); with 5, 4 each (24 // 5), so 20 of them. Handing out global batches slice by slice
    # would give 4 processes of batch 4 8, 8, 4 and 4 samples: (2, 2, 1, 1) batches. Under FSDP,
    # where each forward is a collective, ranks 0 and 1 would wait forever in their second.
    def shares(batch, world):
        ranks = [val_batches(markov.val, batch, 2, 1337, r, world) for r in range(world)]
        return [[len(b["idx"]) for b in batches] for batches in ranks], ranks

    assert shares(8, 3)[0] == [[8]] * 3
    assert shares(4, 4)[0] == [[4, 2]] * 4
    assert shares(8, 5)[0] == [[4]] * 5
    one = [i for b in val_batches(markov.val, 8, 2, 1337) for i in b["idx"].tolist()]
    two = [i for batches in shares(4, 2)[1] for b in batches for i in b["idx"].tolist()]
    assert len(one) == 16 and sorted(one) == sorted(two)  # the same set as 1 process with batch 8
    for rank in range(30):  # every rank refuses, so none waits in a collective for the others
        with pytest.raises(BadInput, match=r"the validation split holds 24 samples; expected at "
                                           r"least one per process \(30\)"):
            val_batches(markov.val, 8, 1, 1337, rank, 30)



def test_a_last_validation_batch_of_one_sample_is_evaluated(markov):
    # The validation set's last batch may hold one sample (a batch size of 1, or a split that ends
    # one past a whole batch): it is evaluated like any other, not dropped.
    assert [len(b["idx"]) for b in val_batches(markov.val, 1, 3, seed=1337)] == [1, 1, 1]
    last = val_batches(markov.val, 23, 2, seed=1337)  # 24 samples: 23, then 1
    assert [len(b["idx"]) for b in last] == [23, 1]
    assert sorted(i for b in last for i in b["idx"].tolist()) == list(range(24))


def sample(i: int) -> dict:
    return {"x": torch.zeros(2), "y": 1, "idx": i}


class Stream(IterableDataset):
    def __iter__(self):
        return (sample(i) for i in range(4))


class SizedStream(Stream):  # len() and (Dataset's, raising) [i]: only its class says it is a stream
    def __len__(self):
        return 4


@pytest.mark.parametrize("train, said", [
    (Stream(), "the train split is a Stream, an IterableDataset; expected a map-style dataset"),
    (SizedStream(), "the train split is a SizedStream, an IterableDataset; expected a map-style dataset"),
    ((sample(i) for i in range(4)), "the train split is a generator, without len() and [i];"),
    ([], "the train split is empty"),
    ([(torch.zeros(2), 1)], "the train split's sample 0 is a tuple; expected a dict with x"),
    ([{"x": torch.zeros(2), "y": 1}], "the train split's sample 0 is a dict with keys x, y; expected a dict with x"),
    ([sample(0), sample(0)], "the train split's sample 1 has idx 0; expected its index, 1"),
    ([{**sample(0), "x": {"ids": torch.zeros(2)}}],
     "the train split's sample 0 holds a dict under 'x'; expected a tensor"),
    ([sample(0), {**sample(1), "x": torch.zeros(1)}],  # a last window cut short
     "the train split's samples 0 and 1 differ in the shape of 'x': (2,) and (1,); a batch stacks"),
    ([sample(0), {**sample(1), "mask": np.ones(2)}],
     "the train split's samples 0 and 1 have different keys: x, y, idx and x, y, idx, mask;"),
])
def test_a_dataset_that_breaks_the_sample_contract_is_named(train, said):
    # Named up front, not a KeyError or TypeError from inside the loop, or, for a nested input, a
    # device mismatch on a GPU only (tensors are moved to the device at a batch's top level).
    data = Data(train, [sample(0)], vocab_size=2, seq_len=1)
    with pytest.raises(BadInput, match=f"data.name=mine: {re.escape(said)}"):
        check_samples(data, "mine")
    check_samples(Data([{**sample(0), "mask": np.ones(2)}, {**sample(1), "mask": np.ones(2)}],
                       [{**sample(0), "x": torch.zeros(3)}], 2, 1), "mine")  # val: a shape of its own


def test_samples_that_cannot_be_stacked_are_named_when_a_batch_meets_them():
    # torch says "stack expects each tensor to be equal size, but got [2] at entry 0 and [3] at
    # entry 1" (in a worker: "Trying to resize storage that is not resizable"), naming no sample.
    with pytest.raises(ValueError, match=re.escape("data: samples 4 and 7 differ in the shape of 'x': "
                                                   "(2,) and (3,); a batch stacks its samples")):
        collate([sample(4), sample(5), {**sample(7), "x": torch.zeros(3)}])
    assert collate([sample(4), sample(5)])["x"].shape == (2, 2)
    with pytest.raises(ValueError, match=re.escape("data: samples 4 and 5 have different keys: x, y, idx, "
                                                   "mask and x, y, idx;")):  # torch: KeyError: 'mask'
        collate([{**sample(4), "mask": torch.ones(2)}, sample(5)])
    with pytest.raises(ValueError, match=re.escape("data: samples 4 and 5 have different keys: x, y, idx and "
                                                   "x, y, idx, mask;")):  # torch: the batch without a mask
        collate([sample(4), {**sample(5), "mask": torch.ones(2)}])


def test_a_split_batch_recounts_each_part_s_targets_and_drops_empty_parts():
    # Out-of-memory recovery splits validation batches too; the last may hold fewer samples than parts.
    batch = collate([{"x": torch.zeros(2), "y": torch.tensor(y), "idx": i}
                     for i, y in enumerate([[1, -100], [-100, -100], [2, 3]])])
    parts = split_batch(batch, 4)
    assert [p["idx"].tolist() for p in parts] == [[0], [1], [2]]
    assert [p["n_targets"] for p in parts] == [1, 0, 2]


def test_token_windows_shift_by_one(tmp_path):
    ids = np.arange(50, dtype=np.uint16)
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    tw = TokenWindows(tmp_path / "t.bin", 8)
    assert len(tw) == (50 - 1) // 8 == 6
    s = tw[2]
    assert s["idx"] == 2
    assert s["x"].tolist() == list(range(16, 24)) and s["y"].tolist() == list(range(17, 25))
    assert tw[5]["y"].tolist()[-1] == 48
    # Pickled for a DataLoader worker started by spawn (macOS, Windows): the path, not the tokens
    # the file maps, which reading a sample opened.
    np.arange(100_000, dtype=np.uint16).tofile(tmp_path / "big.bin")
    big = TokenWindows(tmp_path / "big.bin", 8)
    assert big[2]["x"].tolist() == list(range(16, 24)) and len(pickle.dumps(big)) < 1000  # not 200 kB
    assert pickle.loads(pickle.dumps(big))[2]["x"].tolist() == list(range(16, 24))


# ------------------------------------------------------------------------------- prepare
TEXT = "Hello, wörld! ✓ naïve café\n" * 20 + "the end.\n"


def read_ids(root) -> np.ndarray:
    return np.concatenate([np.fromfile(root / "train.bin", dtype=np.uint16),
                           np.fromfile(root / "val.bin", dtype=np.uint16)])


def test_prepare_text_round_trip_and_idempotent(tmp_path, capsys):
    root = prepare_text(TEXT, "test-text", str(tmp_path / "cache"), 0.1)
    assert "preparing test-text" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((root / "meta.json").read_text())
    assert meta["vocab_size"] == len(set(TEXT)) and meta["chars"] == "".join(sorted(set(TEXT)))
    assert meta["val_tokens"] == int(len(TEXT) * 0.1) and meta["train_tokens"] + meta["val_tokens"] == len(TEXT)
    ids = read_ids(root)
    assert "".join(meta["chars"][i] for i in ids) == TEXT

    mtimes = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    again = prepare_text(TEXT, "test-text", str(tmp_path / "cache"), 0.1)
    assert again == root
    assert "preparing" not in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == mtimes
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [root.name]  # no temp left
    assert prepare_text(TEXT + "x", "t", str(tmp_path / "cache"), 0.1) != root  # content-named


@pytest.mark.parametrize("n, fraction, n_val", [(20, 0.1, 2), (20, 0.9, 18), (19, 0.1, None), (20, 0.95, None)])
def test_each_side_of_a_split_holds_at_least_two_tokens(n, fraction, n_val):
    # Fewer than 2 tokens hold no (input, target) pair: a run could not validate, or not train.
    if n_val is None:
        with pytest.raises(BadInput, match=f"data.val_fraction={fraction} splits {n} tokens into"):
            held_out(n, fraction)
    else:
        assert held_out(n, fraction) == n_val


@pytest.mark.parametrize("fraction", [1.0, 1.5])
def test_a_held_out_fraction_of_1_or_more_names_its_bound(fraction):
    # Not "splits 60 tokens into -30 for training and 90 for validation ... lower it".
    with pytest.raises(BadInput) as e:
        held_out(60, fraction)
    assert str(e.value) == (f"data: data.val_fraction={fraction}: expected a fraction below 1, the "
                            f"share of the data held out for validation.")


def test_a_text_of_65536_distinct_characters_is_prepared_and_one_more_is_refused(tmp_path):
    # uint16 ids run 0-65535: all 65,536 fit (not refused as "uint16 holds 65535").
    chars = [chr(c) for c in range(32, 0x20000) if not 0xD800 <= c < 0xE000][:65537]  # no surrogates
    text = "".join(chars[:65536]) * 2
    root = prepare_text(text, "wide", str(tmp_path), 0.5)
    meta = json.loads((root / "meta.json").read_text())
    assert meta["vocab_size"] == 65536 and "".join(meta["chars"][i] for i in read_ids(root)) == text
    with pytest.raises(BadInput, match="data: wide has 65,537 distinct characters; expected at most 65,536"):
        prepare_text("".join(chars), "wide", str(tmp_path), 0.5)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_temp_dir_and_a_lost_race_keeps_the_first_corpus(tmp_path, monkeypatch, error):
    cache, write, replace = tmp_path / "cache", corpus.write_synced, os.replace

    def fail(path, data):  # a full disk, or Ctrl-C, in the middle of the corpus
        if path.name == "val.bin":
            raise error
        write(path, data)

    monkeypatch.setattr(corpus, "write_synced", fail)
    with pytest.raises(type(error)):
        prepare_text(TEXT, "t", str(cache), 0.1)
    assert list(cache.iterdir()) == []  # not a half-written temp dir per attempt
    monkeypatch.undo()

    def another_process_first(src, dst):  # it renamed an identical corpus into place a moment before
        shutil.copytree(src, dst)
        replace(src, dst)  # a directory onto a full one: OSError

    monkeypatch.setattr(os, "replace", another_process_first)
    root = prepare_text(TEXT, "t", str(cache), 0.1)
    monkeypatch.undo()
    assert [p.name for p in cache.iterdir()] == [root.name]
    assert "".join(json.loads((root / "meta.json").read_text())["chars"][i] for i in read_ids(root)) == TEXT


@pytest.mark.slow
def test_prepare_command_prints_the_corpus_dir_and_exits_2_on_bad_input(tmp_path):
    # The README's `python -m data.prepare`: no runpy warning (the package does not import the
    # module it runs), and bad input is a message and exit 2, as with train.py.
    f, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    f.write_text(TEXT, encoding="utf-8")

    def prepare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "data.prepare", "--out", str(cache), *args],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=120)

    ok = prepare("--path", str(f))
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert ok.stdout.splitlines()[-1] == str(prepare_text(TEXT, "t", str(cache), 0.1))
    for args, named in [(["--path", str(tmp_path / "missing.txt")], "missing.txt"),
                        (["--path", str(f), "--val-fraction", "0"],
                         f"data.val_fraction=0.0 splits {len(TEXT)} tokens into {len(TEXT)} for "
                         f"training and 0 for validation; expected at least 2 in each (every run "
                         f"validates, at its end at least): raise it, or give more data."),
                        (["--path", str(f), "--val-fraction", "0.999"], "into 1 for training and "
                         f"{len(TEXT) - 1} for validation; expected at least 2 in each (every run "
                         f"validates, at its end at least): lower it, or give more data."),
                        (["--path", str(f), "--val-fraction", "1"], "data.val_fraction=1.0: expected "
                         "a fraction below 1, the share of the data held out for validation.")]:
        bad = prepare(*args)
        assert bad.returncode == 2 and bad.stderr.startswith("error: ") and named in bad.stderr, bad.stderr
        assert bad.stdout == "", bad.stdout  # not "preparing ..." first, as if it had begun
    assert [p.name for p in cache.iterdir()] == [ok.stdout.splitlines()[-1].rsplit("/", 1)[1]]


def test_prepare_command_refuses_a_nan_fraction_and_an_out_under_a_file(tmp_path, capsys):
    # Exit 2 with a message, not tracebacks with exit 1 (`cannot convert float NaN to integer`,
    # and NotADirectoryError).
    from data.prepare import main  # in this process: interpreters take seconds to start

    f = tmp_path / "corpus.txt"
    f.write_text(TEXT, encoding="utf-8")
    with pytest.raises(SystemExit) as e:  # argparse's exit, after its message
        main(["--path", str(f), "--out", str(tmp_path / "cache"), "--val-fraction", "nan"])
    assert e.value.code == 2
    assert "argument --val-fraction: expected a finite number >= 0, got 'nan'" in capsys.readouterr().err
    assert main(["--path", str(f), "--out", str(f / "cache")]) == 2
    assert capsys.readouterr().err == (f"error: option --out={f / 'cache'}: {f} is a file; expected a "
                                       f"directory, or a path where one can be made.\n")
    assert f.read_text(encoding="utf-8") == TEXT and not (tmp_path / "cache").exists()


def test_prepare_command_refuses_a_cache_damaged_since_it_was_prepared(tmp_path, capsys):
    # It printed the directory and exit 0 for a train.bin cut short; train.py then refused it.
    from data.prepare import main

    f = tmp_path / "corpus.txt"
    f.write_text(TEXT, encoding="utf-8")
    assert main(["--path", str(f), "--out", str(tmp_path / "cache")]) == 0
    root = Path(capsys.readouterr().out.splitlines()[-1])
    with open(root / "train.bin", "r+b") as fh:
        fh.truncate(100)
    assert main(["--path", str(f), "--out", str(tmp_path / "cache")]) == 2
    assert f"delete {root} and it is prepared again" in capsys.readouterr().err


def test_build_text_decode(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT, encoding="utf-8")
    data = build_data(data_options("text", path=str(f), cache_dir=str(tmp_path / "cache"),
                                 seq_len=8, val_fraction=0.1))
    assert data.vocab_size == len(set(TEXT))
    s = data.train[3]
    assert data.decode(s["x"].tolist()) == TEXT[24:32]
    assert data.decode(s["y"].tolist()) == TEXT[25:33]


def test_a_corpus_is_read_as_its_bytes_say(tmp_path):
    # \r\n and \r stay as they are: read as \n (newline translation), the model would learn a text
    # the file does not hold, and metadata would record a sha256 that is not the file's.
    import hashlib

    f = tmp_path / "windows.txt"
    f.write_bytes(b"hello\r\nworld\r\n" * 50)
    data = build_data(data_options("text", path=str(f), cache_dir=str(tmp_path / "cache"), seq_len=8))
    assert data.meta["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert data.decode(data.train[0]["x"].tolist()) == "hello\r\nw"


def test_missing_data_path(tmp_path):
    missing = tmp_path / "nope.txt"
    cache = tmp_path / "cache"
    with pytest.raises(BadInput) as e:
        build_data(data_options("text", path=str(missing), cache_dir=str(cache)))
    assert str(e.value).startswith(f"data.path {missing}: cannot read it as UTF-8 text")
    assert not cache.exists()
    empty = tmp_path / "empty.txt"  # named as such, not as a data.val_fraction that splits 0 tokens
    empty.write_text("")
    with pytest.raises(BadInput) as e:
        build_data(data_options("text", path=str(empty), cache_dir=str(cache)))
    assert str(e.value) == f"data: {empty} is empty; expected text to train on."


def test_unknown_data_name():
    with pytest.raises(BadInput, match="^config key data.name: expected one of .*text.*; got 'imagenet'"):
        load_config(DEFAULT_CONFIG, ["data.name=imagenet"])


def test_seq_len_longer_than_split(tmp_path):
    with pytest.raises(BadInput, match="shorter than data.seq_len=200"):
        build_data(data_options("markov", cache_dir=str(tmp_path), seq_len=200,
                              markov=MarkovConfig(tokens=1000)))  # 100 validation tokens


# ------------------------------------------------------------------------------- markov
def h(p: float) -> float:
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


def test_entropy_rate_two_state_chain():
    a, b = 0.3, 0.6  # P(0->1) = a, P(1->0) = b; stationary pi = (b, a) / (a + b)
    P = np.array([[1 - a, a], [b, 1 - b]])
    expected = b / (a + b) * h(a) + a / (a + b) * h(b)
    assert entropy_rate(P) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2 / 3 * 0.6108643 + 1 / 3 * 0.6730117, rel=1e-6)  # = 0.6315801
    assert entropy_rate(np.array([[0.0, 1.0], [1.0, 0.0]])) == 0.0  # deterministic: zero
    assert entropy_rate(np.full((4, 4), 0.25)) == pytest.approx(math.log(4), rel=1e-12)


def test_transition_matrix_shape():
    P = transition_matrix(6, 3, seed=2)
    assert np.allclose(P.sum(axis=1), 1.0)
    assert ((P > 0).sum(axis=1) == 3).all()
    assert all(P[s, (s + 1) % 6] > 0 for s in range(6))  # the cycle that makes it irreducible


def test_markov_stream_follows_P(tmp_path):
    vocab, branching, seed = 5, 3, 3
    root = prepare_markov(vocab, branching, 60_000, seed, str(tmp_path), 0.1)
    P = transition_matrix(vocab, branching, seed)
    meta = json.loads((root / "meta.json").read_text())
    assert meta["optimal_loss"] == entropy_rate(P) and meta["vocab_size"] == vocab
    ids = read_ids(root).astype(np.int64)
    assert len(ids) == 60_000 and ids[0] == 0
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (ids[:-1], ids[1:]), 1)
    freq = counts / counts.sum(axis=1, keepdims=True)
    assert (counts[P == 0] == 0).all()  # impossible transitions never happen
    assert np.abs(freq - P).max() < 0.02, np.abs(freq - P).max()  # ~12k draws per row: sd <= 0.005
    # and the empirical per-token entropy matches the entropy rate
    nll = -np.log(P[ids[:-1], ids[1:]]).mean()
    assert nll == pytest.approx(entropy_rate(P), abs=0.02)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_markov_split_that_cannot_work_is_refused_before_the_chain_is_made(tmp_path, monkeypatch, fraction):
    # The chain takes about 1.6 s a million tokens (a Python loop): a bad data.val_fraction costs none of it.
    from data import markov as markov_module

    made = []
    monkeypatch.setattr(markov_module, "transition_matrix", lambda *a: made.append(a) or transition_matrix(*a))
    with pytest.raises(BadInput, match=r"data\.val_fraction="):
        prepare_markov(4, 2, 5000, 0, str(tmp_path / "cache"), fraction)
    assert made == [] and not (tmp_path / "cache").exists()


def test_random_tokens_and_a_token_directory(tmp_path):
    cfg = load_config(DEFAULT_CONFIG, ["data.name=random", "data.synthetic.vocab_size=50304",
                                       "data.synthetic.tokens=5000", f"data.cache_dir={tmp_path}", "data.seq_len=16"])
    d = build_data(cfg.data)
    assert d.vocab_size == 50304 and d.meta["optimal_loss"] == pytest.approx(math.log(50304))
    ids = torch.cat([d.train[i]["x"] for i in range(len(d.train))])
    assert ids.max() > 40000 and ids.min() >= 0  # the whole vocabulary is in use, uint16 and all
    # The same files, read as a token directory (data.name=tokens): the same samples.
    root = next(p for p in tmp_path.iterdir() if p.name.startswith("random-"))
    cfg.data.name, cfg.data.path = "tokens", str(root)
    again = build_data(cfg.data)
    assert torch.equal(again.train[7]["x"], d.train[7]["x"]) and again.vocab_size == 50304
    cfg.data.path = str(tmp_path / "missing")
    with pytest.raises(BadInput, match="data.path: .*missing train.bin, val.bin, meta.json"):
        build_data(cfg.data)


@pytest.mark.parametrize("name, key", [("random", "data.synthetic.tokens"), ("markov", "data.markov.tokens")])
def test_more_generated_tokens_than_the_disk_or_memory_holds_is_exit_2_naming_the_key(tmp_path, monkeypatch,
                                                                                       name, key):
    # 1e14 tokens: token files of 200 TB, past the free space of a test machine's disk, and arrays
    # past the 128 TiB a process can map, so NumPy's MemoryError whatever the kernel's overcommit
    # (asked for on a disk said to hold them). Either is exit 2, not a traceback; nothing may be in the cache.
    from types import SimpleNamespace

    from conftest import train_here

    cache, out, n = tmp_path / "cache", tmp_path / "run", 10**14
    for disk in ("real", "said to hold them"):
        if disk != "real":
            monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**70, used=0, free=2**70))
        r = train_here(out, f"data.name={name}", f"data.cache_dir={cache}", f"{key}={n}", check=False)
        assert r.returncode == 2 and r.stderr.startswith(f"error: config key {key}={n}: "), (disk, r.stderr)
        assert "200.0 TB" in r.stderr and r.stderr.count("\n") == 1, (disk, r.stderr)
    assert "memory" in r.stderr, r.stderr
    assert not out.exists() and not cache.exists()


def free_space(monkeypatch, free: int) -> None:
    """Every disk a terabyte in size with `free` bytes of it free."""
    from types import SimpleNamespace

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12 - free, free=free))


def test_generated_tokens_are_refused_past_the_disk_s_free_space_not_its_size(tmp_path, monkeypatch):
    # train.bin and val.bin take 2 bytes a token, and only the free part of a disk can hold them:
    # past it, the write would fail after the whole generation.
    free_space(monkeypatch, 10_000)
    out = tmp_path / "cache" / "random-v50"  # not there yet: the nearest folder that is is asked
    corpus.room_for("data.synthetic.tokens", 5000, out)  # 10,000 bytes: just fits
    with pytest.raises(BadInput) as e:
        corpus.room_for("data.synthetic.tokens", 5001, out)
    assert "data.synthetic.tokens=5001" in str(e.value) and f"{tmp_path} has 10.0 kB free" in str(e.value)


def test_a_size_in_a_message_is_in_the_largest_unit_it_reaches():
    # Up to terabytes, however large: a token count past any disk (2**63) is still a size to read.
    assert [corpus.sized(n) for n in (999, 1000, 2 * 10**14, 2**64)] == [
        "999.0 B", "1.0 kB", "200.0 TB", "18,446,744.1 TB"]


@pytest.mark.parametrize("name, key", [("random", "data.synthetic.tokens"), ("markov", "data.markov.tokens")])
def test_generated_tokens_past_the_free_space_are_refused_and_a_prepared_set_needs_none(tmp_path, monkeypatch,
                                                                                      name, key):
    # A data set already in the cache is read, not written: a disk that has filled since must not
    # refuse it. One still to generate is refused by its key before any of it is generated.
    def cfg(tokens):
        return load_config(DEFAULT_CONFIG, [f"data.name={name}", f"data.cache_dir={tmp_path}", f"{key}={tokens}",
                                            "data.seq_len=16"]).data

    prepared = build_data(cfg(5000))
    before = sorted(tmp_path.iterdir())
    free_space(monkeypatch, 1000)
    assert len(build_data(cfg(5000)).train) == len(prepared.train)
    with pytest.raises(BadInput, match=f"config key {key}=6000: .* 1.0 kB free"):
        build_data(cfg(6000))
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name, key", [("random", "data.val_fraction"), ("random", "data.synthetic.seed"),
                                       ("markov", "data.val_fraction"), ("markov", "data.markov.seed"),
                                       ("text", "data.val_fraction")])
def test_a_prepared_data_set_is_cached_by_every_option_that_shapes_it(tmp_path, name, key):
    # One data.cache_dir serves many runs: a cache keyed on fewer options than shape the files
    # would hand a run the split (or the tokens) another option value had prepared, without a word.
    small = {"random": ["data.synthetic.tokens=5000"], "markov": ["data.markov.tokens=5000"]}.get(name, [])
    a, b = (0.1, 0.3) if key == "data.val_fraction" else (0, 1)

    def built(value):
        cfg = load_config(DEFAULT_CONFIG, [f"data.name={name}", f"data.cache_dir={tmp_path}", *small,
                                           "data.seq_len=16", f"{key}={value}"])
        d = build_data(cfg.data)
        return len(d.train), len(d.val), d.train[0]["x"]

    first, second, again = built(a), built(b), built(a)
    assert again[:2] == first[:2] and torch.equal(again[2], first[2])
    assert first[:2] != second[:2] or not torch.equal(first[2], second[2]), (first, second)


def test_a_prepared_cache_cut_short_or_overwritten_is_bad_input(tmp_path):
    # Unchecked, train.bin cut to 1000 bytes trains on its 500 tokens without a word (metadata.json
    # still says 418,614), and random bytes of the right size are an IndexError in the embedding at
    # step 1.
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 100)
    cfg = load_config(DEFAULT_CONFIG, [f"data.path={text}", f"data.cache_dir={tmp_path / 'cache'}",
                                       "data.seq_len=16"]).data
    root = build_data(cfg).train.path.parent
    train = root / "train.bin"
    full = train.read_bytes()
    again = f"(a cache in data.cache_dir: delete {root} and it is prepared again)."
    train.write_bytes(full[:1000])
    with pytest.raises(BadInput) as e:
        build_data(cfg)
    assert str(e.value) == (f"data: {train} has 1000 bytes, but {root / 'meta.json'} says "
                            f"{len(full) // 2} tokens ({len(full)} bytes): cut short or replaced since {again}")
    train.write_bytes(np.full(len(full) // 2, 500, dtype=np.uint16).tobytes())
    with pytest.raises(BadInput) as e:
        build_data(cfg)
    assert str(e.value).startswith(f"data: {train} holds token id 500, but {root / 'meta.json'} says "
                                   f"vocab_size ") and str(e.value).endswith(f"expected every id below it {again}")
    # Edited in place, the same size and every id in range: unchecked, it trains on other tokens,
    # exit 0.
    train.write_bytes(np.zeros(len(full) // 2, dtype=np.uint16).tobytes())
    with pytest.raises(BadInput) as e:
        build_data(cfg)
    assert str(e.value) == (f"data: {root}'s train.bin and val.bin do not match the tokens_sha256 in its "
                            f"meta.json: edited since they were written {again}")
    # A file deleted, or meta.json: said, with the same way out (not a traceback, and not a cache
    # that fails forever).
    train.unlink()
    with pytest.raises(BadInput) as e:
        build_data(cfg)
    assert str(e.value) == f"data: {root} has no train.bin; expected train.bin, val.bin and meta.json {again}"
    (root / "meta.json").unlink()
    with pytest.raises(BadInput) as e:
        build_data(cfg)
    assert str(e.value) == (f"data: {root} holds no meta.json, so it is no prepared cache; delete it and "
                            f"it is prepared again.")


def test_token_data_names_its_directory_and_caches_name_their_whole_split(tmp_path):
    # An empty data.path must not read the current directory; and a cache named with 6 digits of
    # val_fraction (0.1000001 as 0.1) would hand one split's cache to another split.
    with pytest.raises(BadInput) as e:
        build_data(data_options("tokens", path=""))
    assert str(e.value) == ("config key data.path (data.name=tokens): expected the directory holding "
                            "train.bin, val.bin and meta.json; got ''.")
    text = "the quick brown fox jumps over the lazy dog\n" * 20
    from data.corpus import prepare_text
    assert prepare_text(text, "t", str(tmp_path), 0.1) != prepare_text(text, "t", str(tmp_path), 0.1000001)


def refused_token_dir(root: Path, meta: dict) -> str:
    """The BadInput message for a token directory (ids 0-9 in both files) with this meta.json."""
    root.mkdir()
    (root / "meta.json").write_text(json.dumps(meta))
    for name in ("train.bin", "val.bin"):
        (np.arange(3000, dtype=np.uint16) % 10).tofile(root / name)
    cfg = load_config(DEFAULT_CONFIG, ["data.name=tokens", f"data.path={root}", "data.seq_len=16"])
    with pytest.raises(BadInput) as e:
        build_data(cfg.data)
    return str(e.value)


@pytest.mark.parametrize("chars", [None, "abc"])
def test_a_token_directory_of_kind_chars_needs_its_characters(tmp_path, chars):
    # Refused up front. Unchecked: without "chars", a KeyError; with too few, all steps train, then
    # an IndexError drawing the text sample at the first evaluation, and no model.pt.
    root = tmp_path / "tok"
    meta = {"vocab_size": 10, "kind": "chars", **({"chars": chars} if chars else {})}
    assert refused_token_dir(root, meta) == (f"data: {root / 'meta.json'} says kind chars, so expected "
                                             f"\"chars\": a string of its vocab_size 10 characters.")


@pytest.mark.parametrize("vocab", [1e10, 103.5, "ten", 0, 2**16 + 1, True])
def test_a_token_directory_whose_vocab_size_is_no_uint16_count_is_bad_input(tmp_path, vocab):
    root = tmp_path / "tok"
    assert refused_token_dir(root, {"vocab_size": vocab}) == (
        f"data: {root / 'meta.json'} says vocab_size {vocab!r}; expected an integer from 1 to 65536 "
        f"(the files hold uint16 token ids).")


def test_a_token_directory_with_an_id_past_its_vocabulary_or_an_odd_size_is_bad_input(tmp_path):
    # Another tokenizer's files: unchecked, a token id >= vocab_size is an IndexError traceback at
    # the step that first draws it (a device-side assert on CUDA), an odd byte count one in a
    # DataLoader.
    root = tmp_path / "tok"
    root.mkdir()
    (root / "meta.json").write_text(json.dumps({"vocab_size": 10}))
    (np.arange(3000, dtype=np.uint16) % 10).tofile(root / "val.bin")
    train = np.arange(20000, dtype=np.uint16) % 10
    train[15000] = 10
    train.tofile(root / "train.bin")
    cfg = load_config(DEFAULT_CONFIG, ["data.name=tokens", f"data.path={root}", "data.seq_len=16"])
    with pytest.raises(BadInput) as e:
        build_data(cfg.data)
    assert str(e.value) == (f"data: {root / 'train.bin'} holds token id 10, but {root / 'meta.json'} "
                            f"says vocab_size 10; expected every id below it.")
    train[15000] = 9
    train.tofile(root / "train.bin")
    assert build_data(cfg.data).vocab_size == 10
    with open(root / "val.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BadInput, match=r"val.bin has 6001 bytes, an odd number; expected uint16"):
        build_data(cfg.data)


def test_a_data_directory_this_user_cannot_read_is_bad_input(tmp_path, monkeypatch):
    # A cache or token directory another user made with umask 077: a PermissionError traceback
    # unless named. Root reads anything, so the refusal is stood in for where the files are mapped.
    root = tmp_path / "tok"
    root.mkdir()
    (root / "meta.json").write_text(json.dumps({"vocab_size": 10}))
    for name in ("train.bin", "val.bin"):
        (np.arange(3000, dtype=np.uint16) % 10).tofile(root / name)

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(np, "memmap", refused)
    cfg = load_config(DEFAULT_CONFIG, ["data.name=tokens", f"data.path={root}", "data.seq_len=16"])
    with pytest.raises(BadInput) as e:
        build_data(cfg.data)
    assert str(e.value).startswith(f"data.name=tokens: cannot read {root / 'train.bin'}"), str(e.value)


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.int64])
def test_a_token_directory_of_wider_ids_is_bad_input(tmp_path, dtype):
    # Another tokenizer's 32- or 64-bit ids of a vocabulary under 65536: read as uint16 each id is
    # followed by 0s, every one in range, and the run trained on that without a word.
    root = tmp_path / "tok"
    root.mkdir()
    (root / "meta.json").write_text(json.dumps({"vocab_size": 50257}))
    for name in ("train.bin", "val.bin"):
        (np.arange(1, 3001) % 50257).astype(dtype).tofile(root / name)
    cfg = load_config(DEFAULT_CONFIG, ["data.name=tokens", f"data.path={root}", "data.seq_len=16"])
    with pytest.raises(BadInput) as e:
        build_data(cfg.data)
    assert str(e.value).startswith(f"data: {root / 'train.bin'}") and "uint16" in str(e.value)
    for name in ("train.bin", "val.bin"):  # the same ids as uint16 are read
        (np.arange(1, 3001) % 50257).astype(np.uint16).tofile(root / name)
    assert build_data(cfg.data).vocab_size == 50257


def test_uint16_ids_that_alternate_with_id_0_train_where_the_token_count_is_known(tmp_path, cache):
    # One character a line: "\n" is id 0 at every second place, as 32-bit ids read as uint16 look.
    # A prepared cache (whose meta.json counts its tokens) was refused, and prepared again the same.
    text = tmp_path / "digits.txt"
    text.write_text("".join(f"{d}\n" for d in "123456789" * 600))
    cfg = load_config(DEFAULT_CONFIG, [f"data.path={text}", f"data.cache_dir={tmp_path / 'c'}", "data.seq_len=16"])
    assert build_data(cfg.data).vocab_size == 10
    markov = load_config(DEFAULT_CONFIG, ["data.name=markov", "data.markov.vocab_size=2", "data.markov.branching=1",
                                          "data.markov.tokens=1001", f"data.cache_dir={tmp_path / 'c'}",
                                          "data.seq_len=16"])
    assert build_data(markov.data).vocab_size == 2  # 0, 1, 0, 1, ...: val starts at an odd place


def test_a_token_directory_s_vocab_size_may_be_a_string_of_digits(tmp_path):
    # As another tool may write it; anything else is named.
    root = tmp_path / "tok"
    root.mkdir()
    for name in ("train.bin", "val.bin"):
        (np.arange(3000, dtype=np.uint16) % 10).tofile(root / name)
    cfg = load_config(DEFAULT_CONFIG, ["data.name=tokens", f"data.path={root}", "data.seq_len=16"])
    (root / "meta.json").write_text(json.dumps({"vocab_size": "10"}))
    assert build_data(cfg.data).vocab_size == 10
    (root / "meta.json").write_text(json.dumps({"size": 10}))
    with pytest.raises(BadInput, match=f"data: {root}: expected a meta.json holding vocab_size"):
        build_data(cfg.data)
    # What meta.json says of the files is held to them: a count as text, another dtype.
    (root / "meta.json").write_text(json.dumps({"vocab_size": "\u00b2"}))  # isdigit, but no int
    with pytest.raises(BadInput, match="says vocab_size '\u00b2'; expected an integer"):
        build_data(cfg.data)
    (root / "meta.json").write_text(json.dumps({"vocab_size": 10, "train_tokens": "3000", "val_tokens": 3000}))
    assert build_data(cfg.data).vocab_size == 10
    (root / "meta.json").write_text(json.dumps({"vocab_size": 10, "train_tokens": "3,000"}))
    with pytest.raises(BadInput, match="says train_tokens '3,000'; expected an integer"):
        build_data(cfg.data)
    (root / "meta.json").write_text(json.dumps({"vocab_size": 10, "dtype": "uint32"}))
    with pytest.raises(BadInput, match="says dtype 'uint32'; expected uint16"):
        build_data(cfg.data)


def test_an_empty_token_file_is_bad_input(tmp_path):
    # An empty train.bin (a tokenizer that wrote nothing): named, not `ValueError: __len__() should
    # return >= 0` from a window count of (0 - 1) // seq_len.
    root = tmp_path / "tok"
    root.mkdir()
    (root / "meta.json").write_text(json.dumps({"vocab_size": 10}))
    (root / "train.bin").write_bytes(b"")
    (np.arange(3000, dtype=np.uint16) % 10).tofile(root / "val.bin")
    cfg = load_config(DEFAULT_CONFIG, ["data.name=tokens", f"data.path={root}", "data.seq_len=16"])
    with pytest.raises(BadInput, match=r"the train split of .*tok is shorter than data.seq_len=16 \+ 1"):
        build_data(cfg.data)


@pytest.mark.parametrize("config, key, name, readers", [
    ("gpt2_124m.yaml", "data.path=my_tokens", "random", ["text", "tokens", "mnist"]),  # forgot data.name=tokens
    ("shakespeare_char.yaml", "data.path=my.txt", "shakespeare", ["text", "tokens", "mnist"]),
    ("default.yaml", "data.url=http://127.0.0.1:9/m", "text", ["shakespeare", "mnist"]),
])
def test_a_path_or_url_the_data_set_does_not_read_is_exit_2(tmp_path, capsys, config, key, name, readers):
    # Not ignored: the random stream (or TinyShakespeare) would train in place of the files named.
    import train  # in this process: interpreters take seconds to start

    out = tmp_path / "run"
    root = Path(DEFAULT_CONFIG).parent
    assert train.main(["--config", str(root / config), key, f"run.out_dir={out}",
                       f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    given = key.partition("=")[0]
    err = capsys.readouterr().err
    assert err.startswith(f"error: config key {given}: data.name={name} reads "), err
    readers_said = err.split(f"{given} is for data.name=")[1].split(".")[0].split(", ")
    assert set(readers) <= set(readers_said) and name not in readers_said, err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_a_prepared_cache_this_user_cannot_write_is_read(tmp_path, monkeypatch):
    # A shared cache, prepared once and then read-only (a lab's mount), is not refused at the start:
    # a run only reads it. A data set not prepared there is exit 2 naming the key, before anything
    # is written. os.access stands in for the mount: root may write anywhere.
    from conftest import train_here

    cache = tmp_path / "cache"
    train_here(tmp_path / "first", f"data.cache_dir={cache}", "train.max_steps=2")  # prepares it
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw:
                        not (mode & os.W_OK and Path(p).is_relative_to(cache)) and access(p, mode, **kw))
    before = sorted(cache.rglob("*"))
    train_here(tmp_path / "again", f"data.cache_dir={cache}", "train.max_steps=2")
    r = train_here(tmp_path / "markov", f"data.cache_dir={cache}", "data.name=markov", check=False)
    assert r.returncode == 2 and r.stderr == (f"error: config key data.cache_dir={cache}: cannot write "
                                              f"in {cache}; expected a directory this user can write to.\n")
    assert sorted(cache.rglob("*")) == before and not (tmp_path / "markov").exists()


def test_a_prefetch_factor_without_workers_is_said(tmp_path, cache):
    # torch's DataLoader takes prefetch_factor with workers only: data.prefetch_factor=4 with
    # data.num_workers=0 would otherwise be dropped without a word. Its default, given or not, and
    # a value with workers (one is enough) are not noted; a value below the default is noted too.
    from conftest import train_here

    def said(*overrides: str) -> list[str]:
        notes = idle_settings(load_config(DEFAULT_CONFIG, list(overrides)), Precision("fp32", torch.device("cpu")))
        return [n for n in notes if "data.prefetch_factor" in n]

    assert said() == said("data.prefetch_factor=2") == said("data.prefetch_factor=4", "data.num_workers=1") == []
    assert said("data.prefetch_factor=1")[0].startswith("data.prefetch_factor=1 has no effect")
    run = train_here(tmp_path / "run", cache, "data.prefetch_factor=4", "train.max_steps=1")
    notes = [line for line in run.stdout.splitlines() if "data.prefetch_factor" in line]
    assert len(notes) == 1 and notes[0].startswith("note: data.prefetch_factor=4 has no effect with "
                                                   "data.num_workers=0"), run.stdout


def test_a_step_larger_than_the_training_split_is_said(tmp_path):
    # 900 training tokens in windows of 32: 28 samples. A step of 4 x 8 = 32 holds some twice,
    # which a loss curve does not show; a step of 4 x 7 = 28 holds each once and is not noted.
    from conftest import TINY, train_here

    data = [*TINY, "data.name=random", "data.synthetic.tokens=1000", "data.synthetic.vocab_size=50",
            f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=1", "train.sample_tokens=0"]
    said = {}
    for accum in (7, 8):
        proc = train_here(tmp_path / str(accum), *data, f"train.grad_accum={accum}")
        said[accum] = [line for line in proc.stdout.splitlines() if "more than the" in line]
    assert said[7] == [] and len(said[8]) == 1, said
    assert said[8][0].startswith("note: a step takes 32 samples") and "28 of the training split" in said[8][0]
