"""What every spotinfer gRPC server shares: health, reflection, and the one table
that maps our typed errors to gRPC status codes."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from spotinfer.validation import InvalidRequest

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a client sees for one of our errors (INTERNAL for anything else)."""
    # Imported here: the worker's errors live in the worker package, and this module must
    # not make every process import every other.
    from coordinator.errors import (
        IndexOutOfRange,
        NoWorkerAvailable,
        QueueFull,
        UnknownRequest,
        UnknownWorker,
    )
    from worker.errors import DuplicateRequest, EngineNotReady, RequestNotFound, WorkerDraining

    table: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoWorkerAvailable, grpc.StatusCode.UNAVAILABLE),
        (UnknownRequest, grpc.StatusCode.NOT_FOUND),
        (UnknownWorker, grpc.StatusCode.NOT_FOUND),
        (IndexOutOfRange, grpc.StatusCode.OUT_OF_RANGE),
        (RequestNotFound, grpc.StatusCode.NOT_FOUND),
        (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
        (EngineNotReady, grpc.StatusCode.UNAVAILABLE),
        (WorkerDraining, grpc.StatusCode.UNAVAILABLE),
    )
    for error_type, code in table:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends the call with the status that fits `exc`; unexpected errors are logged."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unexpected error in a call", exc_info=exc)
    # An error may carry hints for the client (QueueFull: retry-after-ms).
    hints = getattr(exc, "trailing_metadata", None)
    trailing = tuple(hints()) if callable(hints) else ()
    await context.abort(code, str(exc) or type(exc).__name__, trailing_metadata=trailing)


def add_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str]
) -> HealthServicer:
    """Registers grpc.health.v1 (all services NOT_SERVING until the caller says otherwise)
    and server reflection."""
    names = list(service_names)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    return health


async def set_serving(health: HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    status = SERVING if serving else NOT_SERVING
    for name in ["", *service_names]:
        await health.set(name, status)
