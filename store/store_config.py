"""Configuration of the Redis store (expiry and client timeouts)."""

from __future__ import annotations

from dataclasses import dataclass

from store.constants import (
    DEFAULT_BLOCK_TTL_SECONDS,
    DEFAULT_REQUEST_TTL_SECONDS,
    DEFAULT_RETENTION_SECONDS,
    DEFAULT_SOCKET_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_SOCKET_TIMEOUT_SECONDS,
)


@dataclass(frozen=True)
class StoreConfig:
    request_ttl_seconds: int = DEFAULT_REQUEST_TTL_SECONDS
    """Lifetime of an abandoned request's keys; every commit starts it again."""
    retention_seconds: int = DEFAULT_RETENTION_SECONDS
    """How long a finished request's keys stay readable; 0 deletes them at once."""
    block_ttl_seconds: int = DEFAULT_BLOCK_TTL_SECONDS
    """Lifetime of a shared KV block; every write or read of it starts it again."""
    socket_timeout_seconds: float = DEFAULT_SOCKET_TIMEOUT_SECONDS
    """Longest wait for one Redis reply before the store reports StoreUnavailable."""
    socket_connect_timeout_seconds: float = DEFAULT_SOCKET_CONNECT_TIMEOUT_SECONDS
    """Longest wait for a TCP connection to Redis."""

    def __post_init__(self) -> None:
        if self.request_ttl_seconds <= 0:
            raise ValueError("request_ttl_seconds must be positive")
        if self.retention_seconds < 0:
            raise ValueError("retention_seconds must not be negative")
        if self.block_ttl_seconds <= 0:
            raise ValueError("block_ttl_seconds must be positive")
        if self.socket_timeout_seconds <= 0 or self.socket_connect_timeout_seconds <= 0:
            raise ValueError("socket timeouts must be positive")
