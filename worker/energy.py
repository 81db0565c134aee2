"""Energy per token: measured through NVML on a GPU, otherwise a labelled estimate.

A meter is started before a run and stopped after it; the reading says whether it is a
measurement or an estimate, and of what, so a report can never pass one off as the other.

The CPU estimate: joules = CPU seconds used by the serving process tree × watts per busy
core. The default 4 W per busy core is a server CPU's TDP divided by its cores (e.g. a
360 W, 96-core part: 3.75 W), rounded up; it leaves out memory, fans and idle draw, so it
ranks settings against each other rather than predicting a power bill.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_WATTS_PER_BUSY_CORE = 4.0


@dataclass(frozen=True)
class EnergyReading:
    joules: float
    seconds: float
    source: str  # "nvml" or "cpu-time-estimate"
    is_estimate: bool
    detail: str = ""
    """How it was had: the estimate's watts per core and why NVML did not measure."""

    def per_token(self, tokens: int) -> float:
        return self.joules / tokens if tokens else 0.0


class EnergyMeter(Protocol):
    def start(self) -> None: ...

    def stop(self) -> EnergyReading: ...


class CpuTimeEstimate:
    """Estimates from the CPU time of a process and all its children (e.g. a worker and
    its engine-core process)."""

    def __init__(
        self,
        pid: int,
        watts_per_busy_core: float = DEFAULT_WATTS_PER_BUSY_CORE,
        why_not_measured: str = "",
    ) -> None:
        if watts_per_busy_core <= 0:
            raise ValueError("watts_per_busy_core must be positive")
        self._pid = pid
        self._watts = watts_per_busy_core
        self._detail = f"{watts_per_busy_core:g} W per busy core" + (
            f"; {why_not_measured}" if why_not_measured else ""
        )
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
            detail=self._detail,
        )


class NvmlMeter:
    """Reads the GPU's energy counter (millijoules since driver load) before and after.

    Raises `pynvml.NVMLError` (a subclass per cause: `NVMLError_LibraryNotFound` without a
    driver, `NVMLError_NotSupported` on a GPU without the counter, pre-Volta) or ImportError
    (no `nvidia-ml-py`) when it cannot measure; the counter is read once here, so a meter
    that is built can measure."""

    def __init__(self, device_index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        self._wall_start = time.perf_counter()

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
            detail="the GPU's total energy counter",
        )


class EnergySourceUnavailable(RuntimeError):
    """The energy source that was asked for cannot measure here (the message says why)."""


ENERGY_SOURCES = ("auto", "nvml", "estimate")


def open_nvml(device_index: int = 0) -> tuple[NvmlMeter | None, str]:
    """An NVML meter, or None and why NVML cannot measure here, in words (NVML's own error
    and its class). Errors other than NVML's propagate: they are bugs, not a missing GPU."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed (pip install 'spotinfer[gpu]')"
    try:
        return NvmlMeter(device_index), ""
    except pynvml.NVMLError as exc:
        return None, f"NVML: {exc} ({type(exc).__name__})"


def meter_for(
    pid: int,
    watts_per_busy_core: float = DEFAULT_WATTS_PER_BUSY_CORE,
    source: str = "auto",
) -> EnergyMeter:
    """The meter ``source`` asks for: ``nvml`` (raises EnergySourceUnavailable, with NVML's
    own error, where it cannot measure), ``estimate`` (the CPU-time estimate), or ``auto``:
    NVML where a GPU, its driver and nvidia-ml-py are present, else the estimate — logged
    with the reason, never quietly. Any other error of NVML's is a bug and propagates."""
    if source not in ENERGY_SOURCES:
        raise ValueError(f"energy source must be one of {ENERGY_SOURCES}, got {source!r}")
    reason = "the estimate was asked for"
    if source != "estimate":
        meter, reason = open_nvml()
        if meter is not None:
            return meter
        if source == "nvml":
            raise EnergySourceUnavailable(f"energy source nvml asked for, but {reason}")
        log.info("energy per token is a CPU-time estimate: %s", reason)
    return CpuTimeEstimate(pid, watts_per_busy_core, reason)
