"""Checkpoint integrity, end to end: a corrupt newest checkpoint is skipped with a warning and the run
still ends bit-identical to an uninterrupted one; when nothing usable is there (all invalid, a
code-running pickle, a model of another shape, resume=never, a missing path) train.py exits 2 and
leaves run.out_dir byte-for-byte as it was; a checkpoint the system refuses to write ends the run
with exit 3 and the earlier ones whole; keep_last retains exactly the newest checkpoints."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, metrics, run_and_kill, summary, train_cmd, train_here

STEPS = ["train.max_steps=40", "train.ckpt_every=10"]
BASE = ["train.max_steps=10", "train.ckpt_every=5"]  # leaves step_00000005 and step_00000010


# ---------------------------------------------------------------------------- helpers
def ckpt_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under root: directories as "dir", files as their bytes, links as their target."""
    snap: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            snap[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            snap[rel] = "dir"
        else:
            snap[rel] = p.read_bytes()
    return snap


def assert_unchanged(before: dict, root: Path) -> None:
    after = snapshot(root)
    assert sorted(after) == sorted(before), (
        f"listing of {root} changed: added {sorted(set(after) - set(before))}, "
        f"removed {sorted(set(before) - set(after))}")
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"contents changed in {root}: {changed}"


def truncate_half(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def flip_middle_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def resumed_at(stdout: str) -> tuple[str, int]:
    m = re.search(r"resumed from (\S+) at step (\d+)", stdout)
    assert m, stdout
    return m.group(1), int(m.group(2))


def warning_lines(stderr: str, ckpt: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "warning" in ln.lower() and ckpt in ln]


# ---------------------------------------------------------------------------- shared runs
@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("ref") / "run"
    train_here(out, cache, *STEPS)
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory, cache):
    """A 40-step run SIGKILLed at step 31: checkpoints 10, 20, 30 on disk, no summary."""
    out = tmp_path_factory.mktemp("killed") / "run"
    printed = run_and_kill(out, 31, cache, *STEPS)
    assert ckpt_names(out) == ["step_00000010", "step_00000020", "step_00000030"], printed
    assert not (out / "summary.json").exists()
    return out


@pytest.fixture(scope="module")
def base10(tmp_path_factory, cache):
    """A finished 10-step run with TINY's model.n_embd=32; tests work on copies of it."""
    out = tmp_path_factory.mktemp("base10") / "run"
    train_here(out, cache, *BASE)
    assert ckpt_names(out) == ["step_00000005", "step_00000010"]
    return out


# ---------------------------------------------------------------------------- 1. corrupt newest
CORRUPTIONS = {
    # name: (how, file named in the warning, words that must appear in the warning's reason)
    "truncate_state": (lambda d: truncate_half(d / "state.pt"), "state.pt", r"bytes|size"),
    "flip_byte_state": (lambda d: flip_middle_byte(d / "state.pt"), "state.pt", r"sha256|hash"),
    "delete_rng": (lambda d: (d / "rng_rank0.pt").unlink(), "rng_rank0.pt", r"missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_skipped_and_run_ends_identical(tmp_path, cache, reference,
                                                                     killed, kind):
    corrupt, fname, reason = CORRUPTIONS[kind]
    out = tmp_path / "run"
    shutil.copytree(killed, out, symlinks=True)  # the killed run, in this test's own out_dir
    corrupt(out / "checkpoints" / "step_00000030")

    rerun = train_here(out, cache, *STEPS)

    warned = warning_lines(rerun.stderr, "step_00000030")
    assert warned, f"no warning naming step_00000030:\n{rerun.stderr}"
    assert any(fname in ln and re.search(reason, ln, re.I) for ln in warned), \
        f"warning does not give the reason ({fname}, /{reason}/):\n{rerun.stderr}"
    path, step = resumed_at(rerun.stdout)
    assert step == 20 and path.endswith("step_00000020"), rerun.stdout

    a, b = metrics(reference), metrics(out)
    assert [r["step"] for r in b] == list(range(1, 41)), f"{kind}: one record per step"
    for x, y in zip(a, b):
        assert (x["loss"], x["grad_norm"], x["lr"]) == (y["loss"], y["grad_norm"], y["lr"]), \
            f"{kind}: step {x['step']} differs"
    assert summary(out)["params_sha256"] == summary(reference)["params_sha256"], kind
    # The bad step-30 checkpoint was replaced by a good one on the way.
    from loop.checkpoint import store
    assert store.verify(out / "checkpoints" / "step_00000030") is None


# ---------------------------------------------------------------------------- 2. all invalid
def test_a_manifest_of_another_shape_is_a_reason_to_skip_not_a_traceback(tmp_path):
    # "files": null or a list is a reason to skip, as any other damage to a manifest is for
    # run.resume=auto, not an AttributeError out of it.
    from loop.checkpoint import store

    for files in (None, [1], "state.pt"):
        (tmp_path / store.MANIFEST).write_text(json.dumps({"files": files}))
        assert store.verify(tmp_path).startswith(f"{store.MANIFEST} is missing, unreadable "
                                                      f"or malformed ("), files
    # Emptied by hand with state.pt deleted, it must not verify, or the resume exits 2 instead of
    # going on to the next checkpoint.
    (tmp_path / store.MANIFEST).write_text(json.dumps({"files": {}}))
    assert store.verify(tmp_path) == f"{store.MANIFEST} lists no state.pt"


def test_a_checkpoint_copied_under_another_step_s_name_does_not_verify(base10, tmp_path):
    # Named step 99, the newest, it was resumed at its own step 10 at every rerun, which retrained
    # and never finished.
    from loop.checkpoint import store

    copy = shutil.copytree(base10 / "checkpoints" / "step_00000010", tmp_path / "step_00000099")
    assert store.verify(copy) == f"its name says step 99, its {store.MANIFEST} step 10"
    assert store.verify(copy.rename(tmp_path / "mine")) is None  # a name of one's own: no step to compare


@pytest.mark.slow
def test_all_checkpoints_invalid_exits_2_and_changes_nothing(tmp_path, cache, base10):
    out = tmp_path / "run"
    shutil.copytree(base10, out, symlinks=True)
    truncate_half(out / "checkpoints" / "step_00000010" / "state.pt")
    flip_middle_byte(out / "checkpoints" / "step_00000005" / "rng_rank0.pt")
    before = snapshot(out)
    jsonl = (out / "metrics.jsonl").read_bytes()

    rerun = train_here(out, cache, *BASE, check=False)

    assert rerun.returncode == 2, rerun.stdout + rerun.stderr
    for name in ("step_00000010", "step_00000005"):
        assert warning_lines(rerun.stderr, name), f"no warning naming {name}:\n{rerun.stderr}"
    assert re.search(r"\bnone\b.*\bverif", rerun.stderr, re.I | re.S), rerun.stderr
    assert "Traceback" not in rerun.stderr, rerun.stderr
    assert (out / "metrics.jsonl").read_bytes() == jsonl
    assert_unchanged(before, out)


# ---------------------------------------------------------------------------- 3. malicious pickle
class _OpensFile:
    """Unpickling this calls open(marker, "w"): the file appears iff the pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_payload(f: Path, marker: Path, fmt: str) -> None:
    obj = {"model": _OpensFile(marker), "progress": {"step": 10}}
    if fmt == "torch.save":
        torch.save(obj, f)
    else:
        f.write_bytes(pickle.dumps(obj, protocol=2))


def evil_checkpoint(src: Path, dst: Path, marker: Path, fmt: str) -> Path:
    """A copy of a real checkpoint whose state.pt is a code-running pickle, with a manifest that
    verifies (size and sha256 of the new bytes, as loop/checkpoint/store.py computes them)."""
    shutil.copytree(src, dst)
    write_payload(dst / "state.pt", marker, fmt)
    data = (dst / "state.pt").read_bytes()
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    from loop.checkpoint import store
    assert store.verify(dst) is None, "the crafted manifest must verify"
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch.save", "pickle"])
def test_code_running_pickle_is_refused_in_process(tmp_path, base10, fmt):
    from loop.checkpoint import store
    from loop.errors import BadInput

    # The payload is live: an unrestricted load does create its marker.
    live = tmp_path / "live_marker"
    write_payload(tmp_path / "live.pt", live, fmt)
    if fmt == "torch.save":
        torch.load(tmp_path / "live.pt", weights_only=False)
    else:
        pickle.loads((tmp_path / "live.pt").read_bytes())
    assert live.exists()

    marker = tmp_path / "marker"
    d = evil_checkpoint(base10 / "checkpoints" / "step_00000010", tmp_path / "step_00000010",
                        marker, fmt)
    with pytest.raises(BadInput, match="refused to load"):
        store.load(d, "state.pt")
    assert not marker.exists()


@pytest.mark.slow
def test_code_running_pickle_is_refused_by_train_py(tmp_path, cache, base10):
    marker = tmp_path / "marker"
    d = evil_checkpoint(base10 / "checkpoints" / "step_00000010",
                        tmp_path / "evil" / "step_00000010", marker, "torch.save")
    out = tmp_path / "run"

    proc = train_here(out, cache, *BASE, f"run.resume={d}", check=False)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refused to load" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists(), "unpickling ran the payload"
    assert not out.exists(), "nothing is written on the bad-input path"


# ---------------------------------------------------------------------------- 4. shape mismatch
@pytest.mark.slow
def test_shape_mismatch_exits_2_lists_keys_and_changes_nothing(tmp_path, cache, base10):
    out = tmp_path / "run"
    shutil.copytree(base10, out, symlinks=True)
    before = snapshot(out)

    proc = train_here(out, cache, "model.n_embd=48", "model.n_head=2", "train.max_steps=20",
                     "train.ckpt_every=5", check=False)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"wte\.weight.*\(\d+, 32\).*\(\d+, 48\)", proc.stderr), proc.stderr
    assert re.search(r"lm_head\.weight.*\(\d+, 32\).*\(\d+, 48\)", proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_unchanged(before, out)  # config.yaml included: not overwritten with n_embd=48


def test_a_checkpoint_of_another_layout_is_exit_2_and_its_weights_still_start_a_new_run(tmp_path, cache,
                                                                                        base10):
    # A state.pt without the layout this loop writes (format), as another version of the loop left
    # it, with a manifest that verifies: a resume refuses it before anything is loaded or written,
    # and points to run.init_from, which reads the weights alone.
    out = tmp_path / "run"
    shutil.copytree(base10, out, symlinks=True)
    ckpt = out / "checkpoints" / "step_00000010"
    def drop_format(state: dict) -> None:
        assert state.pop("format") == 2

    restate(ckpt, drop_format)
    before = snapshot(out)

    proc = train_here(out, cache, "train.max_steps=20", "train.ckpt_every=5", check=False)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "format 1" in proc.stderr and f"run.init_from={ckpt}" in proc.stderr, proc.stderr
    assert_unchanged(before, out)
    warm = tmp_path / "warm"
    train_here(warm, cache, "train.max_steps=0", f"run.init_from={ckpt}")
    assert summary(warm)["params_sha256"] == summary(base10)["params_sha256"]


def restate(ckpt: Path, edit, name: str = "state.pt") -> None:
    """`edit` applied to a checkpoint's file `name`, its manifest made to verify again."""
    state = torch.load(ckpt / name, weights_only=True)
    edit(state)
    torch.save(state, ckpt / name)
    data = (ckpt / name).read_bytes()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("name, edit, said", [
    ("state.pt", lambda s: s["progress"].update(step=-3), "progress step = -3"),  # trained steps -2..20
    ("state.pt", lambda s: s["progress"].update(micro_split=0), "progress micro_split = 0"),  # after the files
    ("state.pt", lambda s: s["progress"].update(skip_windows=[[0]]), "skip_windows"),
    ("state.pt", lambda s: (s["progress"].update(micro_split=2), s["config"]["data"].update(batch_size=0)),
     "data.batch_size is 0"),  # split for another size: it cuts this run's (it never ended)
    ("state.pt", lambda s: s["progress"].pop("samples"), "KeyError"),
    ("state.pt", lambda s: s.update(scheduler={}), "cannot load its scheduler"),  # the LR started over
    ("state.pt", lambda s: s["monitor"].update(foo=1), "cannot load its monitor"),
    ("state.pt", lambda s: s.update(config=[1, 2]), "cannot load its config and metadata"),
    ("rng_rank0.pt", lambda r: r.update(torch=torch.zeros(10, dtype=torch.uint8)), "random streams"),
    ("rng_rank0.pt", lambda r: r.update(python=(3, (1, 2, 3), None)), "random streams"),
])
def test_plain_data_no_run_writes_is_exit_2_naming_the_file_and_changes_nothing(tmp_path, cache, base10,
                                                                                name, edit, said):
    out = tmp_path / "run"
    shutil.copytree(base10, out, symlinks=True)
    restate(out / "checkpoints" / "step_00000010", edit, name)
    before = snapshot(out)
    proc = train_here(out, cache, *BASE, "train.max_steps=20", check=False)
    assert proc.returncode == 2 and f"checkpoint file {out / 'checkpoints' / 'step_00000010' / name}" in proc.stderr
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert_unchanged(before, out)


@pytest.mark.parametrize("key, value", [("step", -1), ("samples", 2.5), ("micro_split", 0), ("train_s", -1.0),
                                        ("skip_windows", [[8, 16, 24]])])
def test_a_progress_value_no_run_writes_is_refused_naming_it(key, value):
    # A negative training time made tokens_per_s and the report's cost negative, without a word.
    from loop.progress import Progress

    with pytest.raises(ValueError, match=f"progress {key} = "):
        Progress().load_state_dict({**Progress().state_dict(), key: value})


def test_optimizer_state_that_does_not_fit_the_parameters_is_exit_2_and_changes_nothing(tmp_path, cache, base10):
    # torch maps the moments to the parameters by position: a model whose parameters come in another
    # order or shape (here, as edited) ran the fused AdamW over a moment of 9 numbers for a matrix,
    # ended with NaN weights, exit 0 and model.pt overwritten.
    for n, edit in enumerate([lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3, 3)),
                              lambda s: s["optimizer"]["param_groups"][0]["params"].pop()]):
        out = tmp_path / f"run{n}"
        shutil.copytree(base10, out, symlinks=True)
        restate(out / "checkpoints" / "step_00000010", edit)
        before = snapshot(out)
        proc = train_here(out, cache, "train.max_steps=20", "train.ckpt_every=5", check=False)
        assert proc.returncode == 2 and "state.pt: its optimizer state does not fit" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert_unchanged(before, out)
    assert "wte.weight: exp_avg (3, 3) vs parameter" in train_here(
        tmp_path / "run0", cache, "train.max_steps=20", check=False).stderr


