"""The coordinator's Prometheus metrics, in a registry of their own (no global state), served
as text on the HTTP front's `/metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.requests import FinishReason, SlaClass
from coordinator.persist_policy import ClusterPersistence

# Decode steps of a small model on a CPU take milliseconds; a queued first token, seconds.
_TTFT_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
PREFIX = "spotinfer_coordinator_"


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "requests waiting for a worker slot", ["sla_class"], registry=r
        )
        self.queue_capacity = Gauge(
            PREFIX + "queue_capacity", "most requests that may wait", ["sla_class"], registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "requests_in_flight", "requests admitted and not finished", registry=r
        )
        self.requests = Counter(
            PREFIX + "requests", "finished requests", ["sla_class", "finish_reason"], registry=r
        )
        self.rejected = Counter(
            PREFIX + "rejected_requests", "requests refused at the edge", ["reason"], registry=r
        )
        self.tokens_relayed = Counter(
            PREFIX + "tokens_relayed", "output tokens delivered to clients' streams", registry=r
        )
        self.disconnect_cancels = Counter(
            PREFIX + "disconnect_cancels",
            "running requests cancelled because every client left and none came back",
            registry=r,
        )
        self.failovers = Counter(
            PREFIX + "failovers", "requests moved off an interrupted worker", ["kind"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "from admission to the first output token",
            ["sla_class"],
            buckets=_TTFT_BUCKETS_SECONDS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "mean time between output tokens after the first, per request",
            ["sla_class"],
            buckets=_TPOT_BUCKETS_SECONDS,
            registry=r,
        )
        self.workers = Gauge(
            PREFIX + "workers", "registered workers", ["role", "state"], registry=r
        )
        self.standbys_ready = Gauge(
            PREFIX + "standbys_ready", "warm standbys ready to be promoted", registry=r
        )
        self.admission_cap = Gauge(
            PREFIX + "admission_cap",
            "most requests of a class in flight on a worker (0: no class cap), as the batch "
            "controller last set it",
            ["worker", "sla_class"],
            registry=r,
        )
        self.cap_decisions = Counter(
            PREFIX + "batch_controller_decisions",
            "changes of a worker's admission cap by the batch controller",
            ["sla_class", "decision"],
            registry=r,
        )
        self.controller_ttft = Gauge(
            PREFIX + "batch_controller_ttft_p99_seconds",
            "INTERACTIVE TTFT p99 over the controller's window (or the oldest queued wait)",
            ["worker"],
            registry=r,
        )
        self.controller_tpot = Gauge(
            PREFIX + "batch_controller_tpot_seconds",
            "INTERACTIVE time per output token over the controller's window",
            ["worker"],
            registry=r,
        )
        self._add_persistence_metrics(r)
        for sla in SlaClass:
            self.queue_depth.labels(sla.name).set(0)
            self.ttft.labels(sla.name)
            self.tpot.labels(sla.name)

    def request_done(
        self,
        sla_class: SlaClass,
        reason: FinishReason,
        ttft_seconds: float | None,
        tpot_seconds: float | None,
    ) -> None:
        self.requests.labels(sla_class.name, reason.name).inc()
        if ttft_seconds is not None:
            self.ttft.labels(sla_class.name).observe(ttft_seconds)
        if tpot_seconds is not None:
            self.tpot.labels(sla_class.name).observe(tpot_seconds)

    def _add_persistence_metrics(self, r: CollectorRegistry) -> None:
        """The workers' KV persistence policies (see coordinator/persist_policy.py)."""
        self.kv_persist_policy_workers = Gauge(
            PREFIX + "kv_persist_policy_workers",
            "workers applying each KV persistence policy (eager | lazy | hybrid | off), as "
            "their Stats report it; one policy per cluster is the plan",
            ["policy"],
            registry=r,
        )
        self.kv_persist_policies_disagree = Gauge(
            PREFIX + "kv_persist_policies_disagree",
            "1 while the cluster's workers apply different KV persistence policies (or hybrid "
            "caps): see the coordinator's log or spotinfer status",
            registry=r,
        )

    def persistence(self, cluster: ClusterPersistence) -> None:
        """The workers' KV persistence policies, after a heartbeat round."""
        self.kv_persist_policy_workers.clear()
        for persistence, worker_ids in cluster.workers.items():
            self.kv_persist_policy_workers.labels(persistence.policy).inc(len(worker_ids))
        self.kv_persist_policies_disagree.set(1 if cluster.warning else 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
