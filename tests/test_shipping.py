"""Shipping: the `.env` loader (loop/config/dotenv.py) and what it promises end to end (the variables reach
train.py, their values reach no file of the run, a malformed line exits 2 with nothing written), and
static checks of the Dockerfile, .dockerignore, .env.example and the CI workflow; scripts/gpu_checks.sh
refuses to run without a GPU; scripts/slurm.sbatch forwards the time-limit signal and requeues.

    .venv/bin/python -m pytest tests/test_shipping.py -q
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import ROOT, TINY
from loop.config import dotenv
from loop.errors import BadInput
from loop.observe import metadata

DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"


# ------------------------------------------------------------------------------------- the parser
def test_parse_quotes_export_comments():
    text = ("# a comment\n"
            "\n"
            "PLAIN=value\n"
            "export EXPORTED=1\n"
            "  SPACED = padded value  \n"
            "SINGLE='it has # and \"double\" quotes'\n"
            'DOUBLE="  kept spaces  "\n'
            "HASH=abc#def # not a comment\n"
            "EQUALS=a=b=c\n"
            "EMPTY=\n"
            "EMPTY_QUOTED=''\n"
            "    # an indented comment\r\n"
            "PLAIN=last wins\r\n")
    assert dotenv.parse(text) == {
        "PLAIN": "last wins", "EXPORTED": "1", "SPACED": "padded value",
        "SINGLE": 'it has # and "double" quotes', "DOUBLE": "  kept spaces  ",
        "HASH": "abc#def # not a comment", "EQUALS": "a=b=c", "EMPTY": "", "EMPTY_QUOTED": ""}


def test_only_line_breaks_end_a_line():
    # str.splitlines() also ends a line at a form feed, U+2028 and others: a value cut short, a
    # second variable set from the rest of it, line numbers that are not the file's.
    assert dotenv.parse("PASSWORD=pa\x0cEXTRA=ss\nTOKEN=abc\u2028def\rOLD_MAC=1\r\nLAST=2") == {
        "PASSWORD": "pa\x0cEXTRA=ss", "TOKEN": "abc\u2028def", "OLD_MAC": "1", "LAST": "2"}
    with pytest.raises(BadInput, match="^.env line 2:"):
        dotenv.parse("A=1\u2028\nnot a line")


@pytest.mark.parametrize("bad", ["no equals sign hunter2", "1STARTS_WITH_DIGIT=hunter2",
                                 "TWO WORDS=hunter2", "=hunter2", "OPEN='hunter2", "MIXED=\"hunter2'",
                                 "AFTER='hunter2' trailing", 'INNER="hunter2"x"', "export",
                                 "KEY-DASH=hunter2",
                                 "NUL=hunter2\0x"])  # os.environ refuses it: a ValueError traceback
def test_a_malformed_line_names_the_file_and_line_but_not_the_line(bad):
    text = f"# header\nGOOD=1\n{bad}\n"
    with pytest.raises(BadInput) as e:
        dotenv.parse(text)
    assert str(e.value).startswith(".env line 3:") and "hunter2" not in str(e.value)


def test_load_environment_wins_and_nothing_is_set_from_a_malformed_file(tmp_path, monkeypatch):
    monkeypatch.setattr(dotenv, "FROM_FILE", set())
    environ = {"ALREADY": "from the environment"}
    path = tmp_path / ".env"
    assert dotenv.load(path, environ) == [] and environ == {"ALREADY": "from the environment"}
    path.write_text("ALREADY=from the file\nNEW='from the file'\n")
    assert dotenv.load(path, environ) == ["NEW"]
    assert environ == {"ALREADY": "from the environment", "NEW": "from the file"}
    assert dotenv.FROM_FILE == {"NEW"}
    path.write_bytes("\ufeffFIRST=1\n".encode())  # the byte-order mark some editors write first
    assert dotenv.load(path, environ) == ["FIRST"] and environ["FIRST"] == "1"
    path.write_text("LATER=1\nnot an assignment\n")
    with pytest.raises(BadInput, match=r"\.env line 2:"):
        dotenv.load(path, environ)
    assert "LATER" not in environ  # the whole file is checked before anything is set


def test_variables_from_env_file_are_left_out_of_metadata(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "from-dotenv")  # not secret-looking, but from .env
    monkeypatch.setattr(dotenv, "FROM_FILE", {"NCCL_SOCKET_IFNAME"})
    recorded = metadata.safe_environment()
    assert recorded["NCCL_DEBUG"] == "INFO" and "NCCL_SOCKET_IFNAME" not in recorded


# ---------------------------------------------------------------------------- end to end, train.py
def run_in(work: Path, env_text: str, *overrides: str, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    """A 2-step train.py subprocess whose working directory is `work`, holding `.env` = env_text.
    (2 steps, also where exit 2 is expected: should that regress, the test fails fast.)"""
    work.mkdir()
    (work / ".env").write_text(env_text)
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(DEFAULT_CONFIG), *TINY,
           "train.max_steps=2", *overrides]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)


def clean_env(*names: str, **values: str) -> dict:
    """This environment without `names` (so .env provides them), plus `values`."""
    return {**{k: v for k, v in os.environ.items() if k not in names}, **values}


@pytest.mark.slow
def test_env_file_values_reach_no_file_of_the_run(tmp_path, cache):
    values = {"AWS_ACCESS_KEY_ID": "dotenv-akid-0q1w", "AWS_SECRET_ACCESS_KEY": "dotenv-secret-9e8r",
              "AWS_DEFAULT_REGION": "dotenv-region-2t3y", "NCCL_SOCKET_IFNAME": "dotenv-ifname-6u7i",
              "NCCL_DEBUG": "dotenv-loses-5o4p"}
    env_text = ("# the checkpoint mirror's credentials\n"
                f"export AWS_ACCESS_KEY_ID={values['AWS_ACCESS_KEY_ID']}\n"
                f"AWS_SECRET_ACCESS_KEY='{values['AWS_SECRET_ACCESS_KEY']}'\n"
                f'AWS_DEFAULT_REGION="{values["AWS_DEFAULT_REGION"]}"\n'
                "\n"
                f"NCCL_SOCKET_IFNAME={values['NCCL_SOCKET_IFNAME']}\n"
                f"NCCL_DEBUG={values['NCCL_DEBUG']}\n")
    out = tmp_path / "run"
    proc = run_in(tmp_path / "work", env_text, f"run.out_dir={out}", cache, "train.ckpt_every=1",
                  env=clean_env(*values, NCCL_DEBUG="INFO"))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "metadata.json").read_text())
    # The environment's own NCCL_DEBUG wins over .env's and is recorded as always; the name that
    # came from .env is not, though it does not look secret.
    assert meta["environment"]["NCCL_DEBUG"] == "INFO"
    assert "NCCL_SOCKET_IFNAME" not in meta["environment"]
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"metadata.json", "config.yaml", "metrics.jsonl", "summary.json", "state.pt"} <= names
    checkpoints = [torch.load(p, weights_only=True)["metadata"] for p in out.rglob("state.pt")]
    assert len(checkpoints) == 2
    for value in values.values():
        assert value not in proc.stdout + proc.stderr, value
        for path in files:  # every byte written: metadata, config, metrics, summary, tb, checkpoints
            assert value.encode() not in path.read_bytes(), (value, path)
        assert all(value not in repr(m) for m in checkpoints), value


def test_env_file_variables_reach_train_py(tmp_path):
    # Determinism mode reads CUBLAS_WORKSPACE_CONFIG after .env is loaded and refuses this value.
    out = tmp_path / "run"
    proc = run_in(tmp_path / "work", "CUBLAS_WORKSPACE_CONFIG=:0:0\n", f"run.out_dir={out}",
                  "run.deterministic=true", env=clean_env("CUBLAS_WORKSPACE_CONFIG"))
    assert proc.returncode == 2 and "':0:0'" in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_malformed_env_file_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = run_in(tmp_path / "work", "GOOD=1\n\nAWS_SECRET_ACCESS_KEY dotenv-secret-missing-equals\n",
                  f"run.out_dir={out}")
    assert proc.returncode == 2, proc.stderr
    assert ".env line 3" in proc.stderr and "dotenv-secret" not in proc.stdout + proc.stderr
    assert not out.exists()
    # --help still answers (.env is read first, and its error must not be all --help prints)
    helped = run_in(tmp_path / "again", "GOOD=1\n\nAWS_SECRET_ACCESS_KEY dotenv-secret-missing-equals\n", "--help")
    assert helped.returncode == 0 and "usage: train.py" in helped.stdout, helped.stderr


# --------------------------------------------------------------------------------- shipping files
def dockerfile() -> tuple[str, str]:
    """The Dockerfile's text and its FROM image, with ${ARG}s resolved from their defaults."""
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.MULTILINE))
    image = re.search(r"^FROM (\S+)", text, re.MULTILINE).group(1)
    return text, re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def test_dockerfile_base_image_is_official_pytorch_at_the_locked_version():
    text, image = dockerfile()
    torch_pin = re.search(r"^torch==(\S+)$", (ROOT / "requirements.lock").read_text(), re.MULTILINE)
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", image)
    assert match, image  # official, exact version, CUDA runtime flavour: never `latest`
    assert match.group(1) == torch_pin.group(1)
    assert not re.search(r"pip install[^\n]*\btorch\b", text)  # torch comes with the image


