"""Proves the checkpoint mirror copies complete checkpoints byte for byte (dir, file://, memory://),
follows local retention, never blocks or breaks training, and fetch_latest restores the newest valid
one, skipping incomplete or corrupt copies."""
from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import train
from conftest import TINY
from loop.checkpoint import store
from loop.checkpoint.fetch import fetch_latest
from loop.checkpoint.mirror import Mirror
from loop.errors import BadInput

NAMES = ["state.pt", "rng_rank0.pt", "manifest.json"]


def save(root: Path, step: int, keep_last: int = 10) -> Path:
    files = {"state.pt": {"w": torch.full((4, 4), float(step)), "step": step},
             "rng_rank0.pt": {"cpu": torch.arange(step, step + 8, dtype=torch.uint8)}}
    return store.save(root, step, files, keep_last=keep_last, meta={"world_size": 1})


def run_with_mirror(mirror: Mirror, root: Path, steps, keep_last: int = 10) -> None:
    """What the trainer does: save, then hand the mirror the new dir and the local retention set."""
    for step in steps:
        path = save(root, step, keep_last)
        mirror.submit(path, {p.name for p in store.step_dirs(root)})
    mirror.close()


def mem_target() -> str:
    return f"memory://t-{uuid.uuid4().hex}/run"


def remote(target: str, *parts: str) -> str:
    fs, root = fsspec.core.url_to_fs(target)
    return "/".join([root, *parts])


def assert_same(target: str, local: Path) -> None:
    fs, _ = fsspec.core.url_to_fs(target)
    for name in NAMES:
        assert fs.cat_file(remote(target, local.name, name)) == (local / name).read_bytes(), name


def mirrored_names(target: str) -> set[str]:
    fs, root = fsspec.core.url_to_fs(target)
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}


@pytest.mark.parametrize("scheme", ["", "file://", "memory"])
def test_mirror_copies_bytes_and_follows_retention(tmp_path, scheme, capsys):
    target = mem_target() if scheme == "memory" else f"{scheme}{tmp_path / 'bucket' / 'run'}"
    root = tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(target), root, [10, 20, 30, 40], keep_last=2)
    local = store.step_dirs(root)
    assert [p.name for p in local] == ["step_00000030", "step_00000040"]
    assert mirrored_names(target) == {"step_00000030", "step_00000040", "latest"}
    for path in local:
        assert_same(target, path)
    fs, _ = fsspec.core.url_to_fs(target)
    assert fs.cat_file(remote(target, "latest")) == b"step_00000040"
    assert capsys.readouterr().err == ""


def test_fetch_latest_from_memory_restores_newest(tmp_path):
    target, root = mem_target(), tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(target), root, [1, 2, 3])
    fresh = tmp_path / "fresh" / "checkpoints"
    got = fetch_latest(target, fresh)
    assert got == fresh / "step_00000003" and store.verify(got) is None
    for name in NAMES:
        assert (got / name).read_bytes() == (root / got.name / name).read_bytes()
    assert (fresh / "latest").read_text() == "step_00000003"
    assert sorted(p.name for p in fresh.iterdir()) == ["latest", "step_00000003"]  # no temp dirs left
    assert fetch_latest(target, fresh) == got  # again: replaces it with the same


def test_fetch_latest_skips_incomplete_and_corrupt(tmp_path, capsys):
    target, root = mem_target(), tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(target), root, [1, 2, 3])
    fs, _ = fsspec.core.url_to_fs(target)
    fs.rm_file(remote(target, "step_00000003", "manifest.json"))  # a copy cut short
    data = bytearray(fs.cat_file(remote(target, "step_00000002", "state.pt")))
    data[-10] ^= 0xFF  # one flipped byte, same size
    fs.pipe_file(remote(target, "step_00000002", "state.pt"), bytes(data))
    fresh = tmp_path / "fresh"
    got = fetch_latest(target, fresh)
    assert got == fresh / "step_00000001" and store.verify(got) is None
    err = capsys.readouterr().err
    assert "step_00000003" in err and "incomplete" in err
    assert "step_00000002" in err and "state.pt does not match its sha256" in err
    assert sorted(p.name for p in fresh.iterdir()) == ["latest", "step_00000001"]


