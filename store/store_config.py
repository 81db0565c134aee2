"""Configuration of the Redis store: where it is, cluster mode, expiry and client timeouts.

Every process's config holds one as ``config.store``; its URL and cluster mode keep the flag
names ``--redis-url`` / ``--redis-cluster`` (``SPOTINFER_REDIS_URL`` ...), the rest are
``--store-<field>``. The security settings keep short names of their own: ``--redis-tls-*``,
``--redis-username``, ``--redis-password-file``, ``--insecure-redis`` and
``--kv-mac-key-file`` (see docs/security.md).

Off loopback a process refuses to start (``check_exposure``) on a plaintext ``redis://`` URL
unless ``--insecure-redis`` says the operator means it, and without a MAC keyring at all:
the built-in loopback key authenticates nothing.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from store.constants import (
    DEFAULT_BLOCK_TTL_SECONDS,
    DEFAULT_REQUEST_TTL_SECONDS,
    DEFAULT_RETENTION_SECONDS,
    DEFAULT_SOCKET_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_SOCKET_TIMEOUT_SECONDS,
    DEFAULT_UNDELIVERED_RETENTION_SECONDS,
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
    """How long an ended request's keys stay readable once its client got the end (a
    coordinator says so); 0 deletes them at once."""
    undelivered_retention_seconds: int = DEFAULT_UNDELIVERED_RETENTION_SECONDS
    """How long a request that finished keeps its record and tokens while no coordinator has
    said that its client got the end (the coordinator died first; its successor replays them
    to the re-attaching client); 0: no such wait, ``retention_seconds`` applies at once."""
    block_ttl_seconds: int = DEFAULT_BLOCK_TTL_SECONDS
    """Lifetime of a shared KV block; every write or read of it starts it again."""
    socket_timeout_seconds: float = DEFAULT_SOCKET_TIMEOUT_SECONDS
    """Longest wait for one Redis reply before the store reports StoreUnavailable."""
    socket_connect_timeout_seconds: float = DEFAULT_SOCKET_CONNECT_TIMEOUT_SECONDS
    """Longest wait for a TCP connection to Redis."""
    tls_ca_file: str = field(default="", metadata={"flag": "redis-tls-ca-file"})
    """PEM CA bundle that Redis's certificate must chain to (rediss:// only); empty: the
    system's trust store."""
    tls_cert_file: str = field(default="", metadata={"flag": "redis-tls-cert-file"})
    """PEM client certificate, for a Redis that asks for one (tls-auth-clients)."""
    tls_key_file: str = field(default="", metadata={"flag": "redis-tls-key-file"})
    """PEM key of ``tls_cert_file``."""
    username: str = field(default="", metadata={"flag": "redis-username"})
    """ACL user this process logs in as (worker, daemon or coordinator, see store/acl.py);
    empty: the URL's user, else ``default``."""
    password_file: str = field(default="", metadata={"flag": "redis-password-file"})
    """File holding the ACL user's password (kept out of flags and the environment)."""
    insecure: bool = field(default=False, metadata={"flag": "insecure-redis"})
    """Allow a plaintext redis:// URL off loopback (the operator accepts the exposure)."""
    mac_key_file: str = field(default="", metadata={"flag": "kv-mac-key-file"})
    """Keyring of the cluster's KV MAC keys (store/mac_keyring.py); empty: the public
    loopback key, refused off loopback."""

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
        if self.undelivered_retention_seconds < 0:
            raise ValueError("undelivered_retention_seconds must not be negative")
        if self.block_ttl_seconds <= 0:
            raise ValueError("block_ttl_seconds must be positive")
        if self.socket_timeout_seconds <= 0 or self.socket_connect_timeout_seconds <= 0:
            raise ValueError("socket timeouts must be positive")
        if (self.tls_ca_file or self.tls_cert_file) and not self.url.startswith("rediss://"):
            raise ValueError("--redis-tls-* needs a rediss:// --redis-url")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--redis-tls-cert-file and --redis-tls-key-file go together")

    @property
    def on_loopback(self) -> bool:
        """Whether Redis is reached without leaving the host (loopback address or unix socket)."""
        return is_loopback_url(self.url)

    def check_exposure(self) -> None:
        """Raise ValueError, naming the flag to set, for a store a process must not start on:
        plaintext off loopback without --insecure-redis, or no MAC keyring off loopback."""
        if not self.url or self.on_loopback:
            return
        if self.url.startswith("redis://") and not self.insecure:
            raise ValueError(
                f"refusing plaintext Redis off loopback ({_host(self.url)}): use a rediss:// "
                "--redis-url (with --redis-tls-ca-file), or pass --insecure-redis"
            )
        if not self.mac_key_file:
            raise ValueError(
                f"refusing Redis off loopback ({_host(self.url)}) without a KV MAC keyring: "
                "pass --kv-mac-key-file (SPOTINFER_KV_MAC_KEY_FILE)"
            )


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


def is_loopback_url(url: str) -> bool:
    if url.startswith("unix://"):
        return True
    host = _host(url)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
