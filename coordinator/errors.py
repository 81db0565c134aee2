"""Typed errors of the coordinator; each carries its gRPC and HTTP status (see
`common.errors`)."""

from __future__ import annotations

import grpc

from common.errors import InvalidRequest, RetryLater, ServiceError

__all__ = [
    "IndexOutOfRange",
    "InvalidRequest",
    "NoWorkerAvailable",
    "NoWorkerInTime",
    "NothingPersisted",
    "QueueFull",
    "RequestLost",
    "UnknownRequest",
    "UnknownWorker",
    "WorkerStreamBroken",
    "WorkerUnreachable",
]


class QueueFull(RetryLater, RuntimeError):
    """The request's SLA-class queue is full; RESOURCE_EXHAUSTED (HTTP 429) with a retry
    hint (see `common.errors.RetryLater`)."""

    def __init__(self, sla_class_name: str, capacity: int, retry_after_ms: int) -> None:
        super().__init__(f"the {sla_class_name} queue is full ({capacity} waiting)", retry_after_ms)


class NoWorkerInTime(RetryLater, RuntimeError):
    """A request that waited in its queue while no worker was ready (a capacity gap: every
    VM noticed, replacements booting) and got none within ``capacity_wait_seconds``;
    RESOURCE_EXHAUSTED (HTTP 429) with a retry hint. It never ran: its id is free again."""

    def __init__(self, waited_seconds: float, retry_after_ms: int) -> None:
        super().__init__(f"no worker became available within {waited_seconds:g} s", retry_after_ms)
        self.waited_seconds = waited_seconds


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
