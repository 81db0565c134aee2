"""The link to Redis: building a client, sending command batches, translating failures.

Every batch is one pipeline, so it costs one network round trip per node it touches.
redis-py's own failures never leave this module: unreachable or overloaded servers become
StoreUnavailable, anything else Redis refuses becomes StoreError.
"""

from __future__ import annotations

import contextlib
import socket
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


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """redis-py's errors (sync or asyncio client) as the store's: StoreUnavailable when Redis
    could not be reached or did not answer in time, StoreError when it refused a command."""
    try:
        yield
    except _UNAVAILABLE_ERRORS as error:
        raise StoreUnavailable(f"Redis unavailable: {error}") from error
    except ResponseError as error:
        raise StoreError(f"Redis error: {error}") from error


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
        with translate_errors():
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

    def stream_values(
        self, commands: Sequence[Command]
    ) -> Iterator[tuple[int, StreamedValue | None]]:
        """Send ``commands`` (each answered by a string or nil: GET, GETEX, HGET; the key
        second) in one pipeline per node and yield their replies as they come off the
        sockets: (the command's index, its value, None for nil), each value taken by the
        caller in pieces (``StreamedValue``) before the next is read. What the caller leaves
        of a value is skipped. On a cluster every node is sent its commands first, then the
        nodes are read in turn: each node's replies in order, the nodes' in any.

        For a big read (a resume's KV): each piece can be checked and passed on while it is
        in the CPU's cache, instead of every reply going through memory whole, once per
        step. An error reply raises StoreError (ValuesMoved where a cluster node says a key
        has moved: read again with ``run``, which follows it) and a lost connection
        StoreUnavailable, as ``run`` does; the connections are dropped then, and whenever
        the caller stops early.
        """
        with translate_errors():
            groups = self._node_groups(commands)
        held: list[tuple[Any, Any]] = []
        finished = False
        try:
            sent = []
            for pool, indices in groups:
                connection = pool.get_connection()
                held.append((pool, connection))
                sent.append((self._sent(connection, [commands[i] for i in indices]), indices))
            for replies, indices in sent:
                for index in indices:
                    value = replies.next_value(commands[index])
                    yield index, value
                    if value is not None:
                        value.skip_rest()
                replies.check_drained()
            finished = True
        except (OSError, *_UNAVAILABLE_ERRORS) as error:
            raise StoreUnavailable(f"Redis unavailable: {error}") from error
        finally:
            for pool, connection in held:
                if not finished:
                    connection.disconnect()
                pool.release(connection)

    def _node_groups(self, commands: Sequence[Command]) -> list[tuple[Any, list[int]]]:
        """(connection pool, indices of its commands) per server the commands go to."""
        client = self._client
        if not isinstance(client, redis.RedisCluster):
            return [(client.connection_pool, list(range(len(commands))))]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for index, command in enumerate(commands):
            node = client.get_node_from_key(command[1])
            pool = client.get_redis_connection(node).connection_pool
            groups.setdefault(node.name, (pool, []))[1].append(index)
        return list(groups.values())

    def refresh_slots(self) -> None:
        """Reads a cluster's slot map again (after ValuesMoved); nothing on a standalone."""
        if isinstance(self._client, redis.RedisCluster):
            with translate_errors():
                self._client.nodes_manager.initialize()

    @staticmethod
    def _sent(connection: Any, commands: Sequence[Command]) -> _Replies:
        """The commands sent on ``connection`` (which the pool handed out checked: one the
        server closed while idle is opened again); its socket's replies to read."""
        connection.send_packed_command(connection.pack_commands(commands))
        sock = connection._get_socket()  # noqa: SLF001 (the replies are read off it)
        if sock is None:
            raise redis.exceptions.ConnectionError("no socket after sending")
        return _Replies(sock)

    def scan(self, pattern: str) -> list[bytes]:
        """Every key matching ``pattern``, on every node of a cluster."""
        with translate_errors():
            return list(self._client.scan_iter(match=pattern))

    def ping(self) -> None:
        with translate_errors():
            self._client.ping()

    def memory_settings(self) -> list[tuple[str, str, int]]:
        """(node, maxmemory-policy, maxmemory bytes) of the server, or of every master of a
        cluster, from INFO memory."""
        with translate_errors():
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


_READ_CHUNK_BYTES = 64 * 1024


class ValuesMoved(StoreError):
    """A cluster node answered a streamed read with MOVED or ASK: its slot map was stale."""


class StreamedValue:
    """A string reply being read off the socket: ``length`` bytes, taken in order."""

    def __init__(self, replies: _Replies, length: int) -> None:
        self.length = length
        self._replies = replies
        self._left = length

    def read_into(self, buffer: memoryview) -> int:
        """Fills the start of ``buffer`` with the value's next bytes (at most what is left of
        it); how many. Blocks until at least one byte came."""
        wanted = min(len(buffer), self._left)
        if not wanted:
            return 0
        count = self._replies.read_into(buffer[:wanted])
        self._left -= count
        if not self._left:
            self._replies.expect_line_end()
        return count

    def read_exact(self, count: int) -> bytes:
        """The value's next ``count`` bytes (at most what is left of it)."""
        data = bytearray(min(count, self._left))
        view = memoryview(data)
        filled = 0
        while filled < len(data):
            filled += self.read_into(view[filled:])
        return bytes(data)

    def skip_rest(self) -> None:
        scratch = memoryview(bytearray(min(self._left, _READ_CHUNK_BYTES)))
        while self._left:
            self.read_into(scratch)


class _Replies:
    """RESP replies read straight off a socket: the line of each reply's type and length, a
    string's bytes into the caller's buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # read past a line: the start of what follows it

    def next_value(self, command: Command) -> StreamedValue | None:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$" and rest.lstrip(b"-").isdigit():
            length = int(rest)
            return None if length < 0 else StreamedValue(self, length)
        if kind == b"_":  # RESP3's nil
            return None
        if kind == b"-":
            message = rest.decode("utf-8", "replace")
            if message.startswith(("MOVED ", "ASK ")):
                raise ValuesMoved(f"Redis Cluster moved {command[1]!r}: {message}")
            raise StoreError(f"Redis refused {command[0]}: {message}")
        raise StoreError(f"Redis answered {command[0]} with {line[:40]!r}, not a string")

    def read_into(self, buffer: memoryview) -> int:
        if self._pending:
            count = min(len(buffer), len(self._pending))
            buffer[:count] = self._pending[:count]
            del self._pending[:count]
            return count
        count = self._sock.recv_into(buffer)
        if not count:
            raise redis.exceptions.ConnectionError("Redis closed the connection mid-reply")
        return count

    def expect_line_end(self) -> None:
        if self._line():
            raise StoreError("a string reply of Redis ran past its length")

    def check_drained(self) -> None:
        if self._pending:
            raise StoreError(f"Redis sent {len(self._pending)} bytes more than was asked")

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            chunk = self._sock.recv(_READ_CHUNK_BYTES)
            if not chunk:
                raise redis.exceptions.ConnectionError("Redis closed the connection")
            self._pending += chunk
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line
