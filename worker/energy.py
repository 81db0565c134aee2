"""Energy per token: measured through NVML on a GPU, otherwise a labelled estimate.

A meter is started before a run and stopped after it; the reading says whether it is a
measurement or an estimate, and of what, so a report can never pass one off as the other.

The CPU estimate: joules = CPU seconds used by the serving process tree × watts per busy
core. The default 4 W per busy core is a server CPU's TDP divided by its cores (e.g. a
360 W, 96-core part: 3.75 W), rounded up; it leaves out memory, fans and idle draw, so it
ranks settings against each other rather than predicting a power bill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

DEFAULT_WATTS_PER_BUSY_CORE = 4.0


@dataclass(frozen=True)
class EnergyReading:
    joules: float
    seconds: float
    source: str  # "nvml" or "cpu-time-estimate"
    is_estimate: bool

    def per_token(self, tokens: int) -> float:
        return self.joules / tokens if tokens else 0.0


class EnergyMeter(Protocol):
    def start(self) -> None: ...

    def stop(self) -> EnergyReading: ...


class CpuTimeEstimate:
    """Estimates from the CPU time of a process and all its children (e.g. a worker and
    its engine-core process)."""

    def __init__(self, pid: int, watts_per_busy_core: float = DEFAULT_WATTS_PER_BUSY_CORE) -> None:
        if watts_per_busy_core <= 0:
            raise ValueError("watts_per_busy_core must be positive")
        self._pid = pid
        self._watts = watts_per_busy_core
        self._cpu_start = 0.0
        self._wall_start = 0.0

    def _cpu_seconds(self) -> float:
        import psutil

        root = psutil.Process(self._pid)
        total = 0.0
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def start(self) -> None:
        self._cpu_start = self._cpu_seconds()
        self._wall_start = time.perf_counter()

    def stop(self) -> EnergyReading:
        cpu = self._cpu_seconds() - self._cpu_start
        return EnergyReading(
            joules=cpu * self._watts,
            seconds=time.perf_counter() - self._wall_start,
            source="cpu-time-estimate",
            is_estimate=True,
        )


class NvmlMeter:
    """Reads the GPU's energy counter (millijoules since driver load) before and after."""

    def __init__(self, device_index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._start_mj = 0
        self._wall_start = 0.0

    def start(self) -> None:
        self._start_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        self._wall_start = time.perf_counter()

    def stop(self) -> EnergyReading:
        end_mj = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        return EnergyReading(
            joules=(end_mj - self._start_mj) / 1000.0,
            seconds=time.perf_counter() - self._wall_start,
            source="nvml",
            is_estimate=False,
        )


def meter_for(pid: int, watts_per_busy_core: float = DEFAULT_WATTS_PER_BUSY_CORE) -> EnergyMeter:
    """NVML where a GPU and its library are present, else the CPU-time estimate."""
    try:
        return NvmlMeter()
    except Exception:  # no pynvml, no driver, no GPU: all mean "estimate instead"
        return CpuTimeEstimate(pid, watts_per_busy_core)
