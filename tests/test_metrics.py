"""The log interval's rates, on a clock the test sets: exact numbers, nothing timed."""
from __future__ import annotations

import json

import pytest
import torch

from loop.observe import metrics


def test_a_step_s_end_is_marked_on_the_stream_of_its_own_gpu(tmp_path, monkeypatch):
    # train.device=cuda:1 in one process: an event on the current device's stream (cuda:0, idle)
    # would make gpu_ms time nothing. CUDA faked: a loss on cuda:1, events that say where they went.
    class Event:
        def __init__(self, enable_timing):
            self.stream = None

        def record(self, stream=None):
            self.stream = stream

    class LossOnCuda1:
        is_cuda, device = True, torch.device("cuda", 1)

        def float(self):
            return torch.tensor(2.0)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"the current stream of {device}")
    log = metrics.MetricsLog(tmp_path, 0, 0, 0, max_steps=5, tensorboard=False)
    log.record({"step": 1}, LossOnCuda1(), torch.tensor(1.0))
    assert log.pending[0][0]["_event"].stream == "the current stream of cuda:1"
    log.file.close()


def test_interval_rates_cover_every_step_since_the_last_flush(tmp_path, monkeypatch):
    # data_wait_pct over all of the interval's steps, not its last step alone: only this test
    # tells the two apart, since other tests' runs log every step, where the two agree.
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    log = metrics.MetricsLog(tmp_path, 0, 0, 0, max_steps=5, tensorboard=False)

    def step(n: int, data_ms: float) -> None:
        log.record({"step": n, "lr": 1e-3, "tokens": 256 * n, "samples": 8 * n, "data_ms": data_ms},
                   torch.tensor(float(n)), torch.tensor(1.0))

    for n, wait in zip(range(1, 5), (10.0, 20.0, 30.0, 40.0)):
        step(n, wait)
    now[0] = 102.0  # 4 steps in 2 s, 100 ms of them waiting for data
    log.flush()
    assert log.last_loss == 4.0  # the interval's last step's (summary.json's final_loss)
    step(5, 50.0)
    now[0] = 103.0  # 1 step in the next 1 s
    log.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all("ms_per_step" not in r for r in recs[:3])  # rates go on an interval's last record
    rates = ("tokens_per_s", "samples_per_s", "ms_per_step", "data_wait_pct")
    assert [recs[3][k] for k in rates] == [512.0, 16.0, 500.0, 5.0]
    assert [recs[4][k] for k in rates] == [256.0, 8.0, 1000.0, 5.0]


# 1e20 - 1 steps of 1000.0 ms: 9.999999999999999e19 s in float64, 27777777777777773 h 13 min 36 s.
@pytest.mark.parametrize("max_steps, eta", [(200_001, "55:33:20"), (10**20, "27777777777777773:13:36")])
def test_the_console_eta_counts_hours_past_a_day(tmp_path, monkeypatch, capsys, max_steps, eta):
    # strftime("%H:%M:%S", gmtime(eta)) would show 200,000 s as 07:33:20, and train.max_steps=1e20
    # (a valid value) would end the run at its first log line: OverflowError from gmtime.
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    log = metrics.MetricsLog(tmp_path, 0, 0, 0, max_steps=max_steps, tensorboard=False)
    log.record({"step": 1, "lr": 1e-3, "tokens": 256, "samples": 8, "data_ms": 0.0},
               torch.tensor(1.0), torch.tensor(1.0))
    now[0] = 101.0  # one step a second
    log.close()
    assert capsys.readouterr().out.rstrip().endswith(f"| ETA {eta}")


def test_the_console_s_eval_line_shows_every_validation_metric(tmp_path, capsys):
    # A classifier's val_acc beside val_loss: the eval line is where a run shows it as it trains.
    log = metrics.MetricsLog(tmp_path, 0, 0, 0, max_steps=5, tensorboard=False)
    log.record({"step": 1, "lr": 1e-3, "tokens": 8, "samples": 8, "data_ms": 0.0},
               torch.tensor(2.0), torch.tensor(1.0))
    log.scalar(1, "val_loss", 1.5)
    log.scalar(1, "val_acc", 0.25)
    log.close()
    evals = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert [e.split(" | ")[1:] for e in evals] == [["val_loss 1.5000", "val_acc 0.2500"]], evals