def test_a_mirrored_manifest_naming_a_file_outside_its_dir_writes_nothing_there(tmp_path, capsys):
    # A mirror is read from a bucket others may write to: a manifest naming ../x (with its true
    # sha256) would have the fetch write x beside the checkpoints, outside the temporary dir.
    target, root = tmp_path / "bucket", tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(str(target)), root, [1, 2])
    (target / "planted.pt").write_bytes(b"not a checkpoint file")
    manifest = json.loads((target / "step_00000002" / "manifest.json").read_text())
    planted = {"size": 21, "sha256": hashlib.sha256(b"not a checkpoint file").hexdigest()}
    manifest["files"]["../planted.pt"] = planted
    (target / "step_00000002" / "manifest.json").write_text(json.dumps(manifest))
    fresh = tmp_path / "fresh"
    assert fetch_latest(str(target), fresh) == fresh / "step_00000001"
    assert "step_00000002: manifest.json names a file outside its dir: '../planted.pt'" in capsys.readouterr().err
    assert sorted(p.name for p in fresh.iterdir()) == ["latest", "step_00000001"]


def test_a_sharded_checkpoints_dcp_metadata_is_fetched(tmp_path):
    # An FSDP checkpoint holds torch.distributed.checkpoint's `.metadata`: a fetch that refused
    # every name starting with a dot as "outside its dir" would never resume an FSDP run from its
    # mirror; it would start over from step 0 without an error, and its mirroring prune the copies.
    target, root = mem_target(), tmp_path / "ckpt"
    path = store.save(root, 1, {"state.pt": {"step": 1}, ".metadata": {"plan": 1}}, keep_last=3,
                           meta={"world_size": 2})
    run = Mirror(target)
    run.submit(path, {path.name})
    run.close()
    got = fetch_latest(target, tmp_path / "fresh")
    assert got == tmp_path / "fresh" / "step_00000001" and store.verify(got) is None
    assert (got / ".metadata").read_bytes() == (path / ".metadata").read_bytes()


def test_a_run_with_local_checkpoints_resumes_from_them_not_the_mirror(tmp_path):
    # The mirror is for a machine that lost its disk. Its copies lag (they run in the background):
    # one with checkpoints of its own resumes from its newest, and the mirror's copy of step 2 does
    # not replace the local one.
    from loop.checkpoint.resume import choose

    target, root = mem_target(), tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(target), root, [1, 2])
    save(root, 3)  # written; the run was killed before the mirror had it
    before = (root / "step_00000002" / "state.pt").stat().st_mtime_ns
    assert choose("auto", root, target) == root / "step_00000003"
    assert (root / "step_00000002" / "state.pt").stat().st_mtime_ns == before
    shutil.rmtree(root)  # the disk lost: now the mirror's newest
    assert choose("auto", root, target) == root / "step_00000002"


def test_a_run_whose_local_checkpoints_none_verifies_resumes_from_the_mirror(tmp_path):
    # docs/resume.md: no valid checkpoint in checkpoints/ (a damaged disk) and run.mirror set: the
    # mirror's newest, which replaces the damaged local copy of its step. Without a mirror, exit 2.
    from loop.checkpoint.resume import choose

    target, root = mem_target(), tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(target), root, [1, 2])
    for step in (1, 2):
        (root / f"step_0000000{step}" / "state.pt").write_bytes(b"damaged")
    with pytest.raises(BadInput, match="verifies"):
        choose("auto", root, "")
    assert choose("auto", root, target) == root / "step_00000002"
    assert store.verify(root / "step_00000002") is None
    assert_same(target, root / "step_00000002")


