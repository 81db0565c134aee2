"""Typed errors of the worker; each carries its gRPC and HTTP status (see `common.errors`)."""

import grpc

from common.errors import InvalidRequest, ServiceError

__all__ = [
    "CannotResume",
    "DuplicateRequest",
    "EngineNotReady",
    "InvalidRequest",
    "RecordNotFound",
    "RequestNotFound",
    "WorkerDraining",
]


class EngineNotReady(ServiceError, RuntimeError):
    """The engine is still loading (or failed to load); maps to UNAVAILABLE."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    http_type = "service_unavailable"


class WorkerDraining(ServiceError, RuntimeError):
    """The worker stopped admitting requests; maps to UNAVAILABLE."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    http_type = "service_unavailable"


class RequestNotFound(ServiceError, KeyError):
    """No in-flight request has that id; maps to NOT_FOUND."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    http_type = "not_found_error"

    def __str__(self) -> str:
        return f"no request with id {self.args[0]!r} on this worker"


class DuplicateRequest(ServiceError, RuntimeError):
    """A request with that id is already running here; maps to ALREADY_EXISTS."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409
    http_type = "invalid_request_error"


class RecordNotFound(RequestNotFound):
    """Resume: the store holds no record for that id (never seen, finished and deleted, or
    expired); maps to NOT_FOUND."""

    def __str__(self) -> str:
        return f"no persisted state for request {self.args[0]!r}"


class CannotResume(ServiceError, RuntimeError):
    """Resume is refused for a reason the caller must fix first (the request already ended,
    another model wrote it, or this worker has no store); maps to FAILED_PRECONDITION."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    http_type = "invalid_request_error"
