"""The end-of-run report renders for a finished run, an interrupted run and both overlaid, with the
numbers from their files (steps, tokens, status, cost by hand, no energy column on CPU), real PNG plots,
a CLI that exits 0 / 2, and tables (with the reason for no plots) when matplotlib is missing."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, metrics, run_and_kill, run_train, summary, train_here
from loop.observe.report import write_report
from tools.report import main as report_main

PRICE = 36_000.0  # $ per device-hour: $10/s, so a test run of a second has a cost to 4 decimals


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("report_runs")
    fin, cut = base / "finished", base / "interrupted"
    run_train(fin, cache, "train.max_steps=20", "train.log_every=5")
    run_and_kill(cut, 12, cache, "train.max_steps=40", "train.log_every=5", "train.ckpt_every=10")
    assert (fin / "summary.json").exists() and not (cut / "summary.json").exists()
    return {"finished": fin, "interrupted": cut}


def rows(md: str) -> dict[str, dict[str, str]]:
    """The report's table as {run name: {column: cell}}."""
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", ln[1:-1])] for ln in lines[1:]]  # \| is in a cell
    return {c[0]: dict(zip(head, c)) for c in cells}


def hms(s: float) -> str:
    s = round(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 5000, (path, len(data))  # axes, ticks and lines, not a blank canvas


@pytest.mark.slow
def test_finished_run(runs, tmp_path):
    fin = runs["finished"]
    md = write_report([fin], tmp_path, price_per_hour=PRICE).read_text()
    s, recs = summary(fin), metrics(fin)
    row = rows(md)["finished"]
    assert row["status"] == "finished"
    assert row["steps"] == str(s["steps"]) == "20"
    assert row["tokens"] == f"{s['tokens']:,}"
    assert row["wall time"] == hms(s["wall_s"])
    assert row["mean tokens/s"] == f"{s['tokens_per_s']:,.0f}"
    assert row["cost $"] == f"{s['wall_s'] / 3600 * 1 * PRICE:,.4f}" != "0.0000"  # world size 1
    # CPU: no NVML, no CUDA, so no column of n/a for them; a priced run has its cost.
    assert not {"energy kWh", "CO2 kg", "peak memory GB", "MFU"} & row.keys(), row
    assert row["final train loss"] == f"{s['final_loss']:.4f}"
    assert row["best val loss"] == f"{min(r['val_loss'] for r in recs if 'val_loss' in r):.4f}"
    best = s["best"]  # the monitored metric (val_loss here), at the step it was best
    assert row["best checkpoint"] == f"val_loss {best['value']:.4g} at step {best['step']}"
    for name in ("loss_vs_step", "loss_vs_tokens", "lr", "tokens_per_s"):
        assert_png(tmp_path / f"{name}.png")
        assert f"({name}.png)" in md
    assert not (tmp_path / "gpu_memory.png").exists()  # no cuda_max_alloc_gb on CPU


@pytest.mark.slow
def test_interrupted_run(runs, tmp_path):
    cut = runs["interrupted"]
    md = write_report([cut], tmp_path, price_per_hour=PRICE).read_text()
    recs = metrics(cut)
    last = recs[-1]
    row = rows(md)["interrupted"]
    assert row["status"] == f"unfinished at step {last['step']}"
    assert row["steps"] == str(last["step"]) and row["tokens"] == f"{last['tokens']:,}"
    # Every interval is log_every=5 steps long, so the time is the sum of ms_per_step x 5.
    wall = sum(r["ms_per_step"] * 5 for r in recs if "ms_per_step" in r) / 1000
    assert [r["step"] for r in recs if "ms_per_step" in r] == list(range(5, last["step"] + 1, 5))
    assert row["wall time"] == hms(wall)
    assert row["cost $"] == f"{wall / 3600 * PRICE:,.4f}" != "0.0000"
    assert row["mean tokens/s"] == f"{last['tokens'] / wall:,.0f}"
    assert row["final train loss"] == f"{last['loss']:.4f}"
    assert "energy kWh" not in row
    # Its best checkpoint is the one checkpoints/best names, at its logged value (not "n/a").
    step = int((cut / "checkpoints" / "best").read_text().removeprefix("step_"))
    val = next(r["val_loss"] for r in recs if r["step"] == step)
    assert row["best checkpoint"] == f"val_loss {val:.4g} at step {step}"
    assert_png(tmp_path / "loss_vs_step.png")


@pytest.mark.slow
def test_two_runs_overlaid(runs, tmp_path):
    single, both = tmp_path / "single", tmp_path / "both"
    write_report([runs["finished"]], single)
    md = write_report([runs["finished"], runs["interrupted"]], both).read_text()
    table = rows(md)
    assert list(table) == ["finished", "interrupted"]
    assert table["finished"]["steps"] == "20" and table["interrupted"]["status"].startswith("unfinished at step")
    assert "cost $" not in table["finished"]  # no price given: no cost column
    for name in ("loss_vs_step", "loss_vs_tokens", "lr", "tokens_per_s"):
        assert_png(both / f"{name}.png")
    assert (both / "loss_vs_step.png").read_bytes() != (single / "loss_vs_step.png").read_bytes()


@pytest.mark.slow
def test_a_bar_in_a_run_s_name_stays_in_its_cell(runs, tmp_path):
    run = tmp_path / "lr|3e-4"
    shutil.copytree(runs["finished"], run)
    table = rows(write_report([run], tmp_path / "report").read_text())
    assert table[r"lr\|3e-4"]["steps"] == "20" and table[r"lr\|3e-4"]["status"] == "finished"


@pytest.mark.slow
def test_world_size_energy_and_memory_from_records(runs, tmp_path):
    """GPU-only fields, written into a copy of the finished run: energy over two stretches (before
    and after a resume), peak memory, MFU, world size 2 and a per-device price."""
    run = tmp_path / "gpu_run"
    shutil.copytree(runs["finished"], run)
    meta = json.loads((run / "metadata.json").read_text())
    gpus = [{"name": "FakeGPU", "memory_gb": 80.0}]  # as loop/observe/metadata.py writes them
    (run / "metadata.json").write_text(json.dumps({**meta, "world_size": 2, "device": "cuda:0",
                                                   "hardware": {**meta["hardware"], "gpus": gpus}}))
    recs = metrics(run)
    energy = iter([1000.0, 2000.0, 500.0, 1500.0])  # a resume after the second interval resets NVML's count
    for r in recs:
        if "ms_per_step" in r:
            r.update(energy_j=next(energy), cuda_max_alloc_gb=r["step"] / 10, mfu=0.25)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summary(run)
    (run / "summary.json").write_text(json.dumps({**s, "energy_j": 1600.0}))
    row = rows(write_report([run], tmp_path / "out", price_per_hour={"FakeGPU": 2.0}, co2_g_per_kwh=250).read_text())["gpu_run"]
    kwh = (2000.0 + 1600.0) / 3.6e6
    assert row["energy kWh"] == f"{kwh:.4f}" and row["CO2 kg"] == f"{kwh * 250 / 1000:.4f}"
    assert row["peak memory GB"] == "2.00" and row["MFU"] == "25.0%" and row["device"] == "FakeGPU x2"
    assert row["cost $"] == f"{s['wall_s'] / 3600 * 2 * 2.0:,.4f}"
    for prices, cost in (({"H100": 9.0, "default": 3.0}, f"{s['wall_s'] / 3600 * 2 * 3.0:,.4f}"),
                         ({"H100": 9.0}, None)):  # a device the prices do not name: no cost
        got = rows(write_report([run], tmp_path / "out2", price_per_hour=prices).read_text())["gpu_run"]
        assert got.get("cost $") == cost, prices
    assert_png(tmp_path / "out" / "gpu_memory.png")


def test_a_run_resumed_back_in_time_and_stopped_at_its_old_end_is_not_reported_finished(tmp_path):
    # run.resume=PATH back to an older step, on another course (a changed optim.lr), stopped at the
    # step the run had ended at: summary.json is the abandoned course's end, and the log's last step
    # is not its. The row is the interrupted run the log shows, not that end's numbers.
    run = tmp_path / "back"
    run.mkdir()
    recs = [{"step": 1, "tokens": 64, "loss": 3.0, "ms_per_step": 10.0},
            {"step": 2, "tokens": 128, "loss": 2.5, "ms_per_step": 10.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    end = {"steps": 2, "tokens": 128, "wall_s": 3600.0, "final_loss": 2.75}
    (run / "summary.json").write_text(json.dumps(end))
    row = rows(write_report([run], tmp_path / "a", plots=False).read_text())["back"]
    assert row["status"] == "unfinished at step 2" and row["final train loss"] == "2.5000", row
    (run / "summary.json").write_text(json.dumps({**end, "final_loss": 2.5}))  # this course's end
    assert rows(write_report([run], tmp_path / "b", plots=False).read_text())["back"]["status"] == "finished"


def test_a_run_on_the_second_gpu_is_named_and_priced_as_that_gpu(tmp_path):
    # A process on cuda:1 of a machine with two different cards rented the second: the report
    # names it and charges its price, not the first card's. A run dir written by hand: no training.
    run = tmp_path / "second_gpu"
    run.mkdir()
    record = {"step": 1, "tokens": 64, "loss": 2.0, "ms_per_step": 10.0}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 1, "tokens": 64, "wall_s": 3600.0, "final_loss": 2.0}))
    gpus = [{"name": "FakeGPU A", "memory_gb": 80.0}, {"name": "FakeGPU B", "memory_gb": 24.0}]
    (run / "metadata.json").write_text(json.dumps({"device": "cuda:1", "world_size": 1, "hardware": {"gpus": gpus}}))
    prices = {"FakeGPU A": 9.0, "FakeGPU B": 2.0}
    row = rows(write_report([run], tmp_path / "out", price_per_hour=prices, plots=False).read_text())["second_gpu"]
    assert row["device"] == "FakeGPU B x1" and row["cost $"] == "2.0000"


