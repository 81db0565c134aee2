"""Energy per token: NVML through nvidia-ml-py where it can measure, else a labelled estimate.

The error paths are the library's own: pynvml raises `NVMLError_LibraryNotFound` from its
loader when the driver's libnvidia-ml is absent (as on this CPU machine), and
`NVMLError_NotSupported` from its return-code check when a GPU lacks the energy counter.
No GPU is needed for any of it.
"""

from __future__ import annotations

import ctypes.util
import os
from typing import Any

import pynvml
import pytest

from common.errors import UserError
from spotinfer.commands.tune import _check_energy_source
from spotinfer.tuner import SweepPoint, energy_label, iter_rows
from worker.energy import (
    CpuTimeEstimate,
    EnergySourceUnavailable,
    NvmlMeter,
    meter_for,
    open_nvml,
)


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a host without the NVIDIA driver looks like to pynvml: loading libnvidia-ml.so.1
    fails in the dynamic loader (OSError), and pynvml's own loader turns that into its
    error. Real on this machine; patched at the loader so that it is also true on a GPU host."""
    monkeypatch.setattr(pynvml, "nvmlLib", None)

    def no_library(name: str, *args: Any, **kwargs: Any) -> Any:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(pynvml, "CDLL", no_library)


@pytest.fixture
def gpu_without_energy_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML initialises and finds the GPU, but the driver answers NOT_SUPPORTED for the
    energy counter (GPUs before Volta), through pynvml's own return-code check."""
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())

    def not_supported(handle: object) -> int:
        pynvml._nvmlCheckReturn(pynvml.NVML_ERROR_NOT_SUPPORTED)
        raise AssertionError("pynvml's check raises for NOT_SUPPORTED")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEnergyConsumption", not_supported)


def test_this_machine_has_no_driver_and_nvml_says_so() -> None:
    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("an NVIDIA driver is installed here; the `no_driver` tests cover the path")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        NvmlMeter()
    meter, reason = open_nvml()
    assert meter is None
    assert "NVMLError_LibraryNotFound" in reason


def test_without_a_driver_auto_falls_back_to_a_labelled_estimate(no_driver: None) -> None:
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        NvmlMeter()
    meter = meter_for(os.getpid(), 4.0, "auto")
    assert isinstance(meter, CpuTimeEstimate)
    meter.start()
    sum(i * i for i in range(200_000))  # some CPU time to estimate
    reading = meter.stop()
    assert reading.is_estimate and reading.source == "cpu-time-estimate"
    assert "4 W per busy core" in reading.detail
    assert "NVML Shared Library Not Found (NVMLError_LibraryNotFound)" in reading.detail


def test_without_a_driver_nvml_asked_for_is_an_error(no_driver: None) -> None:
    with pytest.raises(EnergySourceUnavailable, match="NVMLError_LibraryNotFound"):
        meter_for(os.getpid(), source="nvml")
    with pytest.raises(UserError, match="--energy-source nvml: NVML: NVML Shared Library"):
        _check_energy_source("nvml")
    _check_energy_source("auto")  # auto and estimate never stop a sweep


def test_a_gpu_without_the_energy_counter_falls_back(gpu_without_energy_counter: None) -> None:
    with pytest.raises(pynvml.NVMLError_NotSupported):
        NvmlMeter()
    meter = meter_for(os.getpid(), source="auto")
    assert isinstance(meter, CpuTimeEstimate)
    meter.start()
    assert "NVMLError_NotSupported" in meter.stop().detail
    with pytest.raises(EnergySourceUnavailable, match="NVMLError_NotSupported"):
        meter_for(os.getpid(), source="nvml")


def test_an_error_that_is_not_nvmls_is_not_taken_for_a_missing_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> None:
        raise RuntimeError("a bug, not a missing driver")

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        meter_for(os.getpid(), source="auto")


def test_the_nvml_meter_reads_the_energy_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = iter([1_000, 1_000, 6_000])  # millijoules: probe, start, stop
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEnergyConsumption", lambda h: next(counter))
    meter = meter_for(os.getpid(), source="nvml")
    meter.start()
    reading = meter.stop()
    assert (reading.joules, reading.source, reading.is_estimate) == (5.0, "nvml", False)
    assert reading.per_token(1000) == pytest.approx(0.005)


def _point(estimate: bool) -> SweepPoint:
    from spotinfer.loadgen import summarize

    return SweepPoint(
        max_num_seqs=4,
        rate_per_second=0.0,
        summary=summarize([]),
        min_kv_free_fraction=1.0,
        max_running_seqs=4,
        energy_joules_per_token=0.05,
        energy_source="cpu-time-estimate" if estimate else "nvml",
        energy_is_estimate=estimate,
    )


def test_the_tuners_energy_column_says_whether_it_is_an_estimate() -> None:
    assert energy_label([_point(True), _point(True)]) == "CPU-time estimate"
    assert energy_label([_point(False)]) == "nvml"
    assert energy_label([_point(False), _point(True)]).startswith("mixed")
    assert next(iter_rows([_point(True)]))[-1] == "0.050 (est.)"
    assert next(iter_rows([_point(False)]))[-1] == "0.050"
