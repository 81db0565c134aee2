"""A throw-away ``redis-server`` process on a free loopback port, for tests, benchmarks and
demos.

It keeps nothing on disk (``--save ""``, ``--appendonly no``) and lives in its own temporary
directory, so it never touches a Redis that already runs on 6379. ``kill()`` is a SIGKILL, as
when a VM vanishes; ``restart()`` brings the server back on the same port, empty. ``stop()``
always removes the process and the directory.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from spotinfer.local.certs import CertPaths
from spotinfer.local.managed_process import ManagedProcess, free_port
from spotinfer.local.redis_security import RedisSecurity
from store.acl import Role

if TYPE_CHECKING:
    from typing_extensions import Self

REDIS_SERVER_BINARY = "redis-server"
STARTUP_TIMEOUT_SECONDS = 15.0
STOP_TIMEOUT_SECONDS = 5.0
POLL_INTERVAL_SECONDS = 0.02
LOG_NAME = "redis.log"


class RedisNotInstalled(RuntimeError):
    """No ``redis-server`` on PATH (Debian/Ubuntu: ``apt-get install redis-server``)."""


def answers_ping(port: int, ca_file: Path | None = None) -> bool:
    # RESP by hand: the launcher needs no client library to know the server is up. A server
    # that wants a password first ("-NOAUTH") is up as well.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            conn = raw
            if ca_file is not None:
                context = ssl.create_default_context(cafile=str(ca_file))
                conn = context.wrap_socket(raw, server_hostname="127.0.0.1")
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisProcess(ManagedProcess):
    """``with RedisProcess() as redis: RedisStore.from_url(redis.url)``.

    ``extra_args`` are appended to the command line (a cluster node turns cluster mode on).
    ``secure=True`` locks it down (see redis_security.py): TLS only, on ``url`` (rediss://),
    one ACL user per role, and a MAC keyring, all in ``security``'s directory; its certificate
    signed by ``ca`` (a local cluster's), else by a CA of its own. ``security`` given instead:
    locked down with those files (the nodes of a Redis Cluster share one set; their owner
    removes it).
    """

    def __init__(
        self,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        secure: bool = False,
        ca: CertPaths | None = None,
        security: RedisSecurity | None = None,
    ) -> None:
        if shutil.which(REDIS_SERVER_BINARY) is None:
            raise RedisNotInstalled(f"{REDIS_SERVER_BINARY} is not on PATH")
        self.port = port if port is not None else free_port()
        self._extra_args = extra_args
        self._dir = Path(tempfile.mkdtemp(prefix=f"redis-{self.port}-"))
        if security is None and secure:
            security = RedisSecurity.create(self._dir / "security", ca)
        self.security = security
        super().__init__("redis-server", self._dir / LOG_NAME, cwd=self._dir)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        scheme = "rediss" if self.security is not None else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    def store_flags(self, role: Role) -> list[str]:
        """The store flags a process of ``role`` reaches this server with (as its own ACL
        user when the server is locked down)."""
        if self.security is None:
            return ["--redis-url", self.url]
        return self.security.store_flags(self.url, role)

    def start(self) -> Self:
        """Start the server; return once it answers PING."""
        self._dir.mkdir(parents=True, exist_ok=True)
        security = self.security
        listen = (
            security.server_args(self.port) if security is not None else ["--port", str(self.port)]
        )
        self.spawn(
            [
                REDIS_SERVER_BINARY,
                *listen,
                *("--bind", self.host),
                *("--save", ""),
                *("--appendonly", "no"),
                *("--dir", str(self._dir)),
                *("--protected-mode", "no"),
                *self._extra_args,
            ]
        )
        ca_file = security.ca_file if security is not None else None
        self.wait_until(
            lambda: answers_ping(self.port, ca_file),
            STARTUP_TIMEOUT_SECONDS,
            POLL_INTERVAL_SECONDS,
        )
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def restart(self) -> Self:
        """Kill (if running) and start again on the same port; data does not survive."""
        self.kill()
        for leftover in self._dir.glob("nodes*.conf"):
            leftover.unlink()
        return self.start()

    def stop(self) -> None:
        """Terminate the process and remove its directory."""
        self.terminate(STOP_TIMEOUT_SECONDS)
        shutil.rmtree(self._dir, ignore_errors=True)
