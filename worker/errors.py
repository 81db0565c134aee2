"""Typed errors of the worker; `worker/server.py` maps each to one gRPC status."""

from spotinfer.validation import InvalidRequest

__all__ = [
    "CannotResume",
    "DuplicateRequest",
    "EngineNotReady",
    "InvalidRequest",
    "RecordNotFound",
    "RequestNotFound",
    "WorkerDraining",
]


class EngineNotReady(RuntimeError):
    """The engine is still loading (or failed to load); maps to UNAVAILABLE."""


class WorkerDraining(RuntimeError):
    """The worker stopped admitting requests; maps to UNAVAILABLE."""


class RequestNotFound(KeyError):
    """No in-flight request has that id; maps to NOT_FOUND."""

    def __str__(self) -> str:
        return f"no request with id {self.args[0]!r} on this worker"


class DuplicateRequest(RuntimeError):
    """A request with that id is already running here; maps to ALREADY_EXISTS."""


class RecordNotFound(RequestNotFound):
    """Resume: the store holds no record for that id (never seen, finished and deleted, or
    expired); maps to NOT_FOUND."""

    def __str__(self) -> str:
        return f"no persisted state for request {self.args[0]!r}"


class CannotResume(RuntimeError):
    """Resume is refused for a reason the caller must fix first (the request already ended,
    another model wrote it, or this worker has no store); maps to FAILED_PRECONDITION."""