def test_a_run_resumed_from_its_mirror_keeps_the_best_checkpoint_there(tmp_path, cache):
    # The disk lost, the resume fetches the newest alone; the mirror's prune keeps the best too
    # (retention: the newest train.keep_last and the best), not only what the new disk holds.
    out, target = tmp_path / "run", tmp_path / "mirror"
    args = [f"run.out_dir={out}", f"run.mirror={target}", *TINY, cache, "train.eval_every=10",
            "train.ckpt_every=10", "train.keep_last=1", "train.best_mode=max"]  # max: step 10 stays best

    def mirrored() -> set[str]:
        return {p.name for p in target.iterdir() if p.name.startswith("step_")}

    assert train.main([*args, "train.max_steps=40"]) == 0
    assert mirrored() == {"step_00000010", "step_00000040"}
    shutil.rmtree(out / "checkpoints")
    assert train.main([*args, "train.max_steps=60"]) == 0
    assert mirrored() == {"step_00000010", "step_00000060"}
    assert json.loads((out / "summary.json").read_text())["best"]["step"] == 10


def test_a_rerun_copies_the_last_checkpoint_a_kill_kept_from_the_mirror(tmp_path, cache):
    # A kill after the run's last checkpoint was renamed into place, before its copy: the rerun
    # resumes from it and saves nothing, so only the rerun can give the mirror its copy.
    out, target = tmp_path / "run", tmp_path / "mirror"
    args = [f"run.out_dir={out}", f"run.mirror={target}", *TINY, cache, "train.max_steps=4",
            "train.ckpt_every=2"]
    assert train.main(args) == 0
    shutil.rmtree(target / "step_00000004")
    (target / "latest").write_text("step_00000002")
    assert train.main(args) == 0
    assert_same(str(target), out / "checkpoints" / "step_00000004")
    assert (target / "latest").read_text() == "step_00000004"
    copied = (target / "step_00000004" / "manifest.json").stat().st_mtime_ns
    assert train.main(args) == 0  # a copy that is whole is not made again
    assert (target / "step_00000004" / "manifest.json").stat().st_mtime_ns == copied
    # The mirror behind: the copy before the last one cut short (its manifest comes last), then
    # pruned by the last one's copy; or the mirror's `latest` not yet written after the last copy.
    (target / "step_00000002" / "manifest.json").unlink()
    assert train.main(args) == 0
    assert mirrored_names(str(target)) >= {"step_00000002", "step_00000004"}
    assert_same(str(target), out / "checkpoints" / "step_00000002")
    assert (target / "latest").read_text() == "step_00000004"
    (target / "latest").write_text("step_00000002")  # named again, its whole copy not made again
    copied = (target / "step_00000004" / "manifest.json").stat().st_mtime_ns
    assert train.main(args) == 0
    assert (target / "latest").read_text() == "step_00000004"
    assert (target / "step_00000004" / "manifest.json").stat().st_mtime_ns == copied
    (out / "checkpoints" / "step_00000002" / "manifest.json").unlink()  # one here damaged by hand:
    assert train.main(args) == 0  # passed over, not a traceback
    # Another start's checkpoint of the same step there (a resume back in time, killed before its
    # copy): not this run's, so copied over.
    manifest = target / "step_00000004" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "resumed_from": "elsewhere"}))
    assert train.main(args) == 0
    assert_same(str(target), out / "checkpoints" / "step_00000004")


