"""Run under torchrun in place of train.py: train.py's main() with the same arguments, then one JSON
line per rank naming the threads this process still has, for tests/test_fsdp.py: no process group's
gloo thread may outlive main() into interpreter shutdown (loop/distributed/group.py::close says why).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/exit_threads.py k=v ...
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402

code = train.main()
tasks = Path("/proc/self/task")  # every OS thread, C++ ones included (threading sees Python's only)
names = sorted((tasks / t / "comm").read_text().strip() for t in os.listdir(tasks))
line = json.dumps({"rank": int(os.environ["RANK"]), "threads": names})
sys.stdout.flush()
os.write(1, f"{line}\n".encode())  # one write: the ranks share the pipe (print may write twice)
sys.exit(code)
