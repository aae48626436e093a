"""Proves GpuSampler reports NVML readings in the right units, energy from the counter or from power
integrated exactly over time, samples in a background thread that survives failing metrics and stops
promptly, and turns itself off with one stderr line where NVML is missing (the real pynvml included)."""
from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest

from loop.observe.gpu import GpuSampler

IDLE = 1e9  # an interval the thread never reaches: the test drives sampling with sample_once()


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """The part of pynvml that GpuSampler uses; handles are strings, to catch index/handle mix-ups."""
    NVML_TEMPERATURE_GPU = 0
    NVMLError = FakeNVMLError

    def __init__(self, n: int = 2, energy_mj: list[int | None] | None = None, init_error=None):
        self.n, self.init_error = n, init_error
        self.util = [97, 40][:n]
        self.mem_bytes = [61_200_000_000, 1_500_000_000][:n]
        self.power_mw = [612_400, 100_000][:n]
        self.temp = [71, 45][:n]
        self.energy_mj = energy_mj if energy_mj is not None else [5_000_000, 7_000_000][:n]
        self.broken: set[str] = set()  # metric names that raise
        self.power_reads, self.shutdowns = 0, 0
        self.reads_done = threading.Event()  # set once power has been read `want_reads` times
        self.want_reads = 3

    def _idx(self, h: str) -> int:
        return int(h.removeprefix("handle"))

    def _check(self, name: str) -> None:
        if name in self.broken:
            raise RuntimeError(f"{name} failed")

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < self.n:
            raise FakeNVMLError("Invalid Argument")
        return f"handle{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid):  # NVML's device i has the UUID GPU-<i, 8 times>
        if uuid not in (uuids := [f"GPU-{str(i) * 8}" for i in range(self.n)]):
            raise FakeNVMLError("Not Found")
        return f"handle{uuids.index(uuid)}"

    def nvmlDeviceGetUtilizationRates(self, h):
        self._check("util")
        return SimpleNamespace(gpu=self.util[self._idx(h)], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check("mem")
        return SimpleNamespace(used=self.mem_bytes[self._idx(h)], total=80_000_000_000, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        self.power_reads += 1
        if self.power_reads >= self.want_reads:
            self.reads_done.set()
        self._check("power")
        return self.power_mw[self._idx(h)]

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        self._check("temp")
        return self.temp[self._idx(h)]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        mj = self.energy_mj[self._idx(h)]
        if mj is None:
            raise FakeNVMLError("Not Supported")
        return mj


def off_lines(err: str) -> list[str]:
    assert all(line.startswith("GPU telemetry off: ") for line in err.splitlines()), err
    return err.splitlines()


def test_readings_units_and_energy_from_counter():
    fake = FakeNvml()
    gpu = GpuSampler(interval_s=IDLE, nvml=fake)
    fake.energy_mj = [5_000_000 + 1_500_000, 7_000_000 + 250_500]  # mJ since driver load
    got = gpu.sample_once()
    assert got == gpu.read()
    assert got == pytest.approx({
        "gpu0/util_pct": 97.0, "gpu0/mem_used_gb": 61.2, "gpu0/power_w": 612.4, "gpu0/temp_c": 71.0,
        "gpu0/energy_j": 1500.0,
        "gpu1/util_pct": 40.0, "gpu1/mem_used_gb": 1.5, "gpu1/power_w": 100.0, "gpu1/temp_c": 45.0,
        "gpu1/energy_j": 250.5,
        "energy_j": 1750.5})
    gpu.close()
    assert fake.shutdowns == 1


def test_devices_picks_gpus_by_uuid_under_their_labels():
    fake = FakeNvml()
    gpu = GpuSampler(interval_s=IDLE, devices={0: "GPU-11111111"}, nvml=fake)  # NVML's device 1
    got = gpu.read()  # the constructor's own sample: values at once
    assert sorted(got) == ["energy_j", "gpu0/energy_j", "gpu0/mem_used_gb", "gpu0/power_w",
                           "gpu0/temp_c", "gpu0/util_pct"]
    assert got["gpu0/util_pct"] == 40.0 and got["energy_j"] == got["gpu0/energy_j"] == 0.0
    gpu.close()


@pytest.mark.parametrize("env, device, want", [
    ({}, "cuda:1", {1: "GPU-ab"}),
    ({}, "cuda", {0: "GPU-aa"}),  # the current device
    ({"LOCAL_WORLD_SIZE": "2"}, "cuda:0", {0: "GPU-aa", 1: "GPU-ab"}),  # torchrun: the node's processes'
    ({}, "cpu", None), ({}, "mps", None)])
def test_a_run_samples_the_gpus_its_processes_train_on(monkeypatch, env, device, want):
    # Only the run's own GPUs: summing every GPU NVML sees would count, on a shared machine
    # (CUDA_VISIBLE_DEVICES=3), the other jobs' energy too. CUDA faked: its device i has the UUID
    # "a" + "abcd"[i].
    from types import SimpleNamespace

    import torch

    from loop.observe.telemetry import node_gpus

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="a" + "abcd"[i]))
    assert node_gpus(torch.device(device)) == want


