"""Run metadata: the git commit and dirty flag of a real repository, the hardware fingerprint, no
secret-looking environment values or command-line values, and the metadata inside checkpoints."""
from __future__ import annotations

import json
import shutil
import subprocess

import torch

from conftest import ROOT, run_train, train_here
from loop.observe import metadata


def git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_commit_and_dirty_flag_in_a_temp_repo(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    clean = metadata.git_info(tmp_path)
    assert clean == {"commit": head, "dirty": False, "diff_sha256": None}
    (tmp_path / "a.txt").write_text("two\n")
    dirty = metadata.git_info(tmp_path)
    assert dirty["commit"] == head and dirty["dirty"] is True and len(dirty["diff_sha256"]) == 64
    (tmp_path / "a.txt").write_text("three\n")
    assert metadata.git_info(tmp_path)["diff_sha256"] != dirty["diff_sha256"]  # hash of the diff


def test_a_run_s_own_directory_inside_the_tree_does_not_make_it_dirty(tmp_path):
    # A resumed run whose run.out_dir lies in the tree, unignored: its own files are no code change.
    # Any other untracked file is (a new module the run may import).
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    (tmp_path / "out [1]").mkdir()
    (tmp_path / "out [1]" / "metrics.jsonl").write_text("{}\n")  # a name git would read as a glob
    assert metadata.git_info(tmp_path, written=tmp_path / "out [1]")["dirty"] is False
    assert metadata.git_info(tmp_path)["dirty"] is True
    assert metadata.git_info(tmp_path, written=tmp_path)["dirty"] is True  # the tree itself: not left out
    git(tmp_path, "add", "out [1]/metrics.jsonl")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a run's file committed")
    (tmp_path / "out [1]" / "metrics.jsonl").write_text("{}\n{}\n")  # a tracked file changed: its diff
    changed = metadata.git_info(tmp_path, written=tmp_path / "out [1]")
    assert changed["dirty"] is True and changed["diff_sha256"] is not None
    git(tmp_path, "checkout", "-q", "--", "out [1]/metrics.jsonl")
    (tmp_path / "mine.py").write_text("")
    assert metadata.git_info(tmp_path, written=tmp_path / "out [1]")["dirty"] is True
    assert metadata.git_info(tmp_path, written=tmp_path / "elsewhere")["dirty"] is True


def test_what_the_project_writes_leaves_the_tree_clean(tmp_path):
    # The dirty flag counts untracked files, so everything the project writes by default must be
    # git-ignored: an unignored comparison report (python -m tools.report A B -> reports/A_vs_B/)
    # would make every later run's metadata say its code is dirty.
    shutil.copy(ROOT / ".gitignore", tmp_path)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".gitignore")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    for name in ("runs", "data/cache"):  # each a link to a scratch disk, as on many clusters
        scratch = tmp_path.parent / f"{tmp_path.name}-scratch-{name.replace('/', '-')}"
        scratch.mkdir()
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(scratch)
    for path in ["runs/default/metrics.jsonl", "reports/a_vs_b/report.md", "data/cache/t/tokens.bin",
                 ".venv/.stamp", ".pytest_cache/v", "loop/__pycache__/x.pyc", ".env"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert metadata.git_info(tmp_path)["dirty"] is False


def test_no_secrets_and_the_hardware_is_described(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_API_KEY", "sk-not-for-logs-1")
    monkeypatch.setenv("PYTORCH_HUB_TOKEN", "tok-not-for-logs-2")
    monkeypatch.setenv("SLURM_DB_PASSWORD", "pw-not-for-logs-3")
    monkeypatch.setenv("MY_SECRET", "s-not-for-logs-4")
    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "1")  # a compiled run's kernels
    out = tmp_path / "run"
    run_train(out, cache, "train.max_steps=2", "train.ckpt_every=2")
    text = (out / "metadata.json").read_text()
    for secret in ("not-for-logs", "NCCL_API_KEY", "PYTORCH_HUB_TOKEN", "SLURM_DB_PASSWORD", "MY_SECRET"):
        assert secret not in text, secret
    meta = json.loads(text)
    assert meta["environment"]["NCCL_DEBUG"] == "INFO"
    assert meta["environment"]["TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"] == "1"
    hw = meta["hardware"]
    assert hw["cpu_cores"] >= 1 and hw["ram_gb"] > 0.5 and hw["gpu_count"] == torch.cuda.device_count()
    assert len(hw["host_sha256"]) == 16 and hw["cpu"]
    state = torch.load(out / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)
    assert state["metadata"]["config_sha256"] == meta["config_sha256"]
    assert meta["code_sha256"] == state["metadata"]["code_sha256"] == metadata.code_hash(ROOT)


def test_the_code_hash_covers_the_training_code_and_nothing_else(tmp_path):
    # A project copied or downloaded as a zip has no .git: this hash still names its code.
    files = {"train.py": "main()", "loop/a.py": "x = 1", "data/b/c.py": "y = 2", "model/d.py": ""}
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    first = metadata.code_hash(tmp_path)
    for path in ["README.md", "configs/x.yaml", "runs/r/metrics.jsonl", "loop/notes.txt", "tests/t.py",
                 "data/cache/downloaded/setup.py"]:  # the data cache is not walked
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("not code that trains")
    assert metadata.code_hash(tmp_path) == first
    for path, text in [("data/b/c.py", "y = 3"), ("model/e.py", ""), ("loop/a.py", "x = 1\n")]:
        (tmp_path / path).write_text(text)
        assert metadata.code_hash(tmp_path) != first, path
        first = metadata.code_hash(tmp_path)
    (tmp_path / "model" / "e.py").rename(tmp_path / "model" / "f.py")  # same bytes, another file
    assert metadata.code_hash(tmp_path) != first


def test_secret_looking_values_on_the_command_line_are_masked(monkeypatch):
    # Config keys that merely contain such a word are recorded as given: the command must rerun.
    given = ["train.sample_tokens=16", "data.markov.tokens=5000", "data.tokenizer=x"]
    monkeypatch.setattr("sys.argv", ["train.py", "run.mirror=s3://b/x", "aws_secret_access_key=zzz",
                                     "hf_token=yyy", "data.apikey=k", "db.Password=p", *given])
    assert metadata.safe_argv() == ["train.py", "run.mirror=s3://b/x", "aws_secret_access_key=***",
                                    "hf_token=***", "data.apikey=***", "db.Password=***", *given]


def test_the_data_is_recorded_and_a_resume_on_other_data_says_so(tmp_path, cache):
    # The corpus is an input like the code: metadata.json names it (its sha256), so a corpus
    # edited between a kill and the rerun is said, not gone on with silently at the same sample
    # position.
    import hashlib

    corpus = tmp_path / "corpus.txt"
    text = "the quick brown fox jumps over the lazy dog. " * 400
    corpus.write_text(text)
    out = tmp_path / "run"
    args = [cache, f"data.path={corpus}", "train.ckpt_every=5"]
    train_here(out, *args, "train.max_steps=5")
    data = json.loads((out / "metadata.json").read_text())["data"]
    assert data == {"kind": "chars", "source": str(corpus), "vocab_size": 28, "train_tokens": 16200,
                    "val_tokens": 1800, "sha256": hashlib.sha256(text.encode()).hexdigest(), "unit": "tokens"}
    same = train_here(out, *args, "train.max_steps=6")
    assert "resumed from" in same.stdout and "the data differs" not in same.stdout, same.stdout
    moved = tmp_path / "moved.txt"  # the same corpus by another path: only the config note
    shutil.copy(corpus, moved)
    again = train_here(out, cache, f"data.path={moved}", "train.ckpt_every=5", "train.max_steps=6")
    assert "note: config differs from the checkpoint's in: data.path" in again.stdout, again.stdout
    assert "the data differs" not in again.stdout, again.stdout
    # The path this run read, not the cached corpus's first one (its meta.json names that).
    assert json.loads((out / "metadata.json").read_text())["data"]["source"] == str(moved)
    corpus.write_text(text.replace("dog", "god"))  # the same characters: the model still fits
    other = train_here(out, *args, "train.max_steps=7")
    new = hashlib.sha256(text.replace("dog", "god").encode()).hexdigest()
    assert (f"note: the data differs from the checkpoint's run (sha256 {data['sha256']} -> {new}); "
            f"training goes on from the same sample position in it, not bit for bit as before") \
        in other.stdout, other.stdout


def test_a_resume_on_token_files_written_again_says_the_data_differs(tmp_path):
    # A token directory of another tool's meta.json may give no token counts: its files' sizes
    # are recorded, so a resume onto the directory tokenized again is said, not gone on with silently.
    import numpy as np

    root = tmp_path / "tokens"
    root.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 50, 4000, dtype=np.uint16).tofile(root / "train.bin")
    rng.integers(0, 50, 800, dtype=np.uint16).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    out = tmp_path / "run"
    args = ["data.name=tokens", f"data.path={root}", "train.ckpt_every=5"]
    train_here(out, *args, "train.max_steps=5")
    data = json.loads((out / "metadata.json").read_text())["data"]
    assert (data["train_tokens"], data["val_tokens"]) == (4000, 800)
    rng.integers(0, 50, 6000, dtype=np.uint16).tofile(root / "train.bin")  # another tokenizer's
    again = train_here(out, *args, "train.max_steps=6")
    assert "resumed from" in again.stdout, again.stdout
    notes = [line for line in again.stdout.splitlines() if line.startswith("note:")]
    assert any("train_tokens 4000 -> 6000" in line for line in notes), again.stdout
