"""train.py on a slow disk: every checkpoint write takes a second longer, for tests/test_verify.py
(an async write still in flight steps after it began).

    python tests/slow_save.py k=v ...
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from loop.checkpoint import store  # noqa: E402

_save = store.save


def slow_save(*args, **kwargs):
    time.sleep(1)
    return _save(*args, **kwargs)


if __name__ == "__main__":
    store.save = slow_save  # looked up at call time by loop/checkpoint/async_save.py's writer
    sys.exit(train.main())