def test_energy_integrates_power_where_there_is_no_counter():
    t = [100.0]
    fake = FakeNvml(energy_mj=[9_000_000, None])  # gpu0 has the counter, gpu1 raises NVMLError
    fake.power_mw[1] = 100_000
    gpu = GpuSampler(interval_s=IDLE, nvml=fake, clock=lambda: t[0])
    assert gpu.read()["gpu1/energy_j"] == 0.0
    t[0], fake.power_mw[1] = 102.0, 300_000
    assert gpu.sample_once()["gpu1/energy_j"] == pytest.approx(400.0)  # (100 + 300) / 2 W x 2 s
    t[0], fake.energy_mj[0] = 103.0, 9_000_000 + 20_000
    got = gpu.sample_once()  # 300 W for 1 s more
    assert got["gpu1/energy_j"] == pytest.approx(700.0)
    assert got["gpu0/energy_j"] == pytest.approx(20.0)
    assert got["energy_j"] == pytest.approx(720.0)
    # A failed power read is skipped; the next good one integrates over the whole gap.
    fake.broken.add("power")
    t[0] = 104.0
    got = gpu.sample_once()
    assert "gpu1/power_w" not in got and got["gpu1/energy_j"] == pytest.approx(700.0)
    fake.broken.clear()
    t[0], fake.power_mw[1] = 106.0, 100_000
    assert gpu.sample_once()["gpu1/energy_j"] == pytest.approx(700.0 + 200.0 * 3)
    gpu.close()


def test_failing_metrics_are_skipped_and_the_thread_keeps_sampling():
    fake = FakeNvml()
    fake.broken = {"temp", "util"}
    fake.want_reads = 2 * 4  # 2 GPUs: the constructor's sample, then 3 by the thread
    gpu = GpuSampler(interval_s=0.005, nvml=fake)
    assert fake.reads_done.wait(10), "the thread did not sample"
    assert gpu._thread.is_alive() and gpu._thread.daemon
    got = gpu.read()
    assert "gpu0/temp_c" not in got and "gpu1/util_pct" not in got
    assert got["gpu0/power_w"] == 612.4 and got["gpu1/mem_used_gb"] == 1.5
    start = time.monotonic()
    gpu.close()
    assert not gpu._thread.is_alive() and time.monotonic() - start < 1.0
    reads = fake.power_reads
    time.sleep(0.05)  # ten intervals: a thread still running would read again
    assert fake.power_reads == reads and fake.shutdowns == 1


def test_close_wakes_a_sleeping_thread_at_once():
    fake = FakeNvml()
    gpu = GpuSampler(interval_s=IDLE, nvml=fake)
    start = time.monotonic()
    gpu.close()
    gpu.close()  # idempotent
    assert time.monotonic() - start < 1.0 and fake.shutdowns == 1
    assert gpu.read()["gpu0/power_w"] == 612.4  # the last sample stays readable
    assert gpu.sample_once() == gpu.read()  # closed: no NVML call
    assert fake.power_reads == 2


@pytest.mark.parametrize("case", ["import fails", "init raises", "no gpu", "unknown uuid"])
def test_off_without_nvml(case, monkeypatch, capsys):
    fake, devices = None, None
    if case == "import fails":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    elif case == "init raises":
        fake = FakeNvml(init_error=FakeNVMLError("Driver Not Loaded"))
    elif case == "no gpu":
        fake = FakeNvml(n=0)
    else:
        fake, devices = FakeNvml(), {0: "GPU-55555555"}
    gpu = GpuSampler(interval_s=0.001, devices=devices, nvml=fake)
    assert gpu.read() == {} and gpu.sample_once() == {}
    gpu.close()
    gpu.close()
    lines = off_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    if fake is not None:  # shut down exactly when init had succeeded
        assert fake.shutdowns == (0 if case == "init raises" else 1)
        assert fake.power_reads == 0