def test_the_run_s_mfu_weighs_each_interval_by_its_time(tmp_path):
    # Intervals of 10, 5 (ended by a checkpoint's flush) and 5 steps (holding the save), each MFU
    # in step with its throughput: the run's is its FLOPs over its 3.25 s, 20 steps x 40 / 3250 ms,
    # as its mean tokens/s is; a plain mean of the three (43.3%) overstates it.
    run = tmp_path / "mfu"
    run.mkdir()
    recs = [{"step": s, "tokens": 64 * s, "loss": 2.0, "ms_per_step": ms, "mfu": 40 / ms}
            for s, ms in ((10, 100.0), (15, 50.0), (20, 400.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = rows(write_report([run], tmp_path / "out", plots=False).read_text())["mfu"]
    assert row["wall time"] == "0:00:03" and row["MFU"] == f"{100 * 20 * 40 / 3250:.1f}%", row


def test_runs_whose_directories_share_a_name_are_told_apart(tmp_path, monkeypatch):
    # A sweep's sweep/lr1/seed0 and sweep/lr2/seed0: a row each that says which, and a default
    # --out of their own (not reports/seed0_vs_seed0, which another pair's seed0 would overwrite).
    for lr, loss in (("lr1", 2.0), ("lr2", 3.0)):
        run = tmp_path / "sweep" / lr / "seed0"
        run.mkdir(parents=True)
        record = {"step": 1, "tokens": 64, "loss": loss, "ms_per_step": 10.0}
        (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.chdir(tmp_path)
    assert report_main(["sweep/lr1/seed0", "sweep/lr2/seed0"]) == 0
    table = rows((tmp_path / "reports" / "lr1-seed0_vs_lr2-seed0" / "report.md").read_text())
    assert (table["lr1/seed0"]["final train loss"], table["lr2/seed0"]["final train loss"]) == ("2.0000", "3.0000")


def test_a_sweep_s_many_runs_get_a_default_out_a_file_system_takes(tmp_path, monkeypatch, capsys):
    # runs/sweep/* with 16 runs: their names joined make a directory name of 400 bytes, which a
    # file system refuses ("File name too long"); with no --out given, the default must fit.
    sweep = [tmp_path / "sweep" / f"lr{i}e-4_batch64_seed0" for i in range(16)]
    for run in sweep:
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": 64, "loss": 2.0}) + "\n")
    monkeypatch.chdir(tmp_path)
    assert report_main([str(r) for r in sweep]) == 0, capsys.readouterr().err
    assert report_main([str(r) for r in sweep[:15]]) == 0  # another sweep that starts the same
    made = sorted((tmp_path / "reports").iterdir())
    assert len(made) == 2 and all(len(d.name) <= 200 and (d / "report.md").is_file() for d in made), made
    assert made[0].name.startswith("lr0e-4_batch64_seed0_and_1")


def test_a_default_out_past_200_bytes_is_the_first_run_how_many_more_and_a_hash_of_every_name():
    # A file system counts bytes (255), not characters: runs named in accents pass it sooner. The
    # first run's name is cut to 100 bytes, whole characters only (a name of its own near 255 bytes
    # stays under it); the count is of the other runs; and two sweeps that start with the same run
    # and have as many runs are two reports, told apart by the hash of all their names.
    from tools.report import default_out

    runs = Path("runs")
    assert default_out([runs / ("a" * 98), runs / ("b" * 98)]) == Path("reports") / f"{'a' * 98}_vs_{'b' * 98}"
    accented = default_out([runs / ("a" + "é" * 60), runs / ("è" * 60)]).name  # 124 characters, 245 bytes
    assert accented.startswith("a" + "é" * 49 + "_and_1_more_"), accented
    a, b = (default_out([runs / ("x" * 240), runs / other]).name for other in ("y", "z"))
    assert a != b and a.startswith("x" * 100 + "_and_1_more_") and len(a.encode()) <= 200, a


@pytest.mark.slow
def test_a_summary_from_before_a_resume_is_not_the_run_s_end(runs, tmp_path):
    # The finished run resumed for more steps and killed at step 25: its summary.json says 20 steps,
    # "finished", but the report's row follows the log, which goes on to step 25.
    # Nothing else of that summary.json counts either: its energy (from before the resume) is not
    # added to the reading after it, and its sample is not shown as the newest.
    run = tmp_path / "resumed"
    shutil.copytree(runs["finished"], run)
    recs, energy = metrics(run), iter([1.0e6, 1.5e6, 1.8e6, 2.0e6])
    for r in recs:
        r.pop("sample", None)
        if "ms_per_step" in r:
            r["energy_j"] = next(energy)
    more = [{**recs[-1], "step": s, "tokens": recs[-1]["tokens"] + 640 * (s - 20), "loss": 1.5,
             "energy_j": 1.2e6, **({"sample": "the resumed session's"} if s == 25 else {})} for s in range(21, 26)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + more))
    (run / "summary.json").write_text(json.dumps({**summary(run), "energy_j": 2.5e6, "sample": "the first end's"}))
    md = write_report([run], tmp_path / "out").read_text()
    row = rows(md)["resumed"]
    assert (row["status"], row["steps"], row["final train loss"]) == ("unfinished at step 25", "25", "1.5000")
    assert row["energy kWh"] == f"{(2.0e6 + 1.2e6) / 3.6e6:.4f}"
    best = (run / "checkpoints" / "best").read_text()  # from checkpoints/best, not the old summary
    val = next(r["val_loss"] for r in recs if f"step_{r['step']:08d}" == best)
    assert row["best checkpoint"] == f"val_loss {val:.4g} at step {int(best[5:])}"
    assert "**resumed**, step 25:\n\n```\nthe resumed session's\n```" in md and "first end" not in md


@pytest.mark.slow
def test_the_best_the_peak_and_the_newest_are_reported(runs, tmp_path):
    """A copy of the finished run whose values are not in order: the best validation loss and the
    peak memory are not the last ones (a resume restarts CUDA's peak), a wall time over an hour,
    an evaluation's sample before the final one; and the device from config.yaml without metadata.json and summary.json."""
    run = tmp_path / "run"
    shutil.copytree(runs["finished"], run)
    recs, s = metrics(run), summary(run)
    peaks, vals = iter([2.0, 3.0, 1.0, 1.5]), iter([1.2, 1.4])
    for r in recs:
        if "ms_per_step" in r:
            r["cuda_max_alloc_gb"] = next(peaks)
        if "val_loss" in r:
            r["val_loss"] = next(vals)
        if r["step"] == 10:
            r["sample"] = "an early sample"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "summary.json").write_text(json.dumps({**s, "val_loss": 1.4, "wall_s": 3725.4, "sample": "the last"}))
    md = write_report([run], tmp_path / "out").read_text()
    row = rows(md)["run"]
    assert (row["best val loss"], row["peak memory GB"], row["wall time"]) == ("1.2000", "3.00", "1:02:05")
    assert md.endswith("## Samples\n\n**run**, step 20:\n\n```\nthe last\n```\n")
    (run / "metadata.json").unlink()
    (run / "summary.json").unlink()
    assert rows(write_report([run], tmp_path / "out").read_text())["run"]["device"] == "cpu x1"


@pytest.mark.slow
def test_cli(runs, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "tools.report", str(runs["finished"]), "--out", str(tmp_path / "r"),
                         "--price-per-hour", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert rows((tmp_path / "r" / "report.md").read_text())["finished"]["steps"] == "20"
    here = subprocess.run([sys.executable, "-m", "tools.report", ".", "--out", str(tmp_path / "here")],
                          cwd=runs["finished"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # the run named as "."
    assert here.returncode == 0 and rows((tmp_path / "here" / "report.md").read_text())["finished"]["steps"] == "20"
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    bad = subprocess.run([sys.executable, "-m", "tools.report", str(runs["finished"]), str(empty)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert str(empty) in bad.stderr and "metrics.jsonl" in bad.stderr


@pytest.mark.slow
def test_cli_prices_a_run_as_its_own_config_did(runs, tmp_path, capsys):
    # `python -m tools.report RUN` redraws a run's report with the run's report.price_per_hour and
    # co2_g_per_kwh, not the CLI's defaults ($0, 400 g/kWh), which would make the cost column n/a.
    run = tmp_path / "priced"
    shutil.copytree(runs["finished"], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["report"].update(price_per_hour=PRICE, co2_g_per_kwh=123.0)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    wall = summary(run)["wall_s"]
    for flags, price, co2 in (([], PRICE, "123"), (["--price-per-hour", "7", "--co2-g-per-kwh", "50"], 7.0, "50")):
        assert report_main([str(run), "--out", str(tmp_path / "out"), *flags]) == 0
        md = (tmp_path / "out" / "report.md").read_text()
        assert f"x ${price} per device-hour" in md and f"CO2 = kWh x {co2} g/kWh" in md, flags
        assert rows(md)["priced"]["cost $"] == f"{wall / 3600 * price:,.4f}", flags


@pytest.mark.slow
def test_cli_refuses_a_price_edited_into_the_run_s_config(runs, tmp_path, capsys):
    # The run's config.yaml edited by hand: a text price, null or a negative one is refused, not a
    # ValueError traceback, a TypeError or a negative cost. The options still override it.
    run = tmp_path / "edited"
    shutil.copytree(runs["finished"], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in [("price_per_hour", "abc"), ("price_per_hour", None), ("price_per_hour", -5),
                       ("co2_g_per_kwh", float("nan")), ("co2_g_per_kwh", True)]:
        (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "report": {**cfg["report"], key: value}}))
        assert report_main([str(run), "--out", str(tmp_path / "out")]) == 2, (key, value)
        assert capsys.readouterr().err == (f"error: {run / 'config.yaml'}: report.{key}={value!r}: expected "
                                           f"a finite number >= 0 (or give --{key.replace('_', '-')}).\n")
        flag = f"--{key.replace('_', '-')}"
        assert report_main([str(run), "--out", str(tmp_path / "out"), flag, "1"]) == 0, (key, value)


@pytest.mark.slow
def test_a_metadata_json_that_is_no_object_reads_as_missing(runs, tmp_path):
    # A JSON list there reads as missing, not an AttributeError traceback; the device then comes
    # from summary.json.
    run = tmp_path / "odd"
    shutil.copytree(runs["finished"], run)
    (run / "metadata.json").write_text("[1, 2]")
    assert rows(write_report([run], tmp_path / "out").read_text())["odd"]["device"] == "cpu x1"
    (run / "config.yaml").write_text("- a list\n")  # the same for a config.yaml that is no mapping
    assert rows(write_report([run], tmp_path / "out").read_text())["odd"]["device"] == "cpu x1"


def test_a_price_or_intensity_option_takes_zero_and_refuses_infinity():
    # --price-per-hour 0 is the config's "not reported" and must pass; inf passes ">= 0" but would
    # make an infinite cost, so it is refused as nan is.
    import argparse

    from loop.config.arguments import non_negative, positive

    assert (non_negative("0"), non_negative("1.5"), positive("0.5")) == (0.0, 1.5, 0.5)
    for check, text in ((non_negative, "inf"), (non_negative, "-1"), (non_negative, "nan"), (positive, "inf"),
                        (positive, "0")):
        with pytest.raises(argparse.ArgumentTypeError):
            check(text)


@pytest.mark.slow
def test_cli_bad_input_exits_2_and_rewrites_nothing(runs, tmp_path, capsys):
    # In this process (interpreters take seconds to start). Refused: a negative price or a nan
    # intensity (a report with a negative or nan cost), an --out under a file (a NotADirectoryError
    # traceback).
    def code(args: list[str]) -> int:
        try:
            return report_main(args)
        except SystemExit as e:  # argparse's own exit, after printing the error
            return e.code

    run = runs["finished"]
    before = (run / "report.md").read_bytes()
    (tmp_path / "file").write_text("mine")
    under_file = tmp_path / "file" / "r"
    for args, said in [
            (["--price-per-hour", "-1"], "argument --price-per-hour: expected a finite number >= 0, got '-1'"),
            (["--co2-g-per-kwh", "nan"], "argument --co2-g-per-kwh: expected a finite number >= 0, got 'nan'"),
            (["--out", str(under_file)], f"error: option --out={under_file}: {tmp_path / 'file'} is a file")]:
        assert code([str(run), *args]) == 2
        assert said in capsys.readouterr().err, args
    # A file named as the run (its metrics.jsonl): the error names the run, not an --out nobody
    # gave.
    assert code([str(run / "metrics.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: {run / 'metrics.jsonl'}: a file; expected a run " \
        f"directory (such as {run}, if it holds metrics.jsonl).\n"
    assert (run / "report.md").read_bytes() == before and (tmp_path / "file").read_text() == "mine"
    # A run stopped before its first step (an empty metrics.jsonl, no summary.json): not a blank row.
    (tmp_path / "early").mkdir()
    for text in ("", '{"step": 1, "lo'):  # or its first record cut short by the kill
        (tmp_path / "early" / "metrics.jsonl").write_text(text)
        assert code([str(tmp_path / "early")]) == 2 and "before its first step" in capsys.readouterr().err


@pytest.mark.slow
def test_run_files_edited_into_another_shape_are_bad_input(runs, tmp_path, capsys):
    # Each would be a traceback (exit 1) where the tool promises exit 2; a metrics.jsonl line that
    # is no record is passed over, as a line cut short is.
    run, out = tmp_path / "edited", tmp_path / "out"
    shutil.copytree(runs["finished"], run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")
    assert report_main([str(run), "--out", str(out)]) == 0
    summ = json.loads((run / "summary.json").read_text())
    for name, text in [("summary.json", json.dumps({**summ, "wall_s": "x"})),
                       ("config.yaml", yaml.safe_dump({"report": 5}))]:
        shutil.copy(runs["finished"] / name, tmp_path / name)
        (run / name).write_text(text)
        capsys.readouterr()
        assert report_main([str(run), "--out", str(out)]) == 2, name
        assert capsys.readouterr().err.startswith(f"error: {run}: a run file holds a value of another kind"), name
        shutil.copy(tmp_path / name, run / name)


def test_a_report_that_cannot_be_written_does_not_fail_the_run(tmp_path, cache, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("cannot draw this")

    monkeypatch.setattr("loop.observe.summary.write_report", broken)
    r = train_here(tmp_path / "run", cache, "train.max_steps=5")
    assert r.returncode == 0 and "warning: report not written (ValueError: cannot draw this)" in r.stderr
    assert summary(tmp_path / "run")["steps"] == 5 and (tmp_path / "run" / "model.pt").exists()


@pytest.mark.slow
def test_without_matplotlib(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    md = write_report([runs["finished"], runs["interrupted"]], tmp_path).read_text()
    assert "matplotlib is not installed" in md and "pip install '.[report]'" in md
    assert rows(md)["finished"]["steps"] == "20"
    assert not list(tmp_path.glob("*.png"))


def test_the_loss_is_drawn_on_a_log_axis_where_every_value_is_positive(tmp_path, monkeypatch):
    # On a linear axis a regression run's curve looks flat after its first 150 steps.
    from matplotlib.figure import Figure

    from loop.observe.plots import plot

    scales, labels = {}, {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path: scales.update({Path(path).stem: fig.axes[0].get_yscale()})
                        or labels.update({Path(path).stem: fig.axes[0].get_xlabel()}))
    recs = [{"step": s, "tokens": 8 * s, "loss": 1 / s, "lr": 1e-3} for s in range(1, 200)]
    plot([{"name": "run", "recs": recs}], tmp_path)
    assert scales == {"loss_vs_step": "log", "loss_vs_tokens": "log", "lr": "linear"}
    assert labels["loss_vs_tokens"] == "tokens"
    plot([{"name": "run", "recs": recs}], tmp_path, "targets")  # a regression's targets are not tokens
    assert labels["loss_vs_tokens"] == "targets"
    skipped = {"step": 200, "tokens": 1600, "loss": float("nan"), "lr": 1e-3}  # train.nan_policy=skip's
    plot([{"name": "run", "recs": [*recs, skipped]}], tmp_path)
    assert scales["loss_vs_step"] == scales["loss_vs_tokens"] == "log"  # NaN: not drawn, the axis stays
    plot([{"name": "run", "recs": [*recs, {"step": 200, "tokens": 1600, "loss": 0.0, "lr": 1e-3}]}], tmp_path)
    assert scales["loss_vs_step"] == "linear"  # a loss of 0 has no place on a log axis


@pytest.mark.slow
def test_a_run_whose_targets_are_not_tokens_says_targets(runs, tmp_path):
    run = tmp_path / "regression"
    shutil.copytree(runs["finished"], run)
    meta = json.loads((run / "metadata.json").read_text())
    (run / "metadata.json").write_text(json.dumps({**meta, "data": {**meta["data"], "unit": "targets"}}))
    md = write_report([run], tmp_path / "out").read_text()
    assert {"targets", "mean targets/s"} <= rows(md)["regression"].keys() and "tokens" not in md.split("\n")[2]
