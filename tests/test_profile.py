"""The profiler breakdown of a step: fractions for every region that sum to 1, and a trace file."""
from __future__ import annotations

import json

import pytest

from conftest import run_train
from loop.observe.profile import REGIONS, breakdown


@pytest.mark.slow
def test_profile_breakdown_names_every_region_and_sums_to_one(tmp_path, cache):
    out = tmp_path / "run"
    proc = run_train(out, cache, "train.max_steps=10", "train.profile=true")
    parts = json.loads((out / "profile" / "breakdown.json").read_text())
    assert set(parts) == {*REGIONS, "other"}
    assert sum(parts.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(parts[r] > 0 for r in REGIONS), parts  # each region was seen in the profiled steps
    assert parts["forward"] + parts["backward"] > parts["data"], parts
    trace = json.loads((out / "profile" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert set(REGIONS) <= names
    assert "step time breakdown" in proc.stdout


def test_breakdown_is_each_region_s_share_of_the_steps_and_other_never_below_zero():
    # Regions timed a hair past their steps (their timers' ends are not the step's) would make "other"
    # negative: it stays at 0.
    from types import SimpleNamespace

    def prof(**us):
        return SimpleNamespace(key_averages=lambda: [SimpleNamespace(key=k, cpu_time_total=v) for k, v in us.items()])

    steps_us = 1000.0  # the profiled steps' wall time
    assert breakdown(prof(data=10.0, forward=400.0, backward=500.0, optimizer=40.0), steps_us) == \
        {"data": 0.01, "forward": 0.4, "backward": 0.5, "optimizer": 0.04, "other": pytest.approx(0.05)}
    assert breakdown(prof(data=20.0, forward=450.0, backward=550.0, optimizer=0.0), steps_us)["other"] == 0.0
    # With CUDA activity on, torch 2.11's averages held no time for the regions that launch GPU
    # work (an H200: forward, backward, optimizer 0.0%, other 99.9%): no breakdown, rather than that.
    assert breakdown(prof(data=1.0, forward=0.0, backward=0.0, optimizer=0.0), steps_us) is None
    assert breakdown(prof(data=1.0), steps_us) is None


@pytest.mark.slow
def test_a_run_that_ends_before_the_profiled_steps_reports_nothing(tmp_path, cache):
    # No breakdown, rather than one of "other 100.0%" (3 steps: no profiled step) or one whose
    # "other" holds the run's final evaluation and checkpoint (7 steps), as if measured.
    out = tmp_path / "run"
    proc = run_train(out, cache, "train.max_steps=7", "train.profile=true")
    note = next((line for line in proc.stdout.splitlines() if line.startswith("note: train.profile")), "")
    for fact in ("ended 7 step(s) in", "(4-8 ", "nothing to report", "train.max_steps", "run.out_dir"):
        assert fact in note, proc.stdout
    assert "step time breakdown" not in proc.stdout and not (out / "profile").exists()
    # The same command again resumes at its end, so the advice names a new run.out_dir too, not
    # only raising max_steps.
    proc = run_train(out, cache, "train.max_steps=7", "train.profile=true")
    note = next((line for line in proc.stdout.splitlines() if line.startswith("note: train.profile")), "")
    assert "ended 0 step(s) in" in note and "a new run.out_dir" in note, proc.stdout
