"""GPU telemetry: an NVML sampler (`pynvml`, from nvidia-ml-py) in a background thread.

Per GPU: utilisation (%), memory used (GB = 1e9 bytes), power (W), temperature (C), and energy (J)
since the sampler started: from NVML's total-energy counter where the GPU has one, else power
integrated over time (trapezoid between samples). Use:
    gpu = GpuSampler(interval_s=1.0, devices={0: "GPU-8f1c..."})  # None: every GPU NVML sees
    fields.update(gpu.read())   # at the log interval: the latest sample, never waits on NVML
    gpu.close()                 # end of run: stops the thread, shuts NVML down
Without NVIDIA (no driver, no nvidia-ml-py) it prints one line, 'GPU telemetry off: <reason>', and
read() returns {}; telemetry never stops training. `devices` names each GPU by its NVML UUID under
the label its readings get (loop/observe/telemetry.py: CUDA's index): NVML's own numbering ignores
CUDA_VISIBLE_DEVICES and may order the GPUs otherwise than CUDA does.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable


def _get(fn: Callable[[], Any]) -> Any:
    """fn(), or None if it raises: one unsupported or failing metric must not cost the others."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 -- NVMLError_* subclasses, and anything a driver may throw
        return None


class GpuSampler:
    def __init__(self, interval_s: float = 1.0, devices: dict[int, str] | None = None, nvml: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        """Start sampling in a daemon thread. `nvml` is the pynvml module (injected for tests; default:
        import pynvml); `clock` gives seconds (injected for tests: power integration uses it). If NVML
        cannot be loaded or initialised, print one line to stderr and become a no-op."""
        self.interval_s, self._clock = interval_s, clock
        self._latest: dict[str, float] = {}
        self._stop = threading.Event()
        self._sampling = threading.Lock()  # sample_once() from the thread and from a caller take turns
        self._thread: threading.Thread | None = None
        self._nvml = n = self._init(nvml, devices)
        if n is None:
            return
        # Energy counter at start (mJ since driver load), or None: no counter here, integrate power.
        self._base: dict[int, float | None] = {
            i: _get(lambda h=h: float(n.nvmlDeviceGetTotalEnergyConsumption(h)))
            for i, h in self._handles.items()}
        self._energy: dict[int, float] = {i: 0.0 for i in self._handles}
        self._last_power: dict[int, tuple[float, float]] = {}  # (time s, W) of the last power reading
        self.sample_once()  # so read() has values at the first log, and integration has its start
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()

    def _init(self, nvml: Any, devices: dict[int, str] | None) -> Any:
        started = False
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            started = True
            if devices is None:
                self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())}
            else:
                self._handles = {i: nvml.nvmlDeviceGetHandleByUUID(uuid) for i, uuid in devices.items()}
            if not self._handles:
                raise RuntimeError("NVML sees no GPU")
            return nvml
        except Exception as e:  # noqa: BLE001 -- ImportError, NVMLError_LibraryNotFound, OSError...:
            # all mean the same here, and a machine without NVIDIA must still train
            print(f"GPU telemetry off: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if started:
                _get(nvml.nvmlShutdown)
            return None

    def sample_once(self) -> dict[str, float]:
        """Read every GPU now and publish the result (the thread calls this each interval); returns
        what read() now returns. Tests call it to sample synchronously."""
        with self._sampling:
            n = self._nvml
            if n is None:  # off, or closed
                return self.read()
            out: dict[str, float] = {}
            for i, h in self._handles.items():
                now = self._clock()
                power = _get(lambda: n.nvmlDeviceGetPowerUsage(h) / 1e3)  # mW -> W
                vals = {"util_pct": _get(lambda: float(n.nvmlDeviceGetUtilizationRates(h).gpu)),
                        "mem_used_gb": _get(lambda: n.nvmlDeviceGetMemoryInfo(h).used / 1e9),
                        "power_w": power,
                        "temp_c": _get(lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
                        "energy_j": self._update_energy(n, i, h, now, power)}
                out.update({f"gpu{i}/{k}": v for k, v in vals.items() if v is not None})
            out["energy_j"] = sum(self._energy.values())
            self._latest = out  # one reference assignment: read() never sees a half-built dict
            return self.read()

    def _update_energy(self, n: Any, i: int, h: Any, now: float, power_w: float | None) -> float:
        base = self._base[i]
        if base is not None:  # the counter is exact whatever the power did between samples
            j = _get(lambda: (n.nvmlDeviceGetTotalEnergyConsumption(h) - base) / 1e3)  # mJ -> J
            if j is not None:
                self._energy[i] = j
        elif power_w is not None:  # a failed power read is bridged by the next good one
            if i in self._last_power:
                t0, w0 = self._last_power[i]
                self._energy[i] += (w0 + power_w) / 2 * (now - t0)
            self._last_power[i] = (now, power_w)
        return self._energy[i]

    def read(self) -> dict[str, float]:
        """The latest sample, e.g. {"gpu0/util_pct": 97.0, "gpu0/mem_used_gb": 61.2, "gpu0/power_w":
        612.4, "gpu0/temp_c": 71.0, "gpu0/energy_j": 12345.6, "energy_j": <sum over GPUs>}; a metric
        that failed is left out. Non-blocking; {} when telemetry is off."""
        return dict(self._latest)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # sleeps, and wakes at once on close()
            self.sample_once()

    def close(self) -> None:
        """Stop the thread (joins) and shut NVML down; read() keeps the last sample. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._sampling:
            n, self._nvml = self._nvml, None
        if n is not None:
            _get(n.nvmlShutdown)
