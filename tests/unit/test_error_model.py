"""The one error model: what a client sees for each typed error, over gRPC and over HTTP."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from common.errors import InvalidRequest
from common.rpc import maps_errors
from coordinator.errors import (
    IndexOutOfRange,
    NoWorkerAvailable,
    QueueFull,
    UnknownRequest,
    UnknownWorker,
)
from coordinator.http_front import http_error_for
from store import StoreUnavailable
from worker.errors import (
    CannotResume,
    DuplicateRequest,
    EngineNotReady,
    RecordNotFound,
    RequestNotFound,
    WorkerDraining,
)
from worker.kv_staging import StagingFull


class Aborted(Exception):
    pass


class RecordingContext:
    """Stands in for grpc.aio.ServicerContext: abort records the status and raises."""

    def __init__(self) -> None:
        self.aborts: list[tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]] = []

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        self.aborts.append((code, details, tuple(trailing_metadata)))
        raise Aborted(details)


class Service:
    def __init__(self, error: BaseException, items: int = 0) -> None:
        self.error = error
        self.items = items
        self.closed = False

    @maps_errors
    async def Unary(self, request: Any, context: Any) -> str:  # noqa: N802
        raise self.error

    @maps_errors
    async def Stream(self, request: Any, context: Any) -> AsyncIterator[int]:  # noqa: N802
        try:
            for i in range(self.items):
                yield i
            raise self.error
        finally:
            self.closed = True


def call_unary(error: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    context = RecordingContext()
    with pytest.raises(Aborted):
        asyncio.run(Service(error).Unary(None, context))
    (abort,) = context.aborts
    return abort


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("max_tokens must be at least 1"), grpc.StatusCode.INVALID_ARGUMENT),
        (QueueFull("interactive", 8, 250), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoWorkerAvailable("no worker is ready"), grpc.StatusCode.UNAVAILABLE),
        (UnknownRequest("r1"), grpc.StatusCode.NOT_FOUND),
        (UnknownWorker("w1"), grpc.StatusCode.NOT_FOUND),
        (IndexOutOfRange("from_index 9 is past the end"), grpc.StatusCode.OUT_OF_RANGE),
        (RequestNotFound("r1"), grpc.StatusCode.NOT_FOUND),
        (RecordNotFound("r1"), grpc.StatusCode.NOT_FOUND),
        (DuplicateRequest("r1 is running"), grpc.StatusCode.ALREADY_EXISTS),
        (EngineNotReady("loading"), grpc.StatusCode.UNAVAILABLE),
        (WorkerDraining("draining"), grpc.StatusCode.UNAVAILABLE),
        (CannotResume("r1 already ended"), grpc.StatusCode.FAILED_PRECONDITION),
        (StagingFull("no room"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (StoreUnavailable("redis is gone"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_each_typed_error_ends_a_call_with_its_status_and_message(
    error: Exception, code: grpc.StatusCode
) -> None:
    assert call_unary(error)[:2] == (code, str(error))


def test_a_full_queue_tells_when_to_retry() -> None:
    assert call_unary(QueueFull("batch", 4, 1500))[2] == (("retry-after-ms", "1500"),)


def test_an_unexpected_error_is_internal_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="common.rpc"):
        code, details, _ = call_unary(ZeroDivisionError("division by zero"))
    assert (code, details) == (grpc.StatusCode.INTERNAL, "division by zero")
    assert "unexpected error" in caplog.text


def test_a_typed_error_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="common.rpc"):
        call_unary(InvalidRequest("n must be 1"))
    assert caplog.text == ""


def test_a_stream_delivers_what_it_yielded_before_its_error() -> None:
    service = Service(UnknownRequest("r1"), items=3)
    context = RecordingContext()
    seen: list[int] = []

    async def consume() -> None:
        async for item in service.Stream(None, context):
            seen.append(item)

    with pytest.raises(Aborted):
        asyncio.run(consume())
    assert seen == [0, 1, 2]
    assert [code for code, _, _ in context.aborts] == [grpc.StatusCode.NOT_FOUND]


def test_a_stream_closed_early_closes_the_method_at_once_and_aborts_nothing() -> None:
    service = Service(RuntimeError("never reached"), items=10)
    context = RecordingContext()

    async def take_one() -> None:
        stream = service.Stream(None, context)
        assert await anext(stream) == 0
        await stream.aclose()  # what gRPC does when the client goes away

    asyncio.run(take_one())
    assert service.closed
    assert context.aborts == []


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequest("n must be 1"), 400, "invalid_request_error"),
        (QueueFull("interactive", 8, 1500), 429, "rate_limit_error"),
        (NoWorkerAvailable("no worker is ready"), 503, "service_unavailable"),
        (UnknownRequest("r1"), 404, "not_found_error"),
        (IndexOutOfRange("past the end"), 416, "invalid_request_error"),
    ],
)
def test_each_typed_error_has_its_http_status(error: Exception, status: int, kind: str) -> None:
    http = http_error_for(error)
    assert (http.status, http.kind, str(http)) == (status, kind, str(error))


def test_a_full_queue_over_http_says_when_to_retry_in_seconds_and_ms() -> None:
    assert http_error_for(QueueFull("batch", 4, 1500)).headers == {
        "Retry-After": "2",
        "retry-after-ms": "1500",
    }


def test_an_unexpected_error_over_http_is_500_with_its_type() -> None:
    http = http_error_for(ZeroDivisionError("division by zero"))
    assert (http.status, http.kind, str(http)) == (
        500,
        "internal_error",
        "ZeroDivisionError: division by zero",
    )
