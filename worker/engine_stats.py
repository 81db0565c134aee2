"""What the engine reports about itself: running / waiting sequences, KV usage, tokens/s.

vLLM hands per-step statistics to stat loggers; `EngineStats.logger_factory()` plugs one in
that keeps the latest scheduler numbers and a sliding window of generated tokens, and hands
every step to an optional `StepObserver` (the worker's metrics).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from worker.constants import (
    LAYOUT_REJECTED_REQUEST_PREFIX,
    MAC_REJECTED_REQUEST_PREFIX,
    MAC_REJECTED_REQUESTS_KEPT,
    REJECTED_REQUEST_PREFIXES,
    THROUGHPUT_WINDOW_SECONDS,
)


@dataclass(frozen=True)
class EngineSnapshot:
    running_seqs: int
    waiting_seqs: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    tokens_per_second: float
    generated_tokens_total: int


@dataclass(frozen=True)
class StepRecord:
    """One engine step as vLLM's stat logger saw it."""

    batch_size: int  # requests the step ran (prefills + decodes); 0: not known for this step
    running_seqs: int
    waiting_seqs: int
    kv_cache_usage: float
    generated_tokens: int
    preempted_requests: int  # vLLM preemptions (KV ran out) reported with this step
    persisted: dict[str, int]  # the connector's writer, since its last report (persist_stats)


class StepObserver(Protocol):
    def on_step(self, step: StepRecord) -> None:
        """Called on vLLM's output path once per step; must not block."""


class _IterationLines(logging.Filter):
    """vLLM logs one INFO line per step once iteration details are on; we want the numbers,
    not the lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Iteration(" not in str(record.msg)


class EngineStats:
    """Thread-safe: vLLM may record from its output thread while gRPC reads."""

    def __init__(
        self,
        window_seconds: float = THROUGHPUT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        observer: StepObserver | None = None,
    ) -> None:
        self._observer = observer
        self._window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._waiting = 0
        self._kv_usage = 0.0
        self._generated_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        # Per refusal prefix (MAC, layout): request id → blocks its resume refused, until its
        # event takes them.
        self._rejected: dict[str, collections.OrderedDict[str, int]] = {
            prefix: collections.OrderedDict() for prefix in REJECTED_REQUEST_PREFIXES
        }

    def record_step(
        self, running: int, waiting: int, kv_usage: float, generated_tokens: int
    ) -> None:
        now = self._clock()
        with self._lock:
            self._running, self._waiting, self._kv_usage = running, waiting, kv_usage
            if generated_tokens:
                self._generated_total += generated_tokens
                self._recent.append((now, generated_tokens))
            self._trim(now)

    def snapshot(self) -> EngineSnapshot:
        now = self._clock()
        with self._lock:
            self._trim(now)
            tokens = sum(n for _, n in self._recent)
            span = (now - self._recent[0][0]) if self._recent else 0.0
            rate = tokens / max(span, 1e-3) if len(self._recent) > 1 else 0.0
            return EngineSnapshot(
                running_seqs=self._running,
                waiting_seqs=self._waiting,
                kv_cache_usage=self._kv_usage,
                tokens_per_second=rate,
                generated_tokens_total=self._generated_total,
            )

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self._window_seconds:
            self._recent.popleft()

    def observe(self, step: StepRecord) -> None:
        self.record_step(
            step.running_seqs, step.waiting_seqs, step.kv_cache_usage, step.generated_tokens
        )
        for prefix, kept in self._rejected.items():
            refused = rejections_by_request(step.persisted, prefix) if step.persisted else {}
            if not refused:
                continue
            with self._lock:
                for request_id, blocks in refused.items():
                    kept[request_id] = kept.get(request_id, 0) + blocks
                while len(kept) > MAC_REJECTED_REQUESTS_KEPT:
                    kept.popitem(last=False)
        if self._observer is not None:
            self._observer.on_step(step)

    def take_mac_rejected(self, request_id: str) -> int:
        """The blocks ``request_id``'s resume refused by their MAC (reported with the step
        that found them, which is at the latest the step of its first output); then 0."""
        with self._lock:
            return self._rejected[MAC_REJECTED_REQUEST_PREFIX].pop(request_id, 0)

    def take_layout_rejected(self, request_id: str) -> int:
        """The blocks ``request_id``'s resume refused because another KV layout wrote them
        (another tensor parallel degree, backend or dtype); then 0."""
        with self._lock:
            return self._rejected[LAYOUT_REJECTED_REQUEST_PREFIX].pop(request_id, 0)

    def logger_factory(self) -> Callable[..., Any]:
        """A vLLM stat-logger factory whose loggers feed this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        vllm_stat_log = logging.getLogger("vllm.v1.metrics.loggers")
        if not any(isinstance(f, _IterationLines) for f in vllm_stat_log.filters):
            vllm_stat_log.addFilter(_IterationLines())
        stats = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self._last_scheduler: Any = None

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    self._last_scheduler = scheduler_stats
                sched = self._last_scheduler
                stats.observe(
                    StepRecord(
                        batch_size=_batch_size(scheduler_stats),
                        running_seqs=sched.num_running_reqs if sched else 0,
                        waiting_seqs=sched.num_waiting_reqs if sched else 0,
                        kv_cache_usage=sched.kv_cache_usage if sched else 0.0,
                        generated_tokens=(
                            iteration_stats.num_generation_tokens if iteration_stats else 0
                        ),
                        preempted_requests=(
                            iteration_stats.num_preempted_reqs if iteration_stats else 0
                        ),
                        persisted=dict(
                            (scheduler_stats.kv_connector_stats or {}) if scheduler_stats else {}
                        ),
                    )
                )

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder


def rejections_by_request(
    data: dict[str, Any], prefix: str = MAC_REJECTED_REQUEST_PREFIX
) -> dict[str, int]:
    """The per-request refusals of one kind (``prefix``: MAC or layout) a connector report
    holds (request id → blocks)."""
    return {
        key[len(prefix) :]: int(value)
        for key, value in data.items()
        if key.startswith(prefix) and value
    }


def _batch_size(scheduler_stats: Any) -> int:
    """Requests the step ran: vLLM's iteration details (prefills + decodes scheduled) when the
    engine reports them, else the running count after the step (which leaves out requests
    that finished in it)."""
    if scheduler_stats is None:
        return 0
    details = getattr(scheduler_stats, "iteration_details", None)
    if details is not None:
        if details.is_dummy:
            return 0
        return int(details.num_ctx_requests + details.num_generation_requests)
    return int(scheduler_stats.num_running_reqs)
