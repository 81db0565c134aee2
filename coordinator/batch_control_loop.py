"""The batch controller at work inside the coordinator: its periodic round over the routable
workers (an asyncio task that logs and survives any error), its decisions as Prometheus
metrics, and each worker's caps as `spotinfer status` shows them (with the controller off:
the static caps)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from common.messages import ClassCapView
from common.requests import SlaClass
from coordinator.admission import Admission
from coordinator.batch_controller import BatchController, Decision
from coordinator.metrics import CoordinatorMetrics
from coordinator.registry import Registry, WorkerEntry

log = logging.getLogger(__name__)


class BatchControlLoop:
    """Runs ``controller`` every interval once `start`ed; ``controller`` None: the static caps
    (`views` still tells them)."""

    def __init__(
        self,
        controller: BatchController | None,
        interval_seconds: float,
        registry: Registry,
        admission: Admission,
        metrics: CoordinatorMetrics,
    ) -> None:
        self.controller = controller
        self._interval = interval_seconds
        self._registry = registry
        self._admission = admission
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.controller is not None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-control")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def round(self) -> list[Decision]:
        """One round of the controller over the routable workers, metrics updated."""
        assert self.controller is not None
        workers = self._registry.routable()
        decisions = self.controller.tick(
            workers,
            {sla: self._admission.depth(sla) for sla in SlaClass},
            self._admission.oldest_wait_seconds(SlaClass.INTERACTIVE),
        )
        for decision in decisions:
            self._metrics.cap_decisions.labels(decision.sla_class.name, decision.decision).inc()
            log.info(
                "batch controller: %s %s cap %d -> %d on %s (%s)",
                decision.decision,
                decision.sla_class.name,
                decision.old_cap,
                decision.new_cap,
                decision.address,
                decision.reason,
            )
        for entry in workers:
            self._export(entry)
        return decisions

    def views(self, entry: WorkerEntry) -> list[ClassCapView]:
        """The entry's cap per class, with the controller's decision and what it measured."""
        if self.controller is None:
            return [
                ClassCapView(
                    int(sla), self._admission.class_cap(entry, sla), "static", "the static cap"
                )
                for sla in SlaClass
            ]
        signals = self.controller.signals_of(entry)
        return [
            ClassCapView(
                sla_class=int(sla),
                cap=state.cap,
                decision=state.decision,
                reason=state.reason,
                ttft_p99_seconds=signals.ttft_p99 or 0.0,
                tpot_seconds=signals.tpot or 0.0,
                samples=signals.samples,
            )
            for sla, state in self.controller.caps_of(entry).items()
        ]

    def _export(self, entry: WorkerEntry) -> None:
        assert self.controller is not None
        for sla, state in self.controller.caps_of(entry).items():
            self._metrics.admission_cap.labels(entry.worker_id, sla.name).set(state.cap)
        signals = self.controller.signals_of(entry)
        self._metrics.controller_ttft.labels(entry.worker_id).set(signals.ttft_p99 or 0.0)
        self._metrics.controller_tpot.labels(entry.worker_id).set(signals.tpot or 0.0)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.round()
            except Exception:  # the control loop must outlive any one bad round
                log.exception("batch controller round failed; the caps stay as they are")
