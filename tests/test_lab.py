"""Each lab switch (lab.break=..., loop/lab.py) breaks one concern, and make verify fails the check
that guards it, naming it and the usual cause. The switches that only matter under fp16 run with
train.precision=fp16 (the GradScaler exists only there)."""
from __future__ import annotations

import json

import pytest
from test_verify import rows, verify

from conftest import TINY, metrics, run_train
from loop.lab import SWITCHES, banner

pytestmark = pytest.mark.slow  # every test here runs whole trainings


@pytest.mark.parametrize("name", list(SWITCHES))
def test_verify_names_the_check_each_switch_breaks(tmp_path, cache, name):
    s = SWITCHES[name]
    proc = verify(tmp_path, "--checks", ",".join(s.caught_by), *TINY, cache, f"lab.break={name}",
                  *s.needs)
    table = rows(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {c: r for c, (r, _) in table.items()} == {c: "FAIL" for c in s.caught_by}, proc.stdout
    for check in s.caught_by:
        assert f"  {check}: usual cause: " in proc.stdout
    assert f"LAB SWITCH ON: lab.break={name}" in proc.stdout
    kept = next((tmp_path / "verify runs").iterdir())  # failed audits keep their runs to look at
    assert json.loads((kept / "verify.json").read_text())["results"]


@pytest.mark.parametrize("name", [n for n, s in SWITCHES.items() if s.needs])
def test_a_switch_that_needs_a_setting_breaks_nothing_without_it(tmp_path, cache, name):
    # The fp16 switches touch the GradScaler, which does nothing in fp32: the check passes there
    # (the lab asks why).
    s = SWITCHES[name]
    proc = verify(tmp_path, "--checks", ",".join(s.caught_by), *TINY, cache, f"lab.break={name}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {c: r for c, (r, _) in rows(proc.stdout).items()} == {c: "PASS" for c in s.caught_by}, proc.stdout


def test_the_clip_before_unscale_switch_still_skips_a_non_finite_step(tmp_path, cache):
    # The switch moves the unscale after the clip, not away: the GradScaler still sees a skipped
    # step's gradients before its update (torch raises where it saw none).
    out = tmp_path / "run"
    run_train(out, cache, "train.max_steps=4", "train.precision=fp16", "lab.break=clip_before_unscale",
              "faults.nan_at_step=2")
    assert [r["skipped"] for r in metrics(out)] == [False, True, False, False]


def test_a_switched_run_says_so_loudly_and_in_its_files(tmp_path, cache):
    out = tmp_path / "run"
    proc = run_train(out, cache, "train.max_steps=3", "lab.break=no_rng_restore")
    assert "LAB SWITCH ON: lab.break=no_rng_restore" in proc.stdout
    assert json.loads((out / "metadata.json").read_text())["lab_break"] == "no_rng_restore"
    assert json.loads((out / "summary.json").read_text())["lab_break"] == "no_rng_restore"
    assert len(metrics(out)) == 3
    assert "fp16: gradients are clipped while still multiplied by the loss scale, then unscaled (it only " \
        "bites with train.precision=fp16).\n" in banner("clip_before_unscale")  # a switch with needs
