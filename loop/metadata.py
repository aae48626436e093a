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
from pathlib import Path

import numpy as np
import torch

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


def collect(cfg_hash: str, device: torch.device, precision: str, world_size: int) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "git": git_info(), "config_sha256": cfg_hash, "argv": sys.argv,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": world_size,
        "device": str(device), "gpu": gpu, "precision": precision,
        "host_sha256": hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16],
        "cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "numpy": np.__version__, "cuda": torch.version.cuda},
    }