def test_a_resume_path_command_rerun_on_a_new_disk_continues_from_the_mirror(tmp_path, cache):
    # A requeue onto a node whose out_dir is empty: the same command continues from this run's
    # newest, which the mirror holds (its manifest names run.resume's PATH as where it started),
    # rather than training from PATH again.
    from conftest import metrics, train_here

    src = tmp_path / "src"
    assert train.main([f"run.out_dir={src}", *TINY, cache, "train.max_steps=2", "train.ckpt_every=2"]) == 0
    start = src / "checkpoints" / "step_00000002"
    out, keys = tmp_path / "run", [f"run.mirror={tmp_path / 'mirror'}", f"run.resume={start}", cache,
                                   "train.ckpt_every=2"]
    train_here(out, *keys, "train.max_steps=6")
    shutil.rmtree(out)
    proc = train_here(out, *keys, "train.max_steps=8")
    assert "continuing from" in proc.stdout and [r["step"] for r in metrics(out)] == [7, 8]


def test_a_resume_path_start_leaves_a_mirrored_checkpoint_of_another_start_alone(tmp_path):
    # The mirror's newest did not start at PATH: not fetched into the new run's checkpoints/, where
    # it would count as this run's newest (and its retention would prune the run's own).
    from loop.checkpoint.resume import choose

    target = str(tmp_path / "mirror")
    run_with_mirror(Mirror(target), tmp_path / "other" / "checkpoints", [5])
    start = save(tmp_path / "src" / "checkpoints", 2)
    root = tmp_path / "run" / "checkpoints"
    assert choose(str(start), root, target) == start and not store.step_dirs(root)


def test_holds_says_no_only_when_the_mirror_is_read_and_lacks_the_checkpoint(tmp_path, monkeypatch):
    # A mirror that cannot be read now (a network blip) holds the checkpoint as far as anyone knows:
    # copying it again on a guess deletes the whole copy there first. Read and missing, or another
    # start's checkpoint of the same step (its manifest differs): it is copied.
    target = mem_target()
    mirror = Mirror(target)
    run_with_mirror(mirror, tmp_path / "ckpt", [1])
    path = tmp_path / "ckpt" / "step_00000001"
    fs, there = mirror.fs, remote(target, path.name, "manifest.json")
    assert mirror.holds(path)

    def unreachable(p, *args, **kwargs):
        raise ConnectionError("bucket unreachable")
    with monkeypatch.context() as m:
        m.setattr(fs, "cat_file", unreachable)
        assert mirror.holds(path)
    fs.pipe_file(there, b"{}")  # another start's manifest
    assert not mirror.holds(path)
    fs.rm_file(there)  # FileNotFoundError: a copy cut short
    assert not mirror.holds(path)


def test_fetch_latest_none_when_mirror_empty(tmp_path):
    assert fetch_latest(mem_target(), tmp_path / "a") is None  # does not exist
    (tmp_path / "empty").mkdir()
    assert fetch_latest(str(tmp_path / "empty"), tmp_path / "b") is None


def test_failing_target_warns_once_and_training_goes_on(tmp_path, capsys):
    mirror = Mirror(str(tmp_path / "run"), retries=2, backoff_s=0)
    (tmp_path / "run").rmdir()  # the mirror goes away mid-run: a file where its directory was
    (tmp_path / "run").write_text("not a dir")
    run_with_mirror(mirror, tmp_path / "ckpt", [1])
    err = capsys.readouterr().err
    assert err.count("warning: mirror") == 1
    assert f"could not copy {tmp_path / 'ckpt' / 'step_00000001'}" in err and "training goes on" in err


def test_put_raising_is_retried_then_warned(tmp_path, monkeypatch, capsys):
    mirror = Mirror(mem_target(), retries=3, backoff_s=0)
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise OSError("bucket unreachable")
    monkeypatch.setattr(mirror.fs, "put_file", broken)
    run_with_mirror(mirror, tmp_path / "ckpt", [1, 2])
    err = capsys.readouterr().err
    assert len(calls) == 2 * 4  # each checkpoint: 1 try + 3 retries
    assert err.count("could not copy") == 2 and "OSError: bucket unreachable" in err