def test_real_pynvml_on_this_machine(capsys):
    """Without an NVIDIA driver (this project's CI machine) it degrades cleanly; with one, it reads."""
    pytest.importorskip("pynvml")
    gpu = GpuSampler(interval_s=IDLE)
    got = gpu.read()
    gpu.close()
    err = capsys.readouterr().err
    if err:
        assert len(off_lines(err)) == 1 and got == {}
    else:
        assert got["energy_j"] >= 0 and "gpu0/mem_used_gb" in got


def test_a_run_logs_what_nvml_reads_and_sums_up_its_energy(tmp_path, cache, monkeypatch):
    # The sampler wired into a run (on the CPU, told its GPU is NVML's device 0, a fake whose energy
    # counter gains 1 J at every read): each log interval carries its readings, summary.json the
    # run's energy. A CPU run reads no GPU at all (below).
    import torch

    from conftest import TINY, build_trainer, load_config, metrics, summary
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist

    class Counting(FakeNvml):
        def nvmlDeviceGetTotalEnergyConsumption(self, h):
            self.energy_mj[0] += 1000
            return self.energy_mj[0]

    fake = Counting(n=1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr("loop.observe.telemetry.node_gpus", lambda device: {0: "GPU-00000000"})  # as on CUDA
    out = tmp_path / "run"
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={out}", "train.max_steps=6",
                                       "train.log_every=2"])
    s = build_trainer(cfg, Dist(), torch.device("cpu")).run()
    logged = [r for r in metrics(out) if "ms_per_step" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for r in logged:
        assert (r["gpu0/util_pct"], r["gpu0/mem_used_gb"], r["gpu0/power_w"], r["gpu0/temp_c"]) == \
            (97.0, 61.2, 612.4, 71.0)
    energy = [r["energy_j"] for r in logged]
    assert 0 < energy[0] <= energy[1] <= energy[2] <= s["energy_j"] == summary(out)["energy_j"]
    assert fake.shutdowns == 1  # the sampler closed with the run
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = build_trainer(load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / 'cpu'}",
                                                   "train.max_steps=2"]), Dist(), torch.device("cpu")).run()
    assert "energy_j" not in s and not any(k.startswith("gpu") for r in metrics(tmp_path / "cpu") for k in r)


def test_the_summary_counts_energy_to_the_end_of_the_run(tmp_path, cache, monkeypatch):
    # The energy the run used after the sampler's last reading counts too: a short run (10 steps
    # on an H200) ends before the sampler's first tick (1 s), and its summary.json would say
    # energy_j 0.
    import functools

    import torch

    from conftest import TINY, build_trainer, load_config
    from loop.config.load import DEFAULT_CONFIG
    from loop.distributed.group import Dist
    from loop.observe.telemetry import Telemetry

    fake = FakeNvml(n=1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr("loop.observe.telemetry.node_gpus", lambda device: {0: "GPU-00000000"})
    monkeypatch.setattr("loop.observe.telemetry.GpuSampler", functools.partial(GpuSampler, interval_s=IDLE))
    cfg = load_config(DEFAULT_CONFIG, [*TINY, cache, f"run.out_dir={tmp_path / 'run'}", "train.max_steps=2"])
    trainer = build_trainer(cfg, Dist(), torch.device("cpu"))
    step = trainer.step

    def drawing() -> bool:  # each step draws 1.25 J, after the sampler's one reading (0 J)
        fake.energy_mj[0] += 1_250
        return step()

    trainer.step = drawing
    # And its peak CUDA memory, alone of the memory readings (CUDA faked: readings a GPU run adds).
    read = Telemetry.read
    monkeypatch.setattr(Telemetry, "read", lambda self, now=False: {
        **read(self, now), "cuda_alloc_gb": 1.0, "cuda_reserved_gb": 2.0, "cuda_max_alloc_gb": 1.5})
    s = trainer.run()
    assert s["energy_j"] == 2.5 and s["cuda_max_alloc_gb"] == 1.5
    assert "cuda_alloc_gb" not in s and "cuda_reserved_gb" not in s


def test_cuda_memory_is_read_in_gb_of_1e9_bytes(monkeypatch):
    # cuda_*_gb are GB as NVML's mem_used_gb are (1e9 bytes), not GiB: the report and the console
    # put them beside each other. CUDA faked: a Telemetry of a CPU model told it runs on cuda:0.
    import torch

    from loop.observe.telemetry import Telemetry

    tel = Telemetry(torch.nn.Linear(2, 2), torch.device("cpu"), "fp32", world=1)
    tel.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 3_000_000_000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 4_500_000_000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3_500_000_000)
    assert tel.read() == {"cuda_alloc_gb": 3.0, "cuda_reserved_gb": 4.5, "cuda_max_alloc_gb": 3.5}
