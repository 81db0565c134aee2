"""Configuration of the Redis store: where it is, cluster mode, expiry and client timeouts.

Every process's config holds one as ``config.store``; its URL and cluster mode keep the flag
names ``--redis-url`` / ``--redis-cluster`` (``SPOTINFER_REDIS_URL`` ...), the rest are
``--store-<field>``. TLS is the URL's: ``rediss://`` with redis-py's ``ssl_*`` query options.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from store.constants import (
    DEFAULT_BLOCK_TTL_SECONDS,
    DEFAULT_REQUEST_TTL_SECONDS,
    DEFAULT_RETENTION_SECONDS,
    DEFAULT_SOCKET_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_SOCKET_TIMEOUT_SECONDS,
)


@dataclass(frozen=True)
class StoreConfig:
    url: str = field(default="", metadata={"flag": "redis-url"})
    """Redis (redis://host:port/db, rediss:// for TLS, unix://); empty: no store."""
    cluster: bool = field(default=False, metadata={"flag": "redis-cluster"})
    """The URL names one node of a Redis Cluster; the client discovers the others."""
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
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis_url must be a redis://, rediss:// or unix:// URL, got {self.url!r}"
            )
        if self.cluster and not self.url:
            raise ValueError("redis_cluster needs redis_url (a node of the cluster)")
        if self.request_ttl_seconds <= 0:
            raise ValueError("request_ttl_seconds must be positive")
        if self.retention_seconds < 0:
            raise ValueError("retention_seconds must not be negative")
        if self.block_ttl_seconds <= 0:
            raise ValueError("block_ttl_seconds must be positive")
        if self.socket_timeout_seconds <= 0 or self.socket_connect_timeout_seconds <= 0:
            raise ValueError("socket timeouts must be positive")