def test_submit_returns_while_copy_is_stuck(tmp_path, monkeypatch):
    target, root = mem_target(), tmp_path / "ckpt"
    mirror = Mirror(target)
    started, release = threading.Event(), threading.Event()
    real = mirror.fs.put_file

    def stuck(*args, **kwargs):
        started.set()
        release.wait()
        return real(*args, **kwargs)
    monkeypatch.setattr(mirror.fs, "put_file", stuck)
    mirror.submit(save(root, 1), {"step_00000001"})
    assert started.wait(30)  # the copy is now blocked inside put_file
    # A thread only so a regression fails instead of hanging the suite; the join is a safety net.
    keep = {"step_00000001", "step_00000002"}
    submitter = threading.Thread(target=mirror.submit, args=(save(root, 2), keep))
    submitter.start()
    submitter.join(30)
    assert not submitter.is_alive() and not release.is_set()  # returned while the copy is stuck
    fs, _ = fsspec.core.url_to_fs(target)
    assert not fs.exists(remote(target, "step_00000001", "manifest.json"))  # not copied yet
    release.set()
    mirror.close()
    assert mirrored_names(target) == {"step_00000001", "step_00000002", "latest"}


def test_close_timeout_abandons_stuck_copy(tmp_path, monkeypatch, capsys):
    mirror = Mirror(mem_target())
    release = threading.Event()
    copied = []
    monkeypatch.setattr(mirror.fs, "put_file", lambda src, dest: release.wait() and copied.append(dest))
    mirror.submit(save(tmp_path, 1), {"step_00000001"})
    mirror.submit(save(tmp_path, 2), {"step_00000001", "step_00000002"})
    mirror.close(timeout_s=0.05)
    assert "abandoned" in capsys.readouterr().err
    release.set()
    mirror._thread.join(30)
    assert not mirror._thread.is_alive()
    assert copied and not [d for d in copied if "step_00000002" in d]  # the one queued is skipped


def test_invalid_checkpoint_is_not_mirrored(tmp_path, capsys):
    target = mem_target()
    path = save(tmp_path, 1)
    (path / "state.pt").write_bytes(b"garbage")
    mirror = Mirror(target)
    mirror.submit(path, {path.name})
    mirror.close()
    assert "does not verify" in capsys.readouterr().err
    assert fetch_latest(target, tmp_path / "fresh") is None


def test_a_checkpoint_pruned_locally_before_or_while_it_is_copied_is_passed_over_quietly(
        tmp_path, capsys, monkeypatch):
    # A mirror behind frequent checkpoints: the local retention deletes one still queued, or being
    # copied, as it saves the next (queued behind it). Not a mirror failure to warn about: the
    # newer one is mirrored, and the part copy, never fetched, goes at the next prune.
    target, root = mem_target(), tmp_path / "out" / "checkpoints"
    mirror = Mirror(target)
    gone, cut = save(root, 1), save(root, 2)
    shutil.rmtree(gone)  # before its turn
    put = mirror.fs.put_file

    def pruned_midway(src, dst, *args, **kwargs):
        shutil.rmtree(cut, ignore_errors=True)
        return put(src, dst, *args, **kwargs)

    monkeypatch.setattr(mirror.fs, "put_file", pruned_midway)
    mirror.submit(gone, set())
    mirror.submit(cut, {cut.name})
    mirror.close()
    monkeypatch.undo()
    assert capsys.readouterr().err == ""
    assert fetch_latest(target, tmp_path / "fresh") is None
    run_with_mirror(Mirror(target), root, [3])
    assert mirrored_names(target) == {"step_00000003", "latest"}


def test_unknown_protocol_is_bad_input():
    with pytest.raises(BadInput, match="run.mirror=nope://x"):
        Mirror("nope://x")


@pytest.mark.parametrize("where", ["afile/run", "/proc/mirror"])
def test_a_local_mirror_that_cannot_be_made_is_bad_input_at_once(tmp_path, where):
    # Bad input at once, not a warning at every checkpoint ("could not copy ...; training goes on")
    # of a run that looks backed up, and no error at all when resuming from a local checkpoint.
    (tmp_path / "afile").write_text("")
    target = str(tmp_path / where)  # an absolute `where` stays as it is
    with pytest.raises(BadInput) as e:
        Mirror(target)
    assert str(e.value).startswith(f"run.mirror={target}: cannot make the directory or write in it ("), str(e.value)


