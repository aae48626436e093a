"""What the benchmarks share: the command line, naming the device, waiting for it, and the results record."""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch

from loop.config.paths import writable_dir
from loop.errors import EXIT_BAD_INPUT, BadInput

RESULTS = Path(__file__).resolve().parent / "results"


def command(main) -> None:
    """Run a benchmark's `main` as a command: bad input (a preset, a config key) found before the
    runs is one line and exit 2, as with train.py, not a traceback."""
    try:
        code = main()
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    sys.exit(code)


def check_results(path: Path) -> None:
    """--results: a file that can be appended to, checked before the runs (their figures are lost
    if it cannot be written after them)."""
    writable_dir("option --results", str(path.parent))
    if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
        raise BadInput(f"option --results={path}: {'a directory' if path.is_dir() else 'not writable'}; "
                       f"expected a .jsonl file to append to.")


def device_label(device: torch.device) -> str:
    return str(device) if device.type != "cuda" else f"cuda ({torch.cuda.get_device_name(device)})"


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":  # queued kernels must be billed to what queued them
        torch.cuda.synchronize(device)


def append_result(path: Path, module: str, argv: list[str] | None, fields: dict) -> None:
    """One JSON line: date, the command, torch version and CPU count, then `fields`."""
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])]),
              "torch": torch.__version__, "cpus": os.cpu_count(), **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended to {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
