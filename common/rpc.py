"""What every spotinfer gRPC server shares: health, reflection, the one wrapper that turns our
typed errors into gRPC statuses (see `common.errors`), and the interceptor that answers a
request that does not decode with INVALID_ARGUMENT (gRPC's own answer is UNKNOWN)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from common.errors import InvalidRequest, ServiceError, is_unexpected

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


class RejectsUndecodable(grpc.aio.ServerInterceptor):
    """Decodes the request of every unary-request method itself: bytes that are not the
    method's message end the call INVALID_ARGUMENT, with the parser's reason, before the
    servicer runs. (gRPC decodes before any interceptor could catch it and answers UNKNOWN,
    which a client cannot tell from a server fault.) Streaming requests pass untouched."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method  # type: ignore[attr-defined]
        decode = _decoder(handler.request_deserializer, method)
        if handler.response_streaming:
            behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        else:
            behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        if inspect.isasyncgenfunction(behavior):

            async def streamed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                request = await decode(raw, context)
                async for item in behavior(request, context):
                    yield item

            wrapped: Callable[..., Any] = streamed
        elif inspect.iscoroutinefunction(behavior):

            async def awaited(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(await decode(raw, context), context)

            wrapped = awaited
        else:
            return handler
        return make(wrapped, response_serializer=handler.response_serializer)


def _decoder(
    deserialize: Callable[[bytes], Any], method: str
) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
    async def decode(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:
            await abort_with(
                context, InvalidRequest(f"the request to {method} does not decode: {exc}")
            )

    return decode


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


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """The event a server's `serve` waits on: ``stop`` (a new one if None), set by SIGTERM or
    SIGINT from now on. Call it inside the running loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