def test_a_local_mirror_this_user_cannot_write_in_is_bad_input_at_once(tmp_path, cache):
    # A directory that exists but takes no files (read-only, or, for root too, sysfs): exit 2
    # before anything is written, not "could not copy" at every checkpoint and a run ending 0.
    target = Path("/sys/kernel")
    if not target.is_dir():
        pytest.skip("needs sysfs, a directory even root cannot write in")
    out = tmp_path / "run"
    assert train.main([f"run.out_dir={out}", f"run.mirror={target}", *TINY, cache, "train.max_steps=2"]) == 2
    assert not out.exists()


def test_a_mirror_that_cannot_be_listed_is_bad_input(tmp_path):
    # A file where the mirror directory should be: bad input, not a NotADirectoryError traceback
    # at startup.
    (tmp_path / "afile").write_text("")
    with pytest.raises(BadInput) as e:
        fetch_latest(str(tmp_path / "afile" / "run"), tmp_path / "ckpt")
    assert str(e.value) == (f"run.mirror={tmp_path / 'afile' / 'run'}: cannot list it (Not a "
                            f"directory). Expected a directory path or an fsspec URL this machine can read.")
    assert not (tmp_path / "ckpt").exists()


def test_a_step_directory_linked_into_a_local_mirror_is_neither_pruned_through_nor_fetched(tmp_path):
    # Pruning it deleted the manifest of the checkpoint it linked to, outside the mirror.
    victim = save(tmp_path / "elsewhere", 50)
    target, root = tmp_path / "bucket", tmp_path / "out" / "checkpoints"
    target.mkdir()
    (target / "step_00000099").symlink_to(victim)
    run_with_mirror(Mirror(str(target)), root, [10, 20, 30], keep_last=2)
    assert store.verify(victim) is None and (target / "step_00000099").is_symlink()
    assert fetch_latest(str(target), tmp_path / "fresh").name == "step_00000030"


def test_copy_cut_short_is_never_fetched_and_the_next_copy_deletes_it(tmp_path, capsys):
    target, root = mem_target(), tmp_path / "ckpt"
    run_with_mirror(Mirror(target), root, [1])
    fs, _ = fsspec.core.url_to_fs(target)
    # What a run killed while copying step 2 leaves: its state.pt, not yet the rest and the manifest.
    fs.pipe_file(remote(target, "step_00000002", "state.pt"), (save(root, 2) / "state.pt").read_bytes())
    got = fetch_latest(target, tmp_path / "fresh")
    assert got is not None and got.name == "step_00000001"
    assert "step_00000002: incomplete" in capsys.readouterr().err
    run_with_mirror(Mirror(target), root, [3])  # the rerun's first copy
    assert mirrored_names(target) == {"step_00000001", "step_00000003", "latest"}


