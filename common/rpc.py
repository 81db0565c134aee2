"""What every spotinfer gRPC server shares: health, reflection, and the one wrapper that
turns our typed errors into gRPC statuses (see `common.errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from common.errors import ServiceError, is_unexpected

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

Method = TypeVar("Method", bound=Callable[..., Any])


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends the call with the status `exc` carries; unexpected errors are logged."""
    if is_unexpected(exc):
        log.exception("unexpected error in a call", exc_info=exc)
    code = exc.grpc_code if isinstance(exc, ServiceError) else grpc.StatusCode.INTERNAL
    trailing = exc.trailing_metadata() if isinstance(exc, ServiceError) else ()
    await context.abort(code, str(exc) or type(exc).__name__, trailing_metadata=trailing)


def maps_errors(method: Method) -> Method:
    """Wraps one servicer method (unary or server-streaming): any error it raises ends the
    call through `abort_with`. Cancellation, and an abort the method made itself, pass."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                items: AsyncIterator[Any] = method(self, request, context)
                async with contextlib.aclosing(items) as opened:  # type: ignore[type-var]
                    async for item in opened:
                        yield item
            except (asyncio.CancelledError, GeneratorExit, grpc.aio.AbortError):
                raise
            except Exception as exc:
                await abort_with(context, exc)

        return cast(Method, stream)

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises

    return cast(Method, unary)


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