# ---------------------------------------------------------------------------- 5. resume modes
@pytest.mark.slow
def test_resume_never_with_checkpoints_exits_2_and_changes_nothing(tmp_path, cache, base10):
    out = tmp_path / "run"
    shutil.copytree(base10, out, symlinks=True)
    before = snapshot(out)

    proc = train_here(out, cache, *BASE, "run.resume=never", check=False)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run.resume=never" in proc.stderr and "run.resume=auto" in proc.stderr, proc.stderr  # to continue
    assert_unchanged(before, out)


def test_resume_never_onto_a_mirror_holding_checkpoints_exits_2_and_changes_nothing(tmp_path, cache):
    # The mirror keeps what checkpoints/ keeps: a fresh run on a mirror that holds another run's
    # checkpoints would delete them at its first copy, as it would overwrite a run.out_dir's. So it
    # exits 2 and leaves the mirror as it is.
    bucket = tmp_path / "bucket"
    train_here(tmp_path / "first", cache, *BASE, "run.resume=never", f"run.mirror={bucket}")  # empty: fine
    before = snapshot(bucket)
    out = tmp_path / "second"
    proc = train_here(out, cache, *BASE, "run.resume=never", f"run.mirror={bucket}", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.endswith(f"error: run.resume=never, but run.mirror={bucket} already holds "
                                f"checkpoints that a fresh run's mirroring would delete; give the run "
                                f"its own run.mirror, or run.resume=auto to continue from them.\n")
    assert not out.exists()
    assert_unchanged(before, bucket)


def test_resume_from_missing_path_exits_2_naming_it(tmp_path, cache):
    missing = tmp_path / "nowhere" / "step_00000099"
    out = tmp_path / "run"

    proc = train_here(out, cache, *BASE, f"run.resume={missing}", check=False)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"error: run.resume={missing}: no such file or directory; expected a "
                           f"checkpoint directory.\n")  # not "manifest.json is missing"
    assert not out.exists(), "nothing is written on the bad-input path"
    proc = train_here(out, cache, *BASE, "run.resume=", check=False)
    assert proc.returncode == 2 and proc.stderr == ("error: config key run.resume is empty; expected "
                                                    "auto, never or a checkpoint directory.\n")
    assert not out.exists()