@pytest.mark.parametrize("first_delete_fails", [False, True])
def test_a_recopy_cut_short_does_not_pass_for_whole(tmp_path, monkeypatch, first_delete_fails):
    # A step saved again (run.resume=PATH back in time in the same run.out_dir trains through it
    # once more) is copied over its earlier copy. Cut short there, neither the earlier copy nor its
    # manifest may pass for whole: the mirror would take it for its newest whole checkpoint and
    # delete the last good one, leaving nothing to resume from (only `latest`). The earlier copy is
    # deleted before the copy; where that fails, the copy takes its manifest away first.
    target, root = mem_target(), tmp_path / "ckpt"
    run_with_mirror(Mirror(target), root, [1, 2])
    mirror = Mirror(target, retries=0)
    real_put, real_rm_file = mirror.fs.put_file, mirror.fs.rm_file

    def cut(lpath, rpath, **kwargs):  # the connection drops after the first file
        real_put(lpath, rpath, **kwargs)
        raise OSError("connection reset")

    def rm_file(path, **kwargs):  # an object store's transient error, once
        if first_delete_fails and not hasattr(rm_file, "failed"):
            rm_file.failed = True
            raise OSError("503 slow down")
        return real_rm_file(path, **kwargs)
    monkeypatch.setattr(mirror.fs, "put_file", cut)
    monkeypatch.setattr(mirror.fs, "rm_file", rm_file)
    again = store.save(root, 2, {"state.pt": {"w": torch.zeros(4, 4), "step": 2},
                                      "rng_rank0.pt": {"cpu": torch.zeros(8, dtype=torch.uint8)}},
                            keep_last=1, meta={"world_size": 1})  # other bytes; step 1 gone locally
    mirror.submit(again, {p.name for p in store.step_dirs(root)})
    mirror.close()
    assert mirrored_names(target) == {"step_00000001", "latest"}  # the part copy deleted
    assert fetch_latest(target, tmp_path / "fresh").name == "step_00000001"


@pytest.mark.parametrize("room", [2.5, 1.5])  # checkpoints' worth
def test_a_full_mirror_makes_room_and_keeps_its_newest_whole_checkpoint(tmp_path, monkeypatch,
                                                                        capsys, room):
    # A mirror with room for 2 checkpoints and keep_last=2 makes room before the third: pruning only
    # after a good copy, it would fill up, every copy from then on would fail, each leaving a part
    # copy, and the mirror would stay at step 2 for the rest of the run. Room for only one: the part
    # copies are deleted, the newest whole checkpoint stays.
    target, root = str(tmp_path / "bucket"), tmp_path / "ckpt"
    mirror = Mirror(target, retries=0)
    size = sum(f.stat().st_size for f in save(tmp_path / "probe", 1).iterdir())
    real, copied = mirror.fs.put_file, threading.Semaphore(0)

    def quota(lpath, rpath, **kwargs):  # a disk of `room` checkpoints: ENOSPC midway through a file
        used = sum(f.stat().st_size for f in Path(target).rglob("*") if f.is_file())
        if used + Path(lpath).stat().st_size > room * size:
            Path(rpath).write_bytes(Path(lpath).read_bytes()[:10])
            copied.release()
            raise OSError(28, "No space left on device")
        real(lpath, rpath, **kwargs)
        if Path(lpath).name == "manifest.json":  # its last file
            copied.release()
    monkeypatch.setattr(mirror.fs, "put_file", quota)
    # Each copy ends before the next save. A thread that lags behind (a loaded machine) finds steps
    # that keep_last has deleted locally since, and skips them as it skips any checkpoint that does
    # not verify (test_invalid_checkpoint_...): fewer refusals than the 5 counted below.
    for step in range(1, 7):
        path = save(root, step, keep_last=2)
        mirror.submit(path, {p.name for p in store.step_dirs(root)})
        assert copied.acquire(timeout=60)
    mirror.close()
    if room == 2.5:
        assert mirrored_names(target) == {"step_00000005", "step_00000006", "latest"}
        assert "could not copy" not in capsys.readouterr().err
    else:
        assert mirrored_names(target) == {"step_00000001", "latest"}
        assert capsys.readouterr().err.count("No space left on device") == 5
    got = fetch_latest(target, tmp_path / "fresh")
    assert got.name == ("step_00000006" if room == 2.5 else "step_00000001")


