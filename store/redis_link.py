"""The link to Redis: building a client, sending command batches, translating failures.

Every batch is one pipeline, so it costs one network round trip per node it touches.
redis-py's own failures never leave this module: unreachable or overloaded servers become
StoreUnavailable, anything else Redis refuses becomes StoreError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from store.errors import StoreError, StoreUnavailable
from store.lua_scripts import ALL_SCRIPTS, LuaScript
from store.store_config import StoreConfig

RedisClient = redis.Redis | redis.RedisCluster
Command = tuple[Any, ...]
# Values longer than this go to the socket as their own chunk, uncopied (redis-py's default).
_PACK_BUFFER_CUTOFF_BYTES = 6000

_UNAVAILABLE_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    RedisClusterException,
)


def connect(url: str, cluster: bool, config: StoreConfig) -> RedisClient:
    """A bytes client with the store's timeouts.

    A standalone client connects on first use; a cluster client reads the slot map at once,
    so it raises StoreUnavailable here when no node answers.
    """
    # One immediate retry covers a connection the server closed while idle; more retries
    # with backoff would only delay the StoreUnavailable the caller needs to degrade.
    options: dict[str, Any] = {
        "socket_timeout": config.socket_timeout_seconds,
        "socket_connect_timeout": config.socket_connect_timeout_seconds,
        "retry": Retry(NoBackoff(), 1),
        "decode_responses": False,
        **security_options(url, config),
    }
    if not cluster:
        return redis.Redis.from_url(url, command_packer=_large_value_packer(), **options)
    connection_class = (
        _LargeValueSSLConnection if url.startswith("rediss://") else _LargeValueConnection
    )
    try:
        return redis.RedisCluster.from_url(url, connection_class=connection_class, **options)
    except _UNAVAILABLE_ERRORS as error:
        raise StoreUnavailable(f"Redis Cluster unavailable: {error}") from error


def security_options(url: str, config: StoreConfig) -> dict[str, Any]:
    """The ACL login and, for rediss://, the certificate checks redis-py should make (the
    same for the coordinator's asyncio client of its route records)."""
    options: dict[str, Any] = {}
    if config.username:
        options["username"] = config.username
    if config.password_file:
        options["password"] = Path(config.password_file).read_text().strip()
    if url.startswith("rediss://"):
        options["ssl_cert_reqs"] = "required"
        if config.tls_ca_file:
            options["ssl_ca_certs"] = config.tls_ca_file
        if config.tls_cert_file:
            options["ssl_certfile"] = config.tls_cert_file
            options["ssl_keyfile"] = config.tls_key_file
    return options


def _large_value_packer() -> PythonRespSerializer:
    """redis-py's own RESP writer, which sends a large value (a KV block) as a separate chunk
    straight from the caller's buffer. With hiredis installed redis-py would pack every
    command through ``hiredis.pack_command`` instead: two extra copies of each multi-MB block
    (memoryview -> bytes -> packed command), which cut SET throughput ~3x here. Replies are
    still parsed by hiredis, which is where it helps."""
    encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)
    return PythonRespSerializer(_PACK_BUFFER_CUTOFF_BYTES, encoder.encode)


class _LargeValueConnection(redis.Connection):
    """A cluster node connection with the large-value packer (RedisCluster passes no
    ``command_packer`` through to its nodes, but it does pass ``connection_class``)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _large_value_packer())
        super().__init__(**kwargs)


class _LargeValueSSLConnection(redis.SSLConnection):
    """The same, over TLS (rediss:// cluster nodes)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _large_value_packer())
        super().__init__(**kwargs)


def evalsha(script: LuaScript, script_keys: Sequence[str], args: Sequence[Any]) -> Command:
    return ("EVALSHA", script.sha, len(script_keys), *script_keys, *args)


class RedisLink:
    """Runs command batches on a standalone Redis or a Redis Cluster client alike."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client

    def run(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` in one pipeline; return their replies in order.

        A server that lost its script cache (a restart, a failover) answers NOSCRIPT without
        running anything; those commands are sent again after loading the scripts.
        """
        with self.translate_errors():
            results = self._pipeline(commands)
            forgotten = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
            if forgotten:
                for script in ALL_SCRIPTS:
                    self._client.script_load(script.source)
                retried = self._pipeline([commands[i] for i in forgotten])
                for i, result in zip(forgotten, retried, strict=True):
                    results[i] = result
            for command, result in zip(commands, results, strict=True):
                if isinstance(result, _UNAVAILABLE_ERRORS):
                    raise result
                if isinstance(result, Exception):
                    raise StoreError(f"Redis refused {command[0]}: {result}") from result
            return results

    def scan(self, pattern: str) -> list[bytes]:
        """Every key matching ``pattern``, on every node of a cluster."""
        with self.translate_errors():
            return list(self._client.scan_iter(match=pattern))

    def ping(self) -> None:
        with self.translate_errors():
            self._client.ping()

    def memory_settings(self) -> list[tuple[str, str, int]]:
        """(node, maxmemory-policy, maxmemory bytes) of the server, or of every master of a
        cluster, from INFO memory."""
        with self.translate_errors():
            if isinstance(self._client, redis.RedisCluster):
                answers = self._client.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
                per_node = dict(answers) if isinstance(answers, dict) else {}
                if per_node and "maxmemory_policy" in per_node:  # one master: one dict
                    per_node = {"the cluster": per_node}
            else:
                per_node = {"the server": self._client.info("memory")}
        return [
            (str(node), str(info.get("maxmemory_policy", "")), int(info.get("maxmemory", 0)))
            for node, info in per_node.items()
        ]

    def close(self) -> None:
        self._client.close()

    def _pipeline(self, commands: Sequence[Command]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    @contextlib.contextmanager
    def translate_errors(self) -> Iterator[None]:
        try:
            yield
        except _UNAVAILABLE_ERRORS as error:
            raise StoreUnavailable(f"Redis unavailable: {error}") from error
        except ResponseError as error:
            raise StoreError(f"Redis error: {error}") from error
