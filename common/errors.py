"""The one error model: every typed error a process raises on purpose derives from
`ServiceError`, which says once how it reaches a client.

    raise QueueFull(...)  ──▶  gRPC: RESOURCE_EXHAUSTED, trailing metadata retry-after-ms
                          ──▶  HTTP: 429, {"error": {"type": "rate_limit_error", ...}},
                                     headers Retry-After and retry-after-ms

`common.rpc.maps_errors` is the gRPC side (one decorator on each servicer method) and
`coordinator.http_front.http_error_for` the HTTP side. An error that is not a ServiceError, or
one whose code is INTERNAL, is unexpected: it is logged and answered INTERNAL (HTTP 500).
"""

from __future__ import annotations

import math
from typing import ClassVar

import grpc


class UserError(Exception):
    """Bad operator input or an unusable environment; the CLI shows the message as is."""


class ServiceError(Exception):
    """Base of every typed error of every process; subclasses set the three class attributes."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500
    # The `type` of an OpenAI-shaped error body.
    http_type: ClassVar[str] = "internal_error"
    # The `code` of an OpenAI-shaped error body; None: the HTTP status.
    http_code: ClassVar[str | None] = None

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Hints for a gRPC client (e.g. when to retry); none by default."""
        return ()

    def http_headers(self) -> dict[str, str]:
        """The same hints as HTTP headers; none by default."""
        return {}


def is_unexpected(exc: BaseException) -> bool:
    """True for an error no typed error stands for: the servers log it and answer INTERNAL."""
    return not isinstance(exc, ServiceError) or exc.grpc_code == grpc.StatusCode.INTERNAL


class InvalidRequest(ServiceError, ValueError):
    """The request breaks a rule; the message names the field and the bound."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    http_type = "invalid_request_error"


RETRY_AFTER_METADATA_KEY = "retry-after-ms"


class Unauthenticated(ServiceError):
    """No API key, or one the keys file does not hold (gRPC UNAUTHENTICATED, HTTP 401)."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    http_type = "invalid_request_error"
    http_code = "invalid_api_key"


class PermissionDenied(ServiceError):
    """A known caller (key or certificate) whose role may not call this method
    (gRPC PERMISSION_DENIED, HTTP 403)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    http_type = "permission_error"
    http_code = "permission_denied"


class RetryLater(ServiceError):
    """Refused for now, with a hint when to try again: RESOURCE_EXHAUSTED with trailing
    metadata ``retry-after-ms``; HTTP 429 with ``Retry-After`` (whole seconds, at least 1)
    and ``retry-after-ms``. The Python client waits the hint, with jitter, and tries again."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    http_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(f"{message}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_METADATA_KEY, str(self.retry_after_ms)),)

    def http_headers(self) -> dict[str, str]:
        return {
            "Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000))),
            RETRY_AFTER_METADATA_KEY: str(self.retry_after_ms),
        }


class RateLimited(RetryLater):
    """An API key over its request rate or its concurrency, answered as a full queue is."""

    http_code = "rate_limit_exceeded"
