"""What the engine reports about itself: running / waiting sequences, KV usage, tokens/s.

vLLM hands per-step statistics to stat loggers; `EngineStats.logger_factory()` plugs one in
that keeps the latest scheduler numbers and a sliding window of generated tokens.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.constants import THROUGHPUT_WINDOW_SECONDS


@dataclass(frozen=True)
class EngineSnapshot:
    running_seqs: int
    waiting_seqs: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    tokens_per_second: float
    generated_tokens_total: int


class EngineStats:
    """Thread-safe: vLLM may record from its output thread while gRPC reads."""

    def __init__(
        self,
        window_seconds: float = THROUGHPUT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._waiting = 0
        self._kv_usage = 0.0
        self._generated_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

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

    def logger_factory(self) -> Callable[..., Any]:
        """A vLLM stat-logger factory whose loggers feed this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

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
                stats.record_step(
                    running=sched.num_running_reqs if sched else 0,
                    waiting=sched.num_waiting_reqs if sched else 0,
                    kv_usage=sched.kv_cache_usage if sched else 0.0,
                    generated_tokens=(
                        iteration_stats.num_generation_tokens if iteration_stats else 0
                    ),
                )

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder
