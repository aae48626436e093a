"""Run metadata (`metadata.json`): what code, config and machine produced this run.

The git commit comes from the project's repository (or the GIT_COMMIT environment variable, for
images built without .git). No environment variables are recorded.
"""
from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from loop.config import config_hash
from loop.determinism import in_effect

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_info() -> dict:
    commit = (_git("rev-parse", "HEAD") or "").strip() or os.environ.get("GIT_COMMIT")
    status = _git("status", "--porcelain")
    diff = _git("diff", "HEAD")
    return {"commit": commit, "dirty": bool(status.strip()) if status is not None else None,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def collect(cfg, device: torch.device, precision: str, world_size: int, resumed_from=None) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    faults = {k: v for k, v in asdict(cfg.faults).items() if v != -1}
    return {
        "git": git_info(), "config_sha256": config_hash(cfg), "argv": sys.argv,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "faults_injected": faults or None, "determinism": in_effect(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": world_size,
        "device": str(device), "gpu": gpu, "precision": precision,
        "host_sha256": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16],
        "cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "numpy": np.__version__, "cuda": torch.version.cuda},
    }
