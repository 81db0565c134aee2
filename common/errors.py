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