def test_energy_is_the_run_s_over_every_start_of_train_py(tmp_path):
    # NVML's count starts again with each start of train.py (GpuSampler): the log adds the earlier
    # starts' (its last record kept at the resume), so the report takes the run's newest value.
    # A resumed start that reads more than the first's last (3500 > 3000) once read as one start.
    from loop.observe.report import load_run

    class Nvml:  # GpuSampler's readings of one start, in order
        def __init__(self, *joules):
            self.joules = iter(joules)

        def read(self, now=False):
            j = next(self.joules)
            return {"gpu0/energy_j": j, "energy_j": j}

        def mfu(self, tokens_per_s):
            return None

        def close(self):
            pass

    def start(at: int, upto: int, nvml: Nvml) -> metrics.MetricsLog:
        log = metrics.MetricsLog(tmp_path, at, 8 * at, at, max_steps=4, tensorboard=False, telemetry=nvml)
        for n in range(at + 1, upto + 1):
            log.record({"step": n, "lr": 1e-3, "tokens": 8 * n, "samples": n, "data_ms": 0.0},
                       torch.tensor(1.0), torch.tensor(1.0))
            log.flush()
        return log

    start(0, 3, Nvml(1000.0, 3000.0, 3200.0)).file.close()  # killed after step 3, checkpoint at 2
    log = start(2, 4, Nvml(3500.0, 5000.0, 5100.0))
    assert log.readings() == {"gpu0/energy_j": 5100.0, "energy_j": 8100.0}  # summary.json's, at the end
    log.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["energy_j"], r["gpu0/energy_j"]) for r in recs] == \
        [(1, 1000.0, 1000.0), (2, 3000.0, 3000.0), (3, 6500.0, 3500.0), (4, 8000.0, 5000.0)]
    assert load_run(tmp_path)["kwh"] == 8000.0 / 3.6e6
    # A start with no NVML (another node) to step 5, checkpoint there: the next goes on from 8000.
    start(4, 5, None).close()
    start(5, 6, Nvml(700.0, 800.0)).close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "energy_j" not in recs[4] and recs[5]["energy_j"] == 8700.0
    assert load_run(tmp_path)["kwh"] == 8700.0 / 3.6e6


def test_a_resumed_log_shows_each_step_once_in_tensorboard_too(tmp_path):
    # Resumed at step 2 after a start that logged to step 4: TensorBoard purges the old 3 and 4
    # (purge_step 3), so it shows one run, the resumed start's values from step 3 on.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def start(at: int, upto: int, loss: float) -> None:
        log = metrics.MetricsLog(tmp_path, at, 8 * at, at, max_steps=4)
        for n in range(at + 1, upto + 1):
            log.record({"step": n, "lr": 1e-3, "tokens": 8 * n, "samples": n, "data_ms": 0.0},
                       torch.tensor(loss + n), torch.tensor(1.0))
            log.flush(console=False)
        log.close()

    start(0, 4, 0.0)
    start(2, 4, 10.0)
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_the_newest_record_with_a_key_is_found_past_records_and_texts_without_it(tmp_path):
    from loop.observe.jsonl import last_with

    path = tmp_path / "metrics.jsonl"
    recs = [{"step": 1, "energy_j": 5.0}, {"step": 2, "energy_j": 7.0}, {"step": 3, "sample": 'say "energy_j": 9'},
            {"step": 4, "gpu0/energy_j": 1.0}, {"step": 5, "nested": {"energy_j": 2.0}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 6, "energy_j": 3')  # cut short
    assert last_with(path, "energy_j") == {"step": 2, "energy_j": 7.0}
    assert last_with(path, "loss") is None and last_with(tmp_path / "none.jsonl", "energy_j") is None


def test_a_resumed_log_whose_last_record_was_edited_has_no_last_loss_not_a_traceback(tmp_path):
    # Its record without "loss" was a KeyError at the resume; with a string, a summary.json of it.
    for last in ({"step": 2}, {"step": 2, "loss": "oops"}, {"step": 2, "loss": True}):
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n" + json.dumps(last) + "\n")
        log = metrics.MetricsLog(tmp_path, 2, 0, 0, max_steps=5, tensorboard=False)
        assert log.last_loss is None
        log.close()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 3}) + "\n")
    log = metrics.MetricsLog(tmp_path, 2, 0, 0, max_steps=5, tensorboard=False)
    assert log.last_loss == 3.0
    log.close()