def test_dockerfile_runs_as_non_root_and_records_the_commit():
    text, _ = dockerfile()
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    arg = re.search(r"^ARG GIT_COMMIT\b", text, re.MULTILINE)
    env = re.search(r"^ENV GIT_COMMIT=\$\{?GIT_COMMIT\}?", text, re.MULTILINE)
    assert arg and env and arg.start() < env.start()  # --build-arg GIT_COMMIT=... -> the environment


def test_dockerfile_has_a_c_compiler_for_torch_compile():
    # configs/gpt2_124m.yaml compiles; Triton needs gcc at run time, which a CUDA runtime image may
    # lack (pytorch/pytorch#116696): the build installs it, as root, before USER drops to the user.
    text, _ = dockerfile()
    ensure = re.search(r"^RUN command -v gcc .*apt-get install -y --no-install-recommends gcc", text,
                       re.MULTILINE | re.DOTALL)
    assert ensure and ensure.start() < text.rindex("\nUSER ")
    assert "compile: true" in (ROOT / "configs" / "gpt2_124m.yaml").read_text()


def test_dockerignore_keeps_secrets_history_and_outputs_out_of_the_image():
    lines = set((ROOT / ".dockerignore").read_text().split("\n"))
    assert {".git", ".venv", ".env", "runs", "reports", "data/cache"} <= lines