def test_a_run_that_gives_up_mirrors_its_newest_checkpoint_and_leaves_no_thread(
        tmp_path, cache, monkeypatch):
    """Exit 3 one step after a checkpoint, on a mirror whose copies take a second (an upload): the
    copy is finished before the run returns, as at a run's end, so a machine given back after the
    failure keeps it. Its thread, TensorBoard's writer and the metrics file are closed, so train.main
    called again in the same process (a notebook) has no thread of the failed run beside it."""
    copy = Mirror._copy
    monkeypatch.setattr(Mirror, "_copy", lambda self, ckpt: (time.sleep(1), copy(self, ckpt)))
    before = set(threading.enumerate())
    code = train.main([f"run.out_dir={tmp_path / 'run'}", f"run.mirror={tmp_path / 'mirror'}", *TINY,
                       cache, "train.max_steps=20", "train.ckpt_every=5", "train.nan_policy=abort",
                       "faults.nan_at_step=6"])
    assert code == 3
    assert store.verify(tmp_path / "mirror" / "step_00000005") is None
    assert (tmp_path / "mirror" / "latest").read_text() == "step_00000005"
    assert set(threading.enumerate()) == before


def test_a_run_that_fails_before_its_first_step_leaves_no_thread(tmp_path, cache, monkeypatch):
    # Under nan_policy=rollback a run writes a checkpoint of step 0 first: on a disk that refuses
    # it, exit 3, and the mirror's thread and TensorBoard's writer, already open, are closed, not
    # left running (train.main called again in a notebook would have them beside it).
    import errno

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write", full_disk)
    before = set(threading.enumerate())
    code = train.main([f"run.out_dir={tmp_path / 'run'}", f"run.mirror={tmp_path / 'mirror'}", *TINY,
                       cache, "train.max_steps=5", "train.nan_policy=rollback"])
    assert code == 3
    assert not store.step_dirs(tmp_path / "run" / "checkpoints")
    assert set(threading.enumerate()) == before


def test_a_mirror_whose_whole_checkpoints_none_can_be_fetched_is_bad_input(tmp_path, capsys):
    # Unreadable copies (a credential, a full local disk, damage): bad input, or the run would
    # start over and its mirroring delete them. A copy cut short (no manifest) alone is still no
    # checkpoint at all.
    target, root = mem_target(), tmp_path / "out" / "checkpoints"
    run_with_mirror(Mirror(target), root, [1, 2])
    fs, _ = fsspec.core.url_to_fs(target)
    for step in (1, 2):
        fs.pipe_file(remote(target, f"step_0000000{step}", "state.pt"), b"damaged")
    fresh = tmp_path / "fresh" / "checkpoints"
    with pytest.raises(BadInput) as e:
        fetch_latest(target, fresh)
    assert str(e.value) == (
        f"run.mirror={target}: none of its 2 whole checkpoints could be fetched or verifies (see the "
        f"warnings above); expected at least one valid checkpoint, as a fresh start would delete "
        f"them from the mirror. Fix what the warnings name, or give the run a new run.mirror.")
    assert capsys.readouterr().err.count("warning: skipping mirrored checkpoint") == 2
    assert not fresh.exists() and mirrored_names(target) >= {"step_00000001", "step_00000002"}
    fs.rm_file(remote(target, "step_00000001", "manifest.json"))
    fs.rm_file(remote(target, "step_00000002", "manifest.json"))
    assert fetch_latest(target, fresh) is None


@pytest.mark.parametrize("mirror", ["own", "other"])
def test_a_local_mirror_inside_what_a_run_writes_is_bad_input(tmp_path, cache, mirror):
    # On its own checkpoints/, the mirror's copy would delete the manifests it copies over and its
    # prune every step directory but the oldest; on another run's, it would prune that run's
    # checkpoints.
    other = tmp_path / "other"
    assert train.main([f"run.out_dir={other}", *TINY, cache, "train.max_steps=2", "train.ckpt_every=1"]) == 0
    out = tmp_path / "run"
    target = out / "checkpoints" if mirror == "own" else other / "checkpoints"
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    code = train.main([f"run.out_dir={out}", f"run.mirror={target}", *TINY, cache, "train.max_steps=2"])
    assert code == 2 and not out.exists()
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
