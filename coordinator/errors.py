"""Typed errors of the coordinator; each carries its gRPC and HTTP status (see
`common.errors`)."""

from __future__ import annotations

import math

import grpc

from common.errors import InvalidRequest, ServiceError
from coordinator.constants import RETRY_AFTER_METADATA_KEY

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
    "WorkerUnreachable",
]


class QueueFull(ServiceError, RuntimeError):
    """The request's SLA-class queue is full; maps to RESOURCE_EXHAUSTED (HTTP 429).

    The client is told when to try again, in the message and in the trailing metadata
    ``retry-after-ms`` (HTTP: ``Retry-After`` in whole seconds, and ``retry-after-ms``).
    """

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    http_type = "rate_limit_error"

    def __init__(self, sla_class_name: str, capacity: int, retry_after_ms: int) -> None:
        super().__init__(
            f"the {sla_class_name} queue is full ({capacity} waiting); "
            f"retry after {retry_after_ms} ms"
        )
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_METADATA_KEY, str(self.retry_after_ms)),)

    def http_headers(self) -> dict[str, str]:
        return {
            "Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000))),
            RETRY_AFTER_METADATA_KEY: str(self.retry_after_ms),
        }


class NoWorkerAvailable(ServiceError, RuntimeError):
    """No worker is ready to take requests; maps to UNAVAILABLE (HTTP 503)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    http_type = "service_unavailable"


class UnknownRequest(ServiceError, KeyError):
    """No request with that id is running or retained here; maps to NOT_FOUND (HTTP 404)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    http_type = "not_found_error"

    def __str__(self) -> str:
        return f"no request with id {self.args[0]!r} on this coordinator"


class UnknownWorker(ServiceError, KeyError):
    """No registered worker has that id; maps to NOT_FOUND (HTTP 404)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    http_type = "not_found_error"

    def __str__(self) -> str:
        return f"no worker with id {self.args[0]!r} is registered"


class WorkerUnreachable(ServiceError, RuntimeError):
    """A call the operator asked for (Drain) could not reach the worker; maps to UNAVAILABLE
    (HTTP 503)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    http_type = "service_unavailable"

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id!r} did not answer: {reason}")


class IndexOutOfRange(ServiceError, IndexError):
    """Attach from an index past the end of the output; maps to OUT_OF_RANGE (HTTP 416)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 416
    http_type = "invalid_request_error"


class WorkerStreamBroken(ServiceError, RuntimeError):
    """The worker's stream ended without a finish (connection lost, worker gone or cut).

    Never reaches a client: the relay hands it to its failover policy.
    """


class NothingPersisted(WorkerStreamBroken):
    """Worker.Resume found no record of the request in the store (NOT_FOUND): the lost worker
    never got it, or died before it wrote anything. Never reaches a client."""


class RequestLost(ServiceError, RuntimeError):
    """The failover policy could not continue a request whose worker broke; the client's
    stream ends with FinishReason.ERROR and this message in its event."""


class ModelMismatch(ServiceError, RuntimeError):
    """A worker that serves another model than the fleet's: refused at registration (its KV
    blocks and token ids would mean something else to every other worker)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    http_type = "conflict_error"

    def __init__(self, address: str, fingerprint: str, fleet_fingerprint: str, why: str) -> None:
        super().__init__(
            f"worker {address} serves model fingerprint {fingerprint or '(none)'}, "
            f"but this fleet's is {fleet_fingerprint} ({why}); start it with the fleet's "
            "model and dtype"
        )
        self.fingerprint = fingerprint
        self.fleet_fingerprint = fleet_fingerprint


class BatchApiUnavailable(ServiceError, RuntimeError):
    """The Batch API keeps its files and jobs in the store: without one (no --redis-url) it
    answers UNAVAILABLE (HTTP 503)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    http_type = "service_unavailable"


class UnknownBatchObject(ServiceError, KeyError):
    """No file or batch job with that id (for this tenant); NOT_FOUND (HTTP 404)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    http_type = "not_found_error"

    def __str__(self) -> str:
        return f"no {self.args[0]} with id {self.args[1]!r}"