def test_env_example_parses_and_git_ignores_env():
    text = (ROOT / ".env.example").read_text()
    assert dotenv.parse(text) == {}  # all commented out: a plain copy sets nothing
    uncommented = dotenv.parse(re.sub(r"^# ([A-Z_]+=)", r"\1", text, flags=re.MULTILINE))
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"} <= set(uncommented)
    assert ".env" in (ROOT / ".gitignore").read_text().split("\n")


def test_ci_workflow_runs_make_test_with_cpu_torch():
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    assert {"push", "pull_request"} <= set(flow[True])  # YAML 1.1 reads the key `on` as True
    job = flow["jobs"]["test"]
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] > 0
    assert job["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    setup = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["python-version"] == "3.11" and setup["with"]["cache"] == "pip"
    assert any(s.get("run") == "make test" for s in job["steps"])
    # Why the CPU index wins: the lock's `==2.13.0` matches 2.13.0+cpu, which sorts above 2.13.0.
    assert SpecifierSet("==2.13.0").contains("2.13.0+cpu") and Version("2.13.0+cpu") > Version("2.13.0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_checks_refuse_without_a_gpu_and_write_nothing(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "tests"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OUT": str(out), "PYTHON": sys.executable})
    assert proc.returncode == 2 and "no CUDA GPU visible" in proc.stderr, proc.stderr
    assert not out.exists()


def test_gpu_checks_skip_the_chunked_loss_where_torch_lacks_it(tmp_path):
    # torch 2.11 (a GPU image's) has no F.linear_cross_entropy: the stage is skipped at once, not
    # after two full GPT-2 arms of the bench ran before its variant's model refused to build.
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\n'
                      'case "$*" in *linear_cross_entropy*) exit 1;; *cuda.is_available*|*xdist*) exit 0;; esac\n'
                      'echo "$*" >> "$LOG"\n')
    python.chmod(0o755)
    log = tmp_path / "log"
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "chunked_loss"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path / "gpu"), "PYTHON": str(python), "LOG": str(log)})
    assert proc.returncode == 0 and "chunked_loss: skipped" in proc.stdout, proc.stdout + proc.stderr
    assert not log.exists()  # nothing run


STUBS = {  # SLURM's commands, each recording how it was called in $LOG
    "scontrol": 'echo "scontrol $*" >> "$LOG"; [ "$1" = show ] && printf "gpu-a\\ngpu-b\\n"; exit 0',
    "srun": 'echo "srun $*" >> "$LOG"; trap \'kill $!; exit 143\' TERM; sleep 60 & echo $$ > "$LOG.pid"; wait',
    "scancel": 'echo "scancel $*" >> "$LOG"; kill -TERM "$(cat "$LOG.pid")"',
}


def test_slurm_script_forwards_the_time_limit_signal_and_requeues(tmp_path):
    # scripts/slurm.sbatch with SLURM's commands stubbed: its torchrun line (a GPU type in
    # SLURM_GPUS_PER_NODE, "h100:8", must reach --nproc_per_node as the count alone), and USR1
    # before the time limit -> TERM to the job's steps, then a requeue, with the step's exit code.
    for name, body in STUBS.items():
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "LOG": str(log),
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "h100:8",
           "SLURM_JOB_ID": "42"}
    job = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm.sbatch"), "run.out_dir=/shared/r1"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(200):  # until the stub srun is waiting (the script's trap is set by then)
            if (tmp_path / "log.pid").exists():
                break
            time.sleep(0.05)
        time.sleep(0.5)
        job.send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    calls = log.read_text().splitlines()
    assert calls == [
        "scontrol show hostnames gpu-[a-b]",
        "srun --kill-on-bad-exit=0 torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d "
        "--rdzv_endpoint=gpu-a:29500 --rdzv_id=42 --max-restarts=3 train.py run.out_dir=/shared/r1",
        "scancel --signal=TERM 42",
        "scontrol requeue 42"], calls
    assert job.returncode == 143 and "time limit near: checkpoint written, requeueing 42" in out, out
