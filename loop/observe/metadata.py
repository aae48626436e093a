"""Run metadata (`metadata.json`, and inside every checkpoint): what code, config and machine
produced this run.

- code: the project's git commit, whether the tree is dirty, a hash of the diff (or the GIT_COMMIT
  environment variable, for images built without .git); and, git or not, a hash of the code that
  decides how a run trains (a copy or zip download of the project has no .git);
- config: its hash, the command line, start time, world size, injected faults, determinism settings;
- data: what the data builder says it read (`Data.meta`: source, the corpus's sha256, sizes), its
  plain values only, so a resume on other data can say so (loop/checkpoint/state.py);
- machine: CPU model and cores, RAM, GPU names / count / memory, driver and CUDA versions, a hash
  of the hostname (not the name), versions of python, torch and numpy;
- environment: only variables that steer training (CUDA_*, NCCL_*, PYTORCH_*, TORCHINDUCTOR_*, OMP_*,
  SLURM_*, ...).
  Anything that looks like a secret (*KEY*, *TOKEN*, *SECRET*, *PASSWORD*) is never written, and
  such values on the command line are masked; nor is any variable taken from `.env` (loop/config/dotenv.py),
  whatever its name.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from loop.checkpoint.atomic import atomic_write
from loop.config import dotenv
from loop.config.load import config_hash, save, to_dict
from loop.config.schema import FaultsConfig
from loop.determinism import in_effect

ROOT = Path(__file__).resolve().parents[2]
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
# A config key on the command line is masked when one of its words ends so (hf_token, api_key,
# db.password): train.sample_tokens or data.markov.tokens is no secret, and is recorded as it is.
SECRET_WORD = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)$", re.IGNORECASE)
CODE = ("train.py", "loop", "data", "model")  # the code that decides how a run trains
# TORCHINDUCTOR_, TORCHDYNAMO_ and TRITON_ choose a compiled run's kernels, hence its speed and its
# floating-point results.
ENV_PREFIXES = ("CUDA_", "NCCL_", "PYTORCH_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TRITON_", "OMP_",
                "MKL_", "SLURM_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CUBLAS_")


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_info(root: Path = ROOT, written: Path | None = None) -> dict:
    """The commit, whether the tree differs from it (untracked files too: a new module a run imports
    is code the commit lacks), and a hash of the diff. `written`: the run's own directory, whose
    untracked files are left out where it lies inside the tree: what a run writes is no change to
    its code."""
    commit = (_git(root, "rev-parse", "HEAD") or "").strip() or os.environ.get("GIT_COMMIT")
    here, run = os.path.abspath(root), os.path.abspath(written) if written is not None else None
    inside = run is not None and run != here and Path(run).is_relative_to(here)
    leave_out = [f":(exclude,literal){os.path.relpath(run, here)}"] if inside else []
    tracked = _git(root, "status", "--porcelain", "--untracked-files=no")
    untracked = _git(root, "status", "--porcelain", "--", ":/", *leave_out)  # and tracked files but the run's
    diff = _git(root, "diff", "HEAD")
    status = None if tracked is None or untracked is None else tracked + untracked
    return {"commit": commit, "dirty": bool(status.strip()) if status is not None else None,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def code_hash(root: Path = ROOT) -> str:
    """sha256 over the path and bytes of every .py file in CODE: equal hashes, equal code, with or
    without git (a copied project, a zip download, an image built without GIT_COMMIT). The data
    cache is not walked: it is not code, and a downloaded dataset can hold a million files."""
    def files(name: str):
        if name.endswith(".py"):
            yield root / name
            return
        for d, dirs, names in os.walk(root / name):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "cache")]  # data/cache: not code
            yield from (Path(d, n) for n in names if n.endswith(".py"))

    h = hashlib.sha256()
    for path in sorted(p for name in CODE for p in files(name)):
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def safe_environment() -> dict:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(ENV_PREFIXES) and not SECRET.search(k) and k not in dotenv.FROM_FILE}


def safe_argv() -> list[str]:
    def secret(key: str) -> bool:
        return any(SECRET_WORD.search(w) for w in re.split(r"[._]", key))
    return [f"{a.partition('=')[0]}=***" if "=" in a and secret(a.partition("=")[0]) else a for a in sys.argv]


def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:  # Linux names the model here; platform.processor() is often empty
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        ram = None
    gpus = [{"name": p.name, "memory_gb": p.total_memory / 1e9}
            for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]
    driver = None
    if gpus:
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 -- NVML is optional; the driver version is a nicety
            pass
    return {"cpu": cpu, "cpu_cores": os.cpu_count(), "ram_gb": ram, "gpus": gpus,
            "gpu_count": len(gpus), "driver": driver, "cuda": torch.version.cuda,
            "host_sha256": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16],
            "platform": platform.platform()}


def data_identity(meta: dict) -> dict:
    """The plain values of a Data.meta (a user's builder may put anything there), less a text
    corpus's character list (up to 65,536 characters, and its sha256 already covers it) and a
    prepared cache's tokens_sha256 (its integrity check, which a cache may lack: a resume would
    say the data differs between a cache with it and one without)."""
    return {k: v for k, v in meta.items()
            if k not in ("chars", "tokens_sha256") and (v is None or isinstance(v, (str, int, float, bool)))}


def collect(cfg, device: torch.device, precision: str, world_size: int, data_meta: dict,
            resumed_from=None) -> dict:
    off = asdict(FaultsConfig())
    faults = {k: v for k, v in asdict(cfg.faults).items() if v != off[k]}
    return {
        "git": git_info(written=Path(cfg.run.out_dir)), "code_sha256": code_hash(), "config_sha256": config_hash(cfg),
        "data": data_identity(data_meta),
        "argv": safe_argv(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": world_size,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "faults_injected": faults or None, "lab_break": cfg.lab.break_ or None,
        "determinism": in_effect(),
        "device": str(device), "precision": precision, "hardware": hardware(),
        "environment": safe_environment(),
        # str(): torch.__version__ is a TorchVersion, which weights_only loading refuses
        "versions": {"python": platform.python_version(), "torch": str(torch.__version__),
                     "numpy": np.__version__, "cuda": torch.version.cuda},
    }


def run_facts(cfg, world_size: int, metadata: dict) -> dict:
    """What every checkpoint holds beside the training state, for a resume to compare with its own
    run (loop/checkpoint/notes.py): the config, its hash, the world size and this metadata."""
    return {"config": to_dict(cfg), "config_sha256": config_hash(cfg), "world_size": world_size,
            "metadata": metadata}


def write(out: Path, cfg, metadata: dict) -> None:
    """The run directory's config.yaml (the resolved config) and metadata.json, at every start."""
    save(cfg, out / "config.yaml")
    atomic_write(out / "metadata.json", json.dumps(metadata, indent=1).encode())
