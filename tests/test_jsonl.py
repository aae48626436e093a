"""metrics.jsonl on resume: the records after the resumed step and a line cut short at the end go,
everything before stays byte for byte, and only the tail is read."""
from __future__ import annotations

import json

from loop.observe import jsonl


def write(path, steps, tail: bytes = b"") -> bytes:
    data = "".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps).encode() + tail
    path.write_bytes(data)
    return data


def test_later_records_and_a_cut_line_go_the_rest_stays_byte_for_byte(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = write(path, range(1, 8))
    write(path, range(1, 11), b'{"step": 11, "lo')  # killed mid-write at step 11
    assert jsonl.truncate(path, 7) == {"step": 7, "loss": 0.7}
    assert path.read_bytes() == whole
    write(path, range(1, 8), b'{"step": 8, "lo')
    assert jsonl.truncate(path, 9) == {"step": 7, "loss": 0.7} and path.read_bytes() == whole
    assert jsonl.truncate(path, 0) is None and path.read_bytes() == b""
    assert jsonl.truncate(tmp_path / "none.jsonl", 5) is None and not (tmp_path / "none.jsonl").exists()


def test_readers_skip_a_line_cut_short(tmp_path):
    # The report reads a killed run's log: a cut line (here mid-way through a UTF-8 character) goes.
    path = tmp_path / "metrics.jsonl"
    write(path, range(1, 3), '{"step": 3, "sample": "\u00e9'.encode()[:-1])
    assert jsonl.read_records(path) == [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}]


def test_a_line_that_is_no_record_is_passed_over(tmp_path):
    # A log edited by hand: a list or a record without a step reads as a cut line, not a traceback
    # at the report or the resume.
    path = tmp_path / "metrics.jsonl"
    whole = write(path, range(1, 3))
    write(path, range(1, 3), b'[1, 2]\n{"loss": 9}\n')
    assert jsonl.read_records(path) == [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2}, {"loss": 9}]
    assert jsonl.truncate(path, 2) == {"step": 2, "loss": 0.2} and path.read_bytes() == whole


def test_a_whole_last_record_without_its_newline_gets_one(tmp_path):
    # Appending after it would otherwise join two records on one line.
    path = tmp_path / "metrics.jsonl"
    write(path, range(1, 4), b'{"step": 4, "loss": 0.4}')
    assert jsonl.truncate(path, 4) == {"step": 4, "loss": 0.4}
    assert path.read_bytes().endswith(b'0.3}\n{"step": 4, "loss": 0.4}\n')


def test_nothing_to_drop_leaves_the_file_alone_and_only_the_tail_is_parsed(tmp_path, monkeypatch):
    # A resume of a long run must not read and rewrite every record (300k steps: 440 MB, 2.3 s
    # here).
    path = tmp_path / "metrics.jsonl"
    write(path, range(1, 10_001))
    before = path.stat()
    parsed = []
    loads = json.loads
    monkeypatch.setattr(jsonl.json, "loads", lambda s: parsed.append(s) or loads(s))
    assert jsonl.truncate(path, 10_000)["step"] == 10_000
    assert len(parsed) == 1 and path.stat().st_ino == before.st_ino  # not rewritten
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    parsed.clear()
    assert jsonl.truncate(path, 9_990)["step"] == 9_990
    assert len(parsed) == 11  # steps 10000 down to 9990
