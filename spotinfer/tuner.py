"""The batch-size tuner: sweep max_num_seqs and request rates, pick a setting per SLA class.

For every workload batch size (max_num_seqs) a fresh worker is started; each request rate is
then driven through it with the load generator while its Stats are sampled (KV headroom,
running sequences) and its energy is metered. A class's choice is the batch size with the
most throughput among the points that meet the class's latency targets.

    batch size ─▶ 1   2   4   8   16  32  64
    throughput    ▁   ▂   ▄   ▆   ▇   ▇   ▇     rises, then flattens
    TPOT          ▁   ▁   ▂   ▂   ▃   ▅   ▇     rises
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.tuning_file import TUNING_FILE_VERSION
from spotinfer.loadgen import LoadSpec, LoadSummary, plan_requests, run_load, summarize
from worker.energy import EnergyMeter

STATS_SAMPLE_SECONDS = 0.2


@dataclass(frozen=True)
class SlaTargets:
    """Latency targets of one SLA class; inf means "no target"."""

    ttft_p99_ms: float = math.inf
    tpot_p99_ms: float = math.inf

    def __post_init__(self) -> None:
        if self.ttft_p99_ms <= 0 or self.tpot_p99_ms <= 0:
            raise ValueError("latency targets must be positive")

    def met_by(self, summary: LoadSummary) -> bool:
        return (
            summary.completed == summary.requests
            and summary.ttft_ms_p99 <= self.ttft_p99_ms
            and summary.tpot_ms_p99 <= self.tpot_p99_ms
        )


@dataclass(frozen=True)
class TuneConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    rates_per_second: tuple[float, ...] = (0.0, 4.0)  # 0: all requests at once
    min_requests_per_point: int = 16
    prompt_tokens: tuple[int, int] = (64, 128)
    output_tokens: tuple[int, int] = (48, 48)
    interactive: SlaTargets = field(default_factory=lambda: SlaTargets(2000.0, 150.0))
    batch: SlaTargets = field(default_factory=SlaTargets)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be positive")
        if not self.rates_per_second or min(self.rates_per_second) < 0:
            raise ValueError("rates must be >= 0")
        if self.min_requests_per_point < 1:
            raise ValueError("min_requests_per_point must be at least 1")

    def requests_for(self, batch_size: int) -> int:
        # Enough requests to fill the batch twice, so a point measures a full batch.
        return max(self.min_requests_per_point, 2 * batch_size)


@dataclass(frozen=True)
class SweepPoint:
    max_num_seqs: int
    rate_per_second: float
    summary: LoadSummary
    min_kv_free_fraction: float  # KV headroom at the fullest moment of the run
    max_running_seqs: int
    energy_joules_per_token: float
    energy_source: str
    energy_is_estimate: bool
    energy_detail: str = ""
    """How the energy was had (the estimate's watts per core and why NVML did not measure)."""


class WorkerHandle(Protocol):
    """What the tuner needs of a running worker."""

    address: str

    def stats(self) -> Any: ...

    def energy_meter(self) -> EnergyMeter: ...


WorkerLauncher = Callable[[int], AbstractContextManager[WorkerHandle]]


class Tuner:
    def __init__(
        self,
        config: TuneConfig,
        launch_worker: WorkerLauncher,
        vocab_high: int,
        on_point: Callable[[SweepPoint], None] | None = None,
    ) -> None:
        self._config = config
        self._launch_worker = launch_worker
        self._vocab_high = vocab_high
        self._on_point = on_point

    def run(self) -> list[SweepPoint]:
        points = []
        for batch_size in self._config.batch_sizes:
            with self._launch_worker(batch_size) as worker:
                for rate in self._config.rates_per_second:
                    point = self._measure(worker, batch_size, rate)
                    points.append(point)
                    if self._on_point is not None:
                        self._on_point(point)
        return points

    def _measure(self, worker: WorkerHandle, batch_size: int, rate: float) -> SweepPoint:
        spec = LoadSpec(
            num_requests=self._config.requests_for(batch_size),
            rate_per_second=rate,
            prompt_tokens=self._config.prompt_tokens,
            output_tokens=self._config.output_tokens,
            vocab_high=self._vocab_high,
            seed=self._config.seed,
        )
        planned = plan_requests(spec, prefix=f"tune-b{batch_size}-r{rate:g}")
        sampler = _StatsSampler(worker)
        meter = worker.energy_meter()
        meter.start()
        with sampler:
            traces = asyncio.run(run_load(worker.address, planned, service="worker"))
        energy = meter.stop()
        summary = summarize(traces)
        return SweepPoint(
            max_num_seqs=batch_size,
            rate_per_second=rate,
            summary=summary,
            min_kv_free_fraction=sampler.min_kv_free_fraction,
            max_running_seqs=sampler.max_running,
            energy_joules_per_token=energy.per_token(summary.output_tokens),
            energy_source=energy.source,
            energy_is_estimate=energy.is_estimate,
            energy_detail=energy.detail,
        )


class _StatsSampler:
    """Polls a worker's Stats in a thread while a run is under way."""

    def __init__(self, worker: WorkerHandle) -> None:
        self._worker = worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.min_kv_free_fraction = 1.0
        self.max_running = 0

    def _loop(self) -> None:
        while not self._stop.wait(STATS_SAMPLE_SECONDS):
            try:
                stats = self._worker.stats()
            except Exception:  # a sample lost to a busy worker is not worth failing a sweep
                continue
            if stats.kv_blocks_total:
                free = stats.kv_blocks_free / stats.kv_blocks_total
                self.min_kv_free_fraction = min(self.min_kv_free_fraction, free)
            self.max_running = max(self.max_running, stats.running_seqs)

    def __enter__(self) -> _StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class Choice:
    sla_class: str
    targets: SlaTargets
    point: SweepPoint | None  # None: no setting meets the targets
    reason: str


def recommend(points: list[SweepPoint], config: TuneConfig) -> list[Choice]:
    choices = []
    for name, targets in (("interactive", config.interactive), ("batch", config.batch)):
        meeting = [p for p in points if targets.met_by(p.summary)]
        if not meeting:
            choices.append(Choice(name, targets, None, "no swept setting meets the targets"))
            continue
        best = max(meeting, key=lambda p: (p.summary.tokens_per_second, -p.max_num_seqs))
        choices.append(
            Choice(
                name,
                targets,
                best,
                f"most throughput of {len(meeting)} point(s) meeting the targets",
            )
        )
    return choices


def result_json(points: list[SweepPoint], choices: list[Choice], model: str) -> dict[str, Any]:
    def targets(t: SlaTargets) -> dict[str, float | None]:
        return {
            "ttft_p99_ms": None if math.isinf(t.ttft_p99_ms) else t.ttft_p99_ms,
            "tpot_p99_ms": None if math.isinf(t.tpot_p99_ms) else t.tpot_p99_ms,
        }

    return {
        "model": model,
        "points": [asdict(p) for p in points],
        "choices": [
            {
                "sla_class": c.sla_class,
                "targets": targets(c.targets),
                "max_num_seqs": c.point.max_num_seqs if c.point else None,
                "rate_per_second": c.point.rate_per_second if c.point else None,
                "tokens_per_second": c.point.summary.tokens_per_second if c.point else None,
                "reason": c.reason,
            }
            for c in choices
        ],
    }


def tuning_file(choices: list[Choice], model: str) -> dict[str, Any]:
    """What `--apply` writes: per-class caps for the coordinator, max_num_seqs for workers."""
    classes = {
        c.sla_class: {"max_num_seqs": c.point.max_num_seqs} for c in choices if c.point is not None
    }
    chosen = [v["max_num_seqs"] for v in classes.values()]
    return {
        "version": TUNING_FILE_VERSION,
        "model": model,
        "worker": {"max_num_seqs": max(chosen)} if chosen else {},
        "classes": classes,
    }


def plot(points: list[SweepPoint], choices: list[Choice], out: Path, model: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({p.rate_per_second for p in points})
    fig, (ax_tput, ax_ttft, ax_tpot, ax_energy) = plt.subplots(1, 4, figsize=(20, 4.5))
    for rate in rates:
        series = sorted(
            (p for p in points if p.rate_per_second == rate), key=lambda p: p.max_num_seqs
        )
        label = "all at once" if rate == 0 else f"{rate:g} req/s"
        xs = [p.max_num_seqs for p in series]
        ax_tput.plot(xs, [p.summary.tokens_per_second for p in series], "o-", label=label)
        ax_ttft.plot(xs, [p.summary.ttft_ms_p99 for p in series], "o-", label=label)
        ax_tpot.plot(xs, [p.summary.tpot_ms_p99 for p in series], "o-", label=label)
        ax_energy.plot(xs, [p.energy_joules_per_token for p in series], "o-", label=label)
    for choice in choices:
        if not math.isinf(choice.targets.ttft_p99_ms):
            ax_ttft.axhline(
                choice.targets.ttft_p99_ms, ls="--", c="r", label=f"{choice.sla_class} SLA"
            )
        if not math.isinf(choice.targets.tpot_p99_ms):
            ax_tpot.axhline(
                choice.targets.tpot_p99_ms, ls="--", c="r", label=f"{choice.sla_class} SLA"
            )
        if choice.point is not None:
            ax_tput.axvline(choice.point.max_num_seqs, ls=":", c="g")
            ax_tput.annotate(
                f"{choice.sla_class}: {choice.point.max_num_seqs}",
                (choice.point.max_num_seqs, choice.point.summary.tokens_per_second),
            )
    for ax, title in (
        (ax_tput, "throughput (tokens/s)"),
        (ax_ttft, "TTFT p99 (ms)"),
        (ax_tpot, "TPOT p99 (ms)"),
        (ax_energy, f"energy per token, J ({energy_label(points)})"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_seqs (workload batch size)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"spotinfer tune: {Path(model).name}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def energy_label(points: list[SweepPoint]) -> str:
    """What the energy figures are: ``nvml`` (measured), ``CPU-time estimate``, or ``mixed``."""
    estimated = {p.energy_is_estimate for p in points}
    if estimated == {False}:
        return "nvml"
    if estimated == {True}:
        return "CPU-time estimate"
    return "mixed: nvml and CPU-time estimate"


def iter_rows(points: list[SweepPoint]) -> Iterator[list[str]]:
    for p in points:
        s = p.summary
        energy = f"{p.energy_joules_per_token:.3f}" + (" (est.)" if p.energy_is_estimate else "")
        yield [
            str(p.max_num_seqs),
            "burst" if p.rate_per_second == 0 else f"{p.rate_per_second:g}",
            f"{s.completed}/{s.requests}",
            f"{s.tokens_per_second:.1f}",
            f"{s.ttft_ms_p50:.0f} / {s.ttft_ms_p99:.0f}",
            f"{s.tpot_ms_p50:.1f} / {s.tpot_ms_p99:.1f}",
            f"{p.min_kv_free_fraction:.0%}",
            energy,
        ]