def test_a_checkpoint_named_by_path_that_does_not_verify_exits_2_and_writes_nothing(tmp_path, cache, base10):
    # A checkpoint named by hand is verified as run.resume=auto verifies the ones it finds: one byte
    # of its state.pt changed still unpickles (here: a weight), and resumed or warm-started from, it
    # trained on weights no run wrote, its manifest's sha256 ignored.
    out = tmp_path / "run"
    shutil.copytree(base10, out, symlinks=True)
    ckpt = out / "checkpoints" / "step_00000010"
    flip_middle_byte(ckpt / "state.pt")
    before = snapshot(out)
    for key, new in (("run.resume", out), ("run.init_from", tmp_path / "warm")):
        proc = train_here(new, cache, *BASE, "train.max_steps=20", f"{key}={ckpt}", check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"{key}={ckpt}: not a valid checkpoint" in proc.stderr and "state.pt" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert_unchanged(before, out)
    assert not (tmp_path / "warm").exists(), "nothing is written on the bad-input path"


# ---------------------------------------------------------------------------- 6. a full disk
def run_with_file_limit(nbytes: int, out: Path, *overrides: str, cmd: list[str] | None = None
                        ) -> subprocess.CompletedProcess:
    """train.py (or `cmd`) under a file-size limit (RLIMIT_FSIZE): a real write failure, no mock.
    The kernel refuses a write past `nbytes` (EFBIG, "File too large"; Python ignores SIGXFSZ), as
    a full disk (ENOSPC) or a quota would, after writing the part that fits."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))  # noqa: E731
    return subprocess.run(cmd or train_cmd(out, *overrides), cwd=ROOT, capture_output=True,
                          text=True, timeout=300, preexec_fn=limit)


WRITE = {  # what train.py writes outside checkpoints, by hand: a 5000-byte file, a 5000-token corpus;
    # and the file the error names
    "model.pt": ("from loop.checkpoint.atomic import atomic_write; atomic_write(d / 'model.pt', bytes(5000))",
                 "model.pt'"),
    "corpus": ("from data.corpus import write_tokens; "
               "write_tokens(d / 'corpus', np.zeros(5000, np.uint16), 0.1, {})", ".corpus.tmp-"),
}


def test_every_write_is_synced_before_it_takes_its_name_and_its_directory_after(tmp_path, monkeypatch):
    # What makes a power cut harmless (loop/checkpoint/atomic.py): after a rename, the whole file or checkpoint
    # is on disk under its name, and so is the name. Inodes survive renames, so they tell the order.
    from loop.checkpoint import store
    from loop.checkpoint.atomic import atomic_write

    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", os.stat(a).st_ino)) or replace(a, b))
    atomic_write(tmp_path / "model.pt", b"weights")
    final = store.save(tmp_path / "ckpts", 7, {"state.pt": {"w": torch.zeros(2)}}, 2, {})
    monkeypatch.undo()
    ino = lambda p: p.stat().st_ino  # noqa: E731
    root, latest = tmp_path / "ckpts", tmp_path / "ckpts" / "latest"
    assert events == [("fsync", ino(tmp_path / "model.pt")), ("replace", ino(tmp_path / "model.pt")),
                      ("fsync", ino(tmp_path)),
                      ("fsync", ino(final / "state.pt")), ("fsync", ino(final / "manifest.json")),
                      ("fsync", ino(final)), ("replace", ino(final)), ("fsync", ino(root)),
                      ("fsync", ino(latest)), ("replace", ino(latest)), ("fsync", ino(root))]


def test_ctrl_c_in_a_file_write_keeps_the_old_file_and_leaves_no_part(tmp_path, monkeypatch):
    # summary.json, model.pt: a Ctrl-C mid-write must not leave `.model.pt.tmp-<pid>` behind, where
    # it would stay for good (the next write, another process, uses another name).
    from loop.checkpoint import atomic

    (tmp_path / "model.pt").write_bytes(b"old")

    def interrupted(path, data):
        path.write_bytes(data[:10])
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "write_synced", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write(tmp_path / "model.pt", bytes(5000))
    assert os.listdir(tmp_path) == ["model.pt"] and (tmp_path / "model.pt").read_bytes() == b"old"


@pytest.mark.parametrize("kind", list(WRITE))
def test_a_refused_file_write_keeps_the_old_file_and_leaves_no_part(tmp_path, kind):
    # atomic_write (model.pt, summary.json, metadata.json) and write_tokens (data.cache_dir).
    (tmp_path / "model.pt").write_bytes(b"old")
    write, named = WRITE[kind]
    code = f"import sys, numpy as np; from pathlib import Path; d = Path(sys.argv[1]); {write}"
    proc = run_with_file_limit(4000, tmp_path, cmd=[sys.executable, "-c", code, str(tmp_path)])
    assert proc.returncode == 1, proc.stderr
    # The error names the file the write was for: a failed write() alone names none.
    assert f"OSError: [Errno 27] File too large: '{tmp_path / named}" in proc.stderr, proc.stderr
    assert (tmp_path / "model.pt").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["model.pt"], "no temp file or dir is left"


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_that_cannot_be_written_exits_3_and_keeps_the_earlier_ones(
        tmp_path, cache, killed, reference, async_save):
    # The limit is well below state.pt's size; the logs and small files still fit.
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    proc = run_with_file_limit(100_000, out, cache, *STEPS, f"train.async_save={async_save}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: checkpoint step 40: cannot write it in {out / 'checkpoints'} "
                                  f"(File too large). Nothing of it is kept"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert ckpt_names(out) == ["step_00000010", "step_00000020", "step_00000030"]
    assert not list((out / "checkpoints").glob(".tmp-*")), "the part written is removed at once"
    rerun = train_here(out, cache, *STEPS)
    assert resumed_at(rerun.stdout)[1] == 30
    assert summary(out)["params_sha256"] == summary(reference)["params_sha256"]
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(reference)]


@pytest.mark.slow
def test_a_log_line_cut_short_by_a_full_disk_exits_3_and_the_rerun_ends_identical(
        tmp_path, cache, killed, reference):
    # The resumed run rewrites metrics.jsonl up to step 30, then its step-31 record meets a limit
    # just past that size: the kernel writes the part that fits and refuses the rest, before any
    # checkpoint is due. The rerun must read past that half line, not fail on it (JSONDecodeError).
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    kept = sum(len(json.dumps(r)) + 1 for r in metrics(out) if r["step"] <= 30)
    proc = run_with_file_limit(kept + 100, out, cache, *STEPS)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        f"error: a write to {out / 'metrics.jsonl'} was refused: File too large. The disk is full, or a "
        f"quota or file-size limit was reached. Any steps trained since the newest checkpoint are lost; "
        f"the checkpoints are whole. Free space in run.out_dir ({out}) and data.cache_dir"), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    log = (out / "metrics.jsonl").read_bytes()
    assert len(log) == kept + 100 and not log.endswith(b"\n"), "the step-31 line is cut short"
    assert ckpt_names(out) == ["step_00000010", "step_00000020", "step_00000030"]
    rerun = train_here(out, cache, *STEPS)
    assert resumed_at(rerun.stdout)[1] == 30
    assert summary(out)["params_sha256"] == summary(reference)["params_sha256"]
    assert (out / "metrics.jsonl").read_bytes().endswith(b"\n")
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(reference)]


@pytest.mark.slow
def test_a_tensorboard_write_refused_exits_3_in_one_line_naming_its_directory(tmp_path, cache, reference):
    # TensorBoard's event file grows faster than metrics.jsonl (550 vs 330 bytes a step here), so
    # it meets the limit first, on TensorBoard's own writer thread. The exit-3 message names the
    # file, in one line, without that thread's traceback. (`reference`: the data cache is ready;
    # its corpus is larger than the limit.)
    out = tmp_path / "run"
    proc = run_with_file_limit(6000, out, cache, "train.max_steps=60", "train.ckpt_every=1000",
                               "train.eval_every=0")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: a write to {out / 'tb'} was refused: File too large."), proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr
    assert (out / "metrics.jsonl").stat().st_size < 6000, "metrics.jsonl was not the file refused"


# ---------------------------------------------------------------------------- 7. retention
def test_keep_last_2_keeps_exactly_the_two_newest(tmp_path, cache):
    out = tmp_path / "run"
    # eval_every=0: no evaluations, so no best checkpoint joins the retained set.
    train_here(out, cache, "train.max_steps=50", "train.ckpt_every=10", "train.keep_last=2",
              "train.eval_every=0")
    ckpts = out / "checkpoints"
    assert ckpt_names(out) == ["step_00000040", "step_00000050"]
    assert (ckpts / "latest").read_text().strip() == "step_00000050"
    leftovers = [p.relative_to(out).as_posix() for p in out.rglob("*") if ".tmp-" in p.name]
    assert not leftovers, leftovers
    from loop.checkpoint import store
    assert all(store.verify(ckpts / n) is None for n in ckpt_names(out))


def test_retention_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    # A resume back in time (run.resume=PATH in the same run.out_dir) saves steps older than the
    # earlier run left there. Retention counting by step would delete the new checkpoint at once:
    # the resumed run would have none of its own, and `latest` would name a directory that is gone.
    from loop.checkpoint import store

    def save(step, keep_last):
        return store.save(tmp_path, step, {"state.pt": {"step": step}}, keep_last, {"world_size": 1})

    for step in (30, 40, 50):
        save(step, keep_last=3)
    new = save(35, keep_last=2)  # resumed from step 30 with train.keep_last=2
    assert [d.name for d in store.step_dirs(tmp_path)] == ["step_00000035", "step_00000040",
                                                               "step_00000050"]
    assert store.verify(new) is None and (tmp_path / "latest").read_text() == new.name


def test_a_file_torch_save_did_not_write_is_named_not_unpickled(tmp_path):
    # Named, not unpickled: as opcodes, text gives an IndexError traceback or "a pickle that would
    # run code".
    from loop.checkpoint import store
    from loop.errors import BadInput

    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "notes.pt").write_text("step_00000010")
    with pytest.raises(BadInput, match=r"empty.pt: not a file torch.save wrote \(it is empty\)"):
        store.load(tmp_path, "empty.pt")
    with pytest.raises(BadInput, match=r"notes.pt: not a file torch.save wrote \(it starts with b'step'\)"):
        store.load(tmp_path, "notes.pt")
    # One torch.save began and did not finish (a model.pt copied in part): torch's reason in one
    # clause, not its 400-character paragraph cut mid-word, and what to do.
    torch.save({"w": torch.zeros(1000)}, tmp_path / "cut.pt")
    truncate_half(tmp_path / "cut.pt")
    with pytest.raises(BadInput) as e:
        store.load(tmp_path, "cut.pt")
    said = str(e.value).replace(str(tmp_path), "DIR")
    assert "cut.pt: not a readable torch checkpoint (" in said and "expected one" in said
    assert "If you are seeing this error" not in said and len(said) < 250, said


def test_a_torch_file_cut_short_is_named_with_torch_s_own_reason_or_its_error_s_name(tmp_path, monkeypatch):
    # The clause in parentheses is torch's first sentence (what is wrong with the file, as torch
    # words it in this version), not only the error's type; an error with no words gives its type,
    # not an empty "()".
    from loop.checkpoint import store
    from loop.errors import BadInput

    torch.save({"w": torch.zeros(1000)}, tmp_path / "cut.pt")
    truncate_half(tmp_path / "cut.pt")
    with pytest.raises(RuntimeError) as torch_said:
        torch.load(tmp_path / "cut.pt", weights_only=True)
    with pytest.raises(BadInput) as e:
        store.load(tmp_path, "cut.pt")
    assert f"({str(torch_said.value).split('. ')[0].strip()})" in str(e.value)

    def wordless(*args, **kwargs):
        raise EOFError()

    monkeypatch.setattr(store.torch, "load", wordless)
    with pytest.raises(BadInput, match=r"not a readable torch checkpoint \(EOFError\)"):
        store.load(tmp_path, "cut.pt")


def test_a_run_whose_checkpoints_were_deleted_is_not_started_over(tmp_path, cache):
    # Only `latest` (and `best`) left in checkpoints/: exit 2, nothing changed. Started over from
    # step 0 without a word, the run would overwrite its metrics.jsonl, summary.json and model.pt.
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=2", "train.ckpt_every=1")
    for step in (out / "checkpoints").glob("step_*"):
        shutil.rmtree(step)
    before = snapshot(out)
    proc = train_here(out, cache, "train.max_steps=4", check=False)
    latest = out / "checkpoints" / "latest"
    assert proc.returncode == 2 and proc.stderr.endswith(
        f"error: run.resume=auto: {latest} names step_00000002, but {out / 'checkpoints'} holds no "
        f"checkpoint; a fresh start would overwrite this run's metrics and model. Expected the "
        f"checkpoints it names; to start over, use a new run.out_dir (or delete {latest}).\n"), proc.stderr
    assert snapshot(out) == before


def test_a_checkpoint_directory_that_cannot_be_made_is_exit_3_not_a_traceback(tmp_path, cache):
    # Making checkpoints/ (or its temporary step directory) is inside the save's handling of write
    # errors: a file in the way, or a directory the user cannot write, is exit 3, not a traceback
    # (exit 1).
    out = tmp_path / "run"
    train_here(out, cache, "train.max_steps=1")
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").write_text("in the way")
    proc = train_here(out, cache, "train.max_steps=2", check=False)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: checkpoint step 2: cannot write it in {out / 'checkpoints'} (File exists)" in proc.stderr
    # Not a full disk: the advice is not to free space (nor, with several nodes, where run.out_dir
    # is not on storage they all see, and a rank's part finds no directory).
    assert "Make it a directory this user can write to (with several nodes" in proc.stderr, proc.stderr


def test_the_shards_a_save_writes_are_in_its_manifest_and_verified(tmp_path):
    # train.strategy=fsdp: each rank's shard files are written by `shards`, beside state.pt; the
    # manifest lists them like every other file, so a shard cut short fails verification.
    from loop.checkpoint import store

    def shards(d):
        (d / "__0_0.distcp").write_bytes(b"shard bytes")
        return ["__0_0.distcp"]

    final = store.save(tmp_path, 3, {"state.pt": {"step": 3}}, 2, {"world_size": 1}, shards=shards)
    listed = json.loads((final / "manifest.json").read_text())["files"]
    assert listed["__0_0.distcp"] == {"size": 11, "sha256": hashlib.sha256(b"shard bytes").hexdigest()}
    assert store.verify(final) is None
    (final / "__0_0.distcp").write_bytes(b"shard")
    assert "__0_0.distcp" in store.verify(final)


def test_sharded_metadata_naming_anything_but_dcp_s_own_classes_is_refused_before_it_runs(tmp_path):
    # .metadata is unpickled by loop/checkpoint/sharded.py allowing only what DCP writes there: a
    # name DCP's metadata module merely imports (dataclasses.field, reached through it) is no class
    # of DCP's, and calling it is what a tampered pickle would do.
    from loop.checkpoint import sharded
    from loop.errors import BadInput

    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.metadata\nfield\n)R.")
    with pytest.raises(BadInput, match=r"refused to load .*Unsupported global: "
                                       r"torch\.distributed\.checkpoint\.metadata\.field"):
        sharded.metadata(tmp_path)
