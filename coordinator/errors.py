"""Typed errors of the coordinator; `spotinfer.rpc.status_for` maps each to one gRPC status
and `coordinator.http_front` to one HTTP status."""

from __future__ import annotations

from coordinator.constants import RETRY_AFTER_METADATA_KEY
from spotinfer.validation import InvalidRequest

__all__ = [
    "IndexOutOfRange",
    "InvalidRequest",
    "NoWorkerAvailable",
    "NothingPersisted",
    "QueueFull",
    "RequestLost",
    "UnknownRequest",
    "UnknownWorker",
    "WorkerStreamBroken",
]


class QueueFull(RuntimeError):
    """The request's SLA-class queue is full; maps to RESOURCE_EXHAUSTED (HTTP 429).

    The client is told when to try again, in the message and in the trailing metadata
    ``retry-after-ms`` (HTTP: ``Retry-After``).
    """

    def __init__(self, sla_class_name: str, capacity: int, retry_after_ms: int) -> None:
        super().__init__(
            f"the {sla_class_name} queue is full ({capacity} waiting); "
            f"retry after {retry_after_ms} ms"
        )
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_METADATA_KEY, str(self.retry_after_ms)),)


class NoWorkerAvailable(RuntimeError):
    """No worker is ready to take requests; maps to UNAVAILABLE (HTTP 503)."""


class UnknownRequest(KeyError):
    """No request with that id is running or retained here; maps to NOT_FOUND."""

    def __str__(self) -> str:
        return f"no request with id {self.args[0]!r} on this coordinator"


class UnknownWorker(KeyError):
    """No registered worker has that id; maps to NOT_FOUND."""

    def __str__(self) -> str:
        return f"no worker with id {self.args[0]!r} is registered"


class IndexOutOfRange(IndexError):
    """Attach from an index past the end of the output; maps to OUT_OF_RANGE."""


class WorkerStreamBroken(RuntimeError):
    """The worker's stream ended without a finish (connection lost, worker gone or cut).

    Never reaches a client: the relay hands it to its failover policy.
    """


class NothingPersisted(WorkerStreamBroken):
    """Worker.Resume found no record of the request in the store (NOT_FOUND): the lost worker
    never got it, or died before it wrote anything. Never reaches a client."""


class RequestLost(RuntimeError):
    """The failover policy could not continue a request whose worker broke; the client's
    stream ends with FinishReason.ERROR and this message in its event."""
