"""The worker's Prometheus metrics, in a registry of their own, served as text on
`--metrics-port` (prometheus_client's HTTP server, on a thread).

Where each number comes from::

    vLLM stat logger, once per step ──on_step──▶ batch size (histogram), generated tokens,
                                                 vLLM preemptions, KV bytes persisted, KV
                                                 blocks hybrid's rate cap held back
    the config, at start ──describe_persistence▶ KV persistence policy and rate cap
    gRPC edge, per request ──RequestTimer──────▶ TTFT / TPOT (histograms), finished requests,
                                                 resumes and recomputed tokens, notices
    token committer thread ──observe_commit────▶ commit round-trip latency (histogram)
    at scrape time ──status()──────────────────▶ running / waiting, KV blocks, tokens/s,
                                                 energy (meter reading / generated tokens)

Energy per token carries its source as a label: ``nvml`` is the GPU's energy counter, a
measurement; ``cpu-time-estimate`` is the model documented in `worker.energy` (CPU seconds
of the worker's process tree × watts per busy core), an estimate, and its help text says so.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.messages import KvPersistence
from common.requests import EventKind, FinishReason, SlaClass, TokenChunk
from worker.energy import EnergyMeter, meter_for
from worker.engine_stats import StepRecord

PREFIX = "spotinfer_worker_"

# The workload batch: a power of two per bucket, up to well past vLLM's usual max_num_seqs.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A small model's decode step on a CPU takes milliseconds; a first token behind a queue, seconds.
TTFT_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
COMMIT_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)

# Keys of the connector's reports (worker/persist_stats.py; not imported: it needs vLLM).
_PERSIST_WRITTEN_BLOCKS = "written_blocks"
_PERSIST_WRITTEN_BYTES = "written_bytes"
_PERSIST_DROPPED_BLOCKS = "dropped_blocks"
_PERSIST_MAC_REJECTED_BLOCKS = "mac_rejected_blocks"
_PERSIST_DEFERRED_BLOCKS = "deferred_blocks"
_LOADED_BY_SOURCE = {
    "staging": "loaded_staged_blocks",
    "store": "loaded_store_blocks",
    "prefix_cache": "cached_blocks",
}


@dataclass(frozen=True)
class LiveNumbers:
    """What the engine holds right now (read at scrape time)."""

    running_seqs: int
    waiting_seqs: int
    kv_blocks_total: int  # 0 while the engine loads
    kv_cache_usage: float  # fraction of the blocks in use
    tokens_per_second: float
    generated_tokens_total: int


class LiveSource(Protocol):
    def __call__(self) -> LiveNumbers: ...


class WorkerMetrics:
    """Thread-safe (prometheus_client's metrics are). ``energy_meter`` defaults to NVML where
    a GPU is present, else the CPU-time estimate of this process and its children."""

    def __init__(self, energy_meter: EnergyMeter | None = None) -> None:
        self.registry = CollectorRegistry()
        self._add_engine_metrics(self.registry)
        self._add_request_metrics(self.registry)
        self._live = _LiveCollector(energy_meter or meter_for(os.getpid()))
        self.registry.register(self._live)
        self._server: Any = None

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        """What engine steps and token commits feed: batches, tokens, preemptions, KV
        persisted and loaded, commit latency."""
        self.batch_size = Histogram(
            PREFIX + "batch_size",
            "requests run per engine step (the workload batch: prefills + decodes)",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            PREFIX + "generated_tokens", "output tokens the engine generated", registry=r
        )
        self.vllm_preemptions = Counter(
            PREFIX + "vllm_preemptions",
            "requests vLLM preempted because KV blocks ran out (recomputed later)",
            registry=r,
        )
        self.kv_persisted_bytes = Counter(
            PREFIX + "kv_persisted_bytes",
            "KV block payload bytes Redis confirmed (reported by the engine core each step)",
            registry=r,
        )
        self.kv_persisted_blocks = Counter(
            PREFIX + "kv_persisted_blocks", "KV blocks Redis confirmed", registry=r
        )
        self.kv_dropped_blocks = Counter(
            PREFIX + "kv_dropped_blocks",
            "KV block writes given up (queue full or Redis away): recomputed if resumed",
            registry=r,
        )
        self.kv_deferred_blocks = Counter(
            PREFIX + "kv_deferred_blocks",
            "full KV blocks the hybrid policy's rate cap held back in the step they filled "
            "(saved later as the cap allows, or at a notice; an abrupt loss meanwhile "
            "recomputes them)",
            registry=r,
        )
        self.kv_persist_policy = Gauge(
            PREFIX + "kv_persist_policy",
            "1 for the KV persistence policy this worker applies (eager | lazy | hybrid | "
            "off; off without a store)",
            ["policy"],
            registry=r,
        )
        self.kv_persist_rate_cap = Gauge(
            PREFIX + "kv_persist_rate_cap_bytes_per_second",
            "hybrid: most bytes per second of KV blocks written to Redis as they fill "
            "(0: no cap, under the other policies)",
            registry=r,
        )
        self.kv_mac_rejected_blocks = Counter(
            PREFIX + "kv_mac_rejected_blocks",
            "stored KV blocks a resume refused because their MAC did not verify (planted or "
            "altered in Redis): dropped and recomputed, never used",
            registry=r,
        )
        self.kv_loaded_blocks = Counter(
            PREFIX + "kv_loaded_blocks",
            "KV blocks a resume had without computing them, by where they came from (staging: "
            "prefetched by a migration before the pause; store: read from Redis; prefix_cache: "
            "already in vLLM's cache, loaded there from staging before the pause)",
            ["source"],
            registry=r,
        )
        self.commit_latency = Histogram(
            PREFIX + "token_commit_seconds",
            "round trip of one pipelined token commit to Redis (all requests of a step)",
            buckets=COMMIT_BUCKETS_SECONDS,
            registry=r,
        )

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """What the gRPC edge feeds per request: latencies, ends, notices and resumes."""
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "from the worker accepting a request to its first output token",
            ["path"],
            buckets=TTFT_BUCKETS_SECONDS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "mean time between output tokens after the first, per request",
            ["path"],
            buckets=TPOT_BUCKETS_SECONDS,
            registry=r,
        )
        self.requests = Counter(
            PREFIX + "requests", "requests that ended here", ["path", "finish_reason"], registry=r
        )
        self.engine_queue = Histogram(
            PREFIX + "engine_queue_seconds",
            "from vLLM queueing a request to scheduling it first (vLLM's own request stats), "
            "per SLA class: under priority scheduling INTERACTIVE never waits behind BATCH",
            ["sla_class"],
            buckets=TTFT_BUCKETS_SECONDS,
            registry=r,
        )
        self.preempt_notices = Counter(
            PREFIX + "preempt_notices",
            "termination notices (Preempt calls): every request paused and persisted",
            registry=r,
        )
        self.paused_requests = Counter(
            PREFIX + "paused_requests", "requests paused by a notice", registry=r
        )
        self.resumed_requests = Counter(
            PREFIX + "resumed_requests",
            "requests continued here from the store (migrated: paused on a notice; recovered: "
            "after an abrupt loss)",
            ["kind"],
            registry=r,
        )
        self.recomputed_tokens = Counter(
            PREFIX + "recomputed_tokens",
            "context tokens a resume had to compute again (their KV was not in the store)",
            registry=r,
        )
        self.loaded_tokens = Counter(
            PREFIX + "loaded_tokens", "context tokens a resume loaded from the store", registry=r
        )
        for sla in SlaClass:
            self.engine_queue.labels(sla.name)
        for path in ("generate", "resume"):
            self.ttft.labels(path)
            self.tpot.labels(path)
        for kind in ("migrated", "recovered"):
            self.resumed_requests.labels(kind)

    # -- feeds -----------------------------------------------------------------------------

    def describe_persistence(self, persistence: KvPersistence) -> None:
        """The policy and cap the worker runs with (set once, at start)."""
        self.kv_persist_policy.clear()
        self.kv_persist_policy.labels(persistence.policy).set(1)
        self.kv_persist_rate_cap.set(persistence.rate_cap_bytes_per_second)

    def read_live_from(self, source: LiveSource) -> None:
        """Where scrape-time gauges come from (the engine, once it exists)."""
        self._live.source = source

    def on_step(self, step: StepRecord) -> None:
        if step.batch_size:
            self.batch_size.observe(step.batch_size)
        if step.generated_tokens:
            self.generated_tokens.inc(step.generated_tokens)
        if step.preempted_requests:
            self.vllm_preemptions.inc(step.preempted_requests)
        persisted = step.persisted
        if persisted:
            self.kv_persisted_bytes.inc(int(persisted.get(_PERSIST_WRITTEN_BYTES, 0)))
            self.kv_persisted_blocks.inc(int(persisted.get(_PERSIST_WRITTEN_BLOCKS, 0)))
            self.kv_dropped_blocks.inc(int(persisted.get(_PERSIST_DROPPED_BLOCKS, 0)))
            self.kv_deferred_blocks.inc(int(persisted.get(_PERSIST_DEFERRED_BLOCKS, 0)))
            self.kv_mac_rejected_blocks.inc(int(persisted.get(_PERSIST_MAC_REJECTED_BLOCKS, 0)))
            for source, key in _LOADED_BY_SOURCE.items():
                self.kv_loaded_blocks.labels(source).inc(int(persisted.get(key, 0)))

    def observe_commit(self, seconds: float) -> None:
        self.commit_latency.observe(seconds)

    def request_timer(self, path: str, clock: Callable[[], float] = time.monotonic) -> RequestTimer:
        return RequestTimer(self, path, clock)

    def preempted(self, paused_requests: int) -> None:
        self.preempt_notices.inc()
        self.paused_requests.inc(paused_requests)

    # -- serving ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics on a thread; `stop()` ends it."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RequestTimer:
    """Watches one request's stream at the gRPC edge; `finish()` exactly once at its end."""

    def __init__(self, metrics: WorkerMetrics, path: str, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._path = path
        self._clock = clock
        self._started = clock()
        self._first_token: float | None = None
        self._last_token = 0.0
        self._tokens = 0
        self._finish = FinishReason.NONE
        self.sla_class = SlaClass.INTERACTIVE
        """The request's class, once the edge has read it (labels the engine queue time)."""

    def see(self, chunk: TokenChunk) -> None:
        if chunk.engine_timing is not None:
            self._metrics.engine_queue.labels(self.sla_class.name).observe(
                chunk.engine_timing.queue_seconds
            )
        if chunk.token_ids:
            now = self._clock()
            if self._first_token is None:
                self._first_token = now
            self._last_token = now
            self._tokens += len(chunk.token_ids)
        if chunk.finish_reason != FinishReason.NONE:
            self._finish = chunk.finish_reason
        event = chunk.event
        if event is not None and event.kind in (EventKind.MIGRATED, EventKind.RECOVERED):
            self._metrics.resumed_requests.labels(event.kind.name.lower()).inc()
            self._metrics.recomputed_tokens.inc(event.recomputed_tokens)
            self._metrics.loaded_tokens.inc(event.loaded_tokens)

    def finish(self) -> None:
        labels = self._metrics.requests.labels(self._path, self._finish.name.lower())
        labels.inc()
        if self._first_token is None:
            return
        self._metrics.ttft.labels(self._path).observe(self._first_token - self._started)
        if self._tokens > 1:
            self._metrics.tpot.labels(self._path).observe(
                (self._last_token - self._first_token) / (self._tokens - 1)
            )


class _LiveCollector(Collector):
    """Gauges read at scrape time: the engine's present state and the energy meter."""

    def __init__(self, meter: EnergyMeter) -> None:
        self.source: LiveSource | None = None
        self._meter = meter
        self._lock = threading.Lock()  # scrapes may overlap; the meter is not thread-safe
        meter.start()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names vary with the meter's source label; not checked at register

    def collect(self) -> Iterator[Metric]:
        live = self.source() if self.source is not None else None
        if live is not None:
            yield _gauge("running_seqs", "sequences in the running batch", live.running_seqs)
            yield _gauge("waiting_seqs", "sequences waiting in vLLM's queue", live.waiting_seqs)
            yield _gauge(
                "tokens_per_second",
                "generated tokens per second over the last few seconds",
                live.tokens_per_second,
            )
            if live.kv_blocks_total:
                used = round(live.kv_cache_usage * live.kv_blocks_total)
                free = live.kv_blocks_total - used
                yield _gauge("kv_blocks_total", "KV cache blocks", live.kv_blocks_total)
                yield _gauge("kv_blocks_used", "KV cache blocks in use", used)
                yield _gauge("kv_blocks_free", "KV cache blocks free", free)
                yield _gauge(
                    "kv_headroom_ratio",
                    "free KV blocks / all KV blocks (0: the next block needs a preemption)",
                    free / live.kv_blocks_total,
                )
        with self._lock:
            reading = self._meter.stop()  # joules since start(); the meter keeps running
        source = reading.source
        kind = "estimate" if reading.is_estimate else "measurement"
        joules = CounterMetricFamily(
            PREFIX + "energy_joules",
            f"energy since the worker started ({kind}; source {source}, see worker.energy)",
            labels=["source"],
        )
        joules.add_metric([source], reading.joules)
        yield joules
        tokens = live.generated_tokens_total if live is not None else 0
        if tokens:
            per_token = GaugeMetricFamily(
                PREFIX + "energy_per_token_joules",
                f"energy / generated tokens since the worker started ({kind}; source {source})",
                labels=["source"],
            )
            per_token.add_metric([source], reading.joules / tokens)
            yield per_token


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)
