"""train.py on a slow disk: every checkpoint write takes a second longer, for tests/test_verify.py
(an async write still in flight steps after it began).

    python tests/slow_save.py k=v ...
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loop import checkpoint  # noqa: E402
import train  # noqa: E402

_save = checkpoint.save


def slow_save(*args, **kwargs):
    time.sleep(1)
    return _save(*args, **kwargs)


if __name__ == "__main__":
    checkpoint.save = slow_save  # looked up at call time by loop/async_save.py's writer
    sys.exit(train.main())
