"""Every LR schedule, driven through LambdaLR, gives the closed-form LR at each step and resumes exactly;
the trainer applies each step with the LR the schedule gives it and the log shows."""
from __future__ import annotations

import io
import math
from dataclasses import replace

import pytest
import torch

from loop.config.schema import ScheduleConfig
from loop.errors import BadInput
from loop.schedule import SCHEDULES, build_scheduler


def make(cfg: ScheduleConfig, lr: float, max_steps: int):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return opt, build_scheduler(opt, cfg, max_steps)


def lrs(cfg: ScheduleConfig, lr: float, max_steps: int, n: int) -> list[float]:
    """The LR the optimizer holds at optimizer steps 0..n-1 (read before each step)."""
    opt, sched = make(cfg, lr, max_steps)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def cos_factor(t: float, period: float, floor: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t / period))


def test_warmup_cosine_pinned_numbers():
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)
    got = lrs(cfg, 1.0, 110, 131)
    assert got[0] == pytest.approx(0.1, rel=1e-12)  # warmup starts above zero: 1/10
    assert got[4] == pytest.approx(0.5, rel=1e-12)
    assert got[9] == pytest.approx(1.0, rel=1e-12)
    assert got[10] == pytest.approx(1.0, rel=1e-12)  # cosine at progress 0
    assert got[60] == pytest.approx(0.55, rel=1e-12)  # halfway: 0.1 + 0.9 * 0.5
    assert got[110] == pytest.approx(0.1, rel=1e-12)  # the floor at max_steps
    assert got[130] == pytest.approx(0.1, rel=1e-12)  # and after it
    for s in range(10, 131):
        expected = cos_factor(min(s - 10, 100), 100, 0.1)
        assert got[s] == pytest.approx(expected, rel=1e-12), s
    assert all(a >= b for a, b in zip(got[10:], got[11:]))  # monotone after warmup


def test_warmup_cosine_scales_with_lr_and_no_warmup():
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=0, min_lr_ratio=0.0)
    got = lrs(cfg, 3e-4, 40, 41)
    assert got[0] == pytest.approx(3e-4, rel=1e-12)
    assert got[20] == pytest.approx(1.5e-4, rel=1e-12)
    assert got[10] == pytest.approx(3e-4 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-12)
    assert got[40] == 0.0


def test_warmup_cosine_whose_warmup_is_the_whole_run_steps_past_its_last_step():
    # schedule.warmup_steps = train.max_steps is allowed (only longer is noted): the scheduler's
    # step after the last optimizer step computes the factor at max_steps, where the cosine has
    # no steps left (0 / 0 without the max(1, ...)): the run's last step must not crash.
    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=4, min_lr_ratio=0.1)
    opt, sched = make(cfg, 1.0, 4)
    for _ in range(4):
        opt.step()
        sched.step()
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == 1.0
    assert lrs(cfg, 1.0, 4, 4) == [0.25, 0.5, 0.75, 1.0]


def test_cosine_restarts_fixed_period():
    cfg = ScheduleConfig(name="cosine_restarts", warmup_steps=0, restart_period=10,
                         restart_mult=1, min_lr_ratio=0.0)
    got = lrs(cfg, 1.0, 1000, 41)
    for s in (0, 10, 20, 30, 40):  # restarts
        assert got[s] == pytest.approx(1.0, rel=1e-12), s
    for s in (5, 15, 25, 35):
        assert got[s] == pytest.approx(0.5, rel=1e-12), s
    assert got[9] == pytest.approx(0.5 * (1 + math.cos(0.9 * math.pi)), rel=1e-12)
    assert got[9] < 0.03 and got[10] == 1.0
    for s in range(41):
        assert got[s] == pytest.approx(cos_factor(s % 10, 10, 0.0), rel=1e-12), s


def test_cosine_restarts_growing_period_after_warmup():
    # warmup 5, then cycles of 10, 20, 40, 80 steps: they start at t = 0, 10, 30, 70, 150.
    cfg = ScheduleConfig(name="cosine_restarts", warmup_steps=5, restart_period=10,
                         restart_mult=2, min_lr_ratio=0.2)
    got = lrs(cfg, 1.0, 1000, 160)
    starts, lengths = [0, 10, 30, 70, 150], [10, 20, 40, 80, 160]
    for s in range(5):
        assert got[s] == pytest.approx((s + 1) / 5, rel=1e-12)
    for s in (5, 15, 35, 75, 155):  # the restarts
        assert got[s] == pytest.approx(1.0, rel=1e-12), s
    assert got[25] == pytest.approx(0.6, rel=1e-12)  # t=20: halfway through the 20-step cycle
    assert got[55] == pytest.approx(0.6, rel=1e-12)  # t=50: halfway through the 40-step cycle
    for s in range(5, 160):
        t = s - 5
        i = max(k for k, start in enumerate(starts) if start <= t)
        assert got[s] == pytest.approx(cos_factor(t - starts[i], lengths[i], 0.2), rel=1e-12), s


