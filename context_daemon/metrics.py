"""The context daemon's Prometheus metrics, in a registry of their own, served as text on
`--metrics-port` (prometheus_client's HTTP server, on a thread).

Notices and flush reports arrive through the daemon's `NotificationHook` (this class is one);
the flush count, the last deadline and the store's availability are read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.messages import FlushReport
from context_daemon.daemon import DaemonState, NotificationHook
from context_daemon.notices import Notice

PREFIX = "spotinfer_daemon_"


class DaemonMetrics(NotificationHook):
    """``grace_seconds``: the deadline of a notice that carries none; ``store_available``: a
    blocking probe, run on the scraping thread (None: the daemon has no store). ``clock``:
    unix seconds. The daemon's state is read at scrape time, once `read_state_from` named it
    (the daemon is built with this hook, so it exists only after it)."""

    def __init__(
        self,
        grace_seconds: float,
        store_available: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.notices = Counter(
            PREFIX + "notices", "notices received", ["source", "action"], registry=r
        )
        self.flushed_requests = Counter(
            PREFIX + "flushed_requests",
            "requests the worker reported after a flush: complete in the store, or not by the "
            "deadline",
            ["outcome"],
            registry=r,
        )
        for outcome in ("complete", "incomplete"):
            self.flushed_requests.labels(outcome)
        self._state = _StateCollector(grace_seconds, store_available, clock)
        r.register(self._state)
        self._server: Any = None

    def read_state_from(self, state: DaemonState) -> None:
        self._state.state = state

    # -- NotificationHook ------------------------------------------------------------------

    def notice(self, notice: Notice) -> None:
        self.notices.labels(notice.source, notice.action.value).inc()

    def progress(self, notice: Notice, report: FlushReport) -> None:
        self.flushed_requests.labels("complete" if report.complete else "incomplete").inc()

    # -- serving ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> None:
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _StateCollector(Collector):
    def __init__(
        self,
        grace_seconds: float,
        store_available: Callable[[], bool] | None,
        clock: Callable[[], float],
    ) -> None:
        self.state: DaemonState | None = None
        self._grace_seconds = grace_seconds
        self._store_available = store_available
        self._clock = clock

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        state = self.state or DaemonState()
        flushes = CounterMetricFamily(
            PREFIX + "flushes", "flushes run (one per notice that ends the VM, or Flush call)"
        )
        flushes.add_metric([], state.flushes)
        yield flushes
        notice = state.last_notice
        if notice is not None:
            deadline = notice.deadline_unix or notice.received_unix + self._grace_seconds
            yield GaugeMetricFamily(
                PREFIX + "deadline_seconds_left",
                "seconds until the last notice's deadline (0 once it passed)",
                value=max(0.0, deadline - self._clock()),
            )
        if self._store_available is not None:
            yield GaugeMetricFamily(
                PREFIX + "store_available",
                "1 while Redis answers, 0 while it does not",
                value=1.0 if self._store_available() else 0.0,
            )
