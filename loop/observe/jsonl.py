"""`metrics.jsonl`: one JSON record per line, appended. A write cut short (a kill or power cut
mid-write, a full disk) leaves part of a line; readers skip it, and a resume's rewrite drops it,
so the rerun the error message asks for works."""
from __future__ import annotations

import json
from pathlib import Path

from loop.checkpoint.atomic import atomic_write


def read_records(path: Path) -> list[dict]:
    """The whole records in `path`, in order; a line cut short (not valid JSON), or one that is no
    record (a line edited by hand), is skipped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():  # a cut may split a UTF-8 character
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def truncate(path: Path, last_step: int) -> dict | None:
    """Drop the records after `last_step` and a line cut short at the end (an atomic rewrite, only
    if anything goes); return the last record kept. Records are in step order (every resume and
    rollback truncates before it appends), so only the tail is parsed: a long run's resume does
    not hold its every record in memory (300k steps parsed whole: 446 MB and 2.3 s on a 2-core CPU)."""
    if not path.exists():
        return None
    data = path.read_bytes()
    end, last = len(data), None
    while end and last is None:
        start = data.rfind(b"\n", 0, end - 1) + 1  # the last line of data[:end]
        try:
            rec = json.loads(data[start:end])
            last = rec if rec["step"] <= last_step else None
        except (ValueError, TypeError, KeyError):  # cut short, or no record: dropped from the tail
            pass
        if last is None:
            end = start
    kept = data[:end] if data[:end].endswith(b"\n") or not end else data[:end] + b"\n"
    if kept != data:
        atomic_write(path, kept)
    return last


def last_with(path: Path, key: str) -> dict | None:
    """The newest whole record with `key` at its top level, found by a byte search from the end
    (json.dumps writes `"key": `; in a string value its quotes are escaped), so a long log whose
    newest records lack the key is not parsed line by line."""
    if not path.exists():
        return None
    data, needle = path.read_bytes(), json.dumps(key).encode() + b": "
    end = len(data)
    while (at := data.rfind(needle, 0, end)) >= 0:
        start, stop = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
        try:
            rec = json.loads(data[start : stop if stop >= 0 else len(data)])
            if key in rec:
                return rec
        except ValueError:  # a line cut short
            pass
        end = start
    return None