def test_inverse_sqrt():
    cfg = ScheduleConfig(name="inverse_sqrt", warmup_steps=4)
    got = lrs(cfg, 2.0, 100, 100)
    assert got[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0], rel=1e-12)
    assert got[4] == pytest.approx(2.0 * math.sqrt(4 / 5), rel=1e-12)
    assert got[15] == pytest.approx(1.0, rel=1e-12)  # 2 * sqrt(4/16)
    assert got[99] == pytest.approx(0.4, rel=1e-12)  # 2 * sqrt(4/100)
    for s in range(4, 100):
        assert got[s] == pytest.approx(2.0 * math.sqrt(4 / (s + 1)), rel=1e-12)

    got = lrs(replace(cfg, warmup_steps=0), 1.0, 100, 16)  # no warmup: 1/sqrt(s+1)
    assert got[0] == 1.0 and got[3] == pytest.approx(0.5, rel=1e-12)
    assert got[15] == pytest.approx(0.25, rel=1e-12)


def test_step_decay():
    cfg = ScheduleConfig(name="step", warmup_steps=2, step_size=5, gamma=0.5)
    got = lrs(cfg, 1.0, 100, 23)
    expected = [0.5, 1.0] + [0.5 ** ((s - 2) // 5) for s in range(2, 23)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[6] == 1.0 and got[7] == 0.5 and got[12] == 0.25 and got[22] == 0.0625


def test_constant():
    cfg = ScheduleConfig(name="constant", warmup_steps=3)
    got = lrs(cfg, 0.3, 100, 10)
    assert got == pytest.approx([0.1, 0.2, 0.3] + [0.3] * 7, rel=1e-12)
    assert lrs(replace(cfg, warmup_steps=0), 0.3, 100, 3) == pytest.approx([0.3] * 3, rel=1e-12)


def test_every_schedule_has_a_closed_form_test():
    # The tests above pin these five; a new schedule needs its own closed-form test here.
    assert set(SCHEDULES) == {"warmup_cosine", "cosine_restarts", "inverse_sqrt", "step", "constant"}


def test_unknown_schedule_name():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(BadInput) as e:
        build_scheduler(opt, ScheduleConfig(name="linear"), 10)
    assert str(e.value).startswith("config key schedule.name: expected one of warmup_cosine, ")
    assert "'linear'" in str(e.value)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_state_dict_resumes_identical_lrs(name):
    cfg = ScheduleConfig(name=name, warmup_steps=3, restart_period=4, restart_mult=2, step_size=3)
    k, n, max_steps = 7, 30, 25
    opt, sched = make(cfg, 0.5, max_steps)
    for _ in range(k):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    opt2, sched2 = make(cfg, 0.5, max_steps)  # fresh: at step 0
    assert opt2.param_groups[0]["lr"] != opt.param_groups[0]["lr"]
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert sched2.last_epoch == k and sched2.get_last_lr() == sched.get_last_lr()

    a, b = [], []
    for _ in range(n):
        a.append(opt.param_groups[0]["lr"])
        b.append(opt2.param_groups[0]["lr"])
        opt.step(), sched.step(), opt2.step(), sched2.step()
    assert a == b  # bit-identical, not approximately
    reference = lrs(cfg, 0.5, max_steps, k + n)[k:]
    assert a == reference


def test_a_resumed_schedule_sets_the_resumed_step_s_lr_into_the_loop_s_adamw():
    # The loop's AdamW keeps this run's settings on load (optim.lr, the lr LambdaLR set at step
    # 0), so the schedule's load must set the resumed step's lr, or that step runs at step 0's.
    from loop.optim import AdamW

    cfg = ScheduleConfig(name="warmup_cosine", warmup_steps=3, min_lr_ratio=0.1)

    def adamw():
        opt = AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        return opt, build_scheduler(opt, cfg, 20)

    opt, sched = adamw()
    for _ in range(7):
        opt.step()
        sched.step()
    opt2, sched2 = adamw()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == lrs(cfg, 0.5, 20, 8)[7]


def test_the_trainer_steps_with_the_lr_it_logs(tmp_path, cache):
    # The LR the optimizer holds as it applies each step (a step pre-hook) is the schedule's and the
    # one metrics.jsonl shows. Only this test catches a scheduler stepped before the optimizer,
    # which shifts every step's LR by one while the log still shows the right one. A skipped step
    # (the NaN at step 6) applies nothing and does not advance the schedule.
    from conftest import TINY, build_trainer, load_config, metrics
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    out = tmp_path / "run"
    cfg = load_config(DEFAULT_CONFIG, [*TINY, f"run.out_dir={out}", cache, "train.max_steps=12",
                                       "schedule.warmup_steps=4", "faults.nan_at_step=6",
                                       "train.eval_every=0", "train.ckpt_every=0"])
    trainer = build_trainer(cfg, Dist(), torch.device("cpu"))
    applied = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"]))
    trainer.run()
    expected = lrs(cfg.schedule, cfg.optim.lr, 12, 11)  # the 11 steps taken
    assert applied == expected
    assert [r["lr"] for r in metrics(out)] == expected[:5] + expected[5:6] + expected[5:]
    assert [r["skipped"] for r in metrics(out)] == [False] * 5 + [True] + [False] * 6
