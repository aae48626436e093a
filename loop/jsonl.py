"""`metrics.jsonl`: one JSON record per line, appended. A write cut short (a kill or power cut
mid-write, a full disk) leaves part of a line; readers skip it, and a resume's rewrite drops it,
so the rerun the error message asks for works."""
from __future__ import annotations

import json
from pathlib import Path

from loop.atomic import atomic_write


def read_records(path: Path) -> list[dict]:
    """The whole records in `path`, in order; a line cut short (not valid JSON) is skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():  # a cut may split a UTF-8 character
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def truncate(path: Path, last_step: int) -> list[dict]:
    """Keep the whole records with step <= last_step (atomic rewrite); return them."""
    if not path.exists():
        return []
    keep = [r for r in read_records(path) if r["step"] <= last_step]
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in keep).encode())
    return keep
