"""Real ``redis-server`` processes for tests: one standalone server or a 3-master cluster.

Every server listens on a free loopback port, keeps no data on disk (``--save ""``,
``--appendonly no``) and lives in its own temporary directory, so a test never touches the
Redis that may already run on 6379. ``kill()`` is a SIGKILL, as when a VM vanishes;
``restart()`` brings the server back on the same port, empty.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest

REDIS_SERVER_BINARY = "redis-server"
REDIS_CLI_BINARY = "redis-cli"
STARTUP_TIMEOUT_SECONDS = 15.0
CLUSTER_FORM_TIMEOUT_SECONDS = 30.0
POLL_INTERVAL_SECONDS = 0.02
STOP_TIMEOUT_SECONDS = 5.0
CLUSTER_MASTER_COUNT = 3
CLUSTER_BUS_PORT_OFFSET = 10000
CLUSTER_PORT_LOW = 20000
CLUSTER_PORT_HIGH = 55535
FREE_PORT_ATTEMPTS = 200


def redis_available() -> bool:
    """True when both ``redis-server`` and ``redis-cli`` are on PATH."""
    return bool(shutil.which(REDIS_SERVER_BINARY) and shutil.which(REDIS_CLI_BINARY))


def skip_without_redis() -> None:
    """Skip the calling test (or fixture) when no redis-server binary exists here."""
    if not redis_available():
        pytest.skip("redis-server / redis-cli not on PATH; install redis-server to run this test")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(with_cluster_bus: bool = False) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    A cluster node also listens on port + 10000 (its cluster bus), so Redis refuses ports
    above 55535 for it; ``with_cluster_bus`` picks a port whose bus port is free as well.
    """
    if not with_cluster_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])
    for _ in range(FREE_PORT_ATTEMPTS):
        port = random.randint(CLUSTER_PORT_LOW, CLUSTER_PORT_HIGH)
        if _port_is_free(port) and _port_is_free(port + CLUSTER_BUS_PORT_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int) -> bool:
    """Speaks RESP by hand so the factory needs no client library."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on a loopback port.

    Use as a context manager, or call ``start()`` and ``stop()``. ``extra_args`` are appended
    to the command line (the cluster uses them to turn cluster mode on).
    """

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        skip_without_redis()
        self.port = port if port is not None else free_port()
        self._extra_args = extra_args
        self._dir = Path(tempfile.mkdtemp(prefix=f"redis-{self.port}-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> RedisServer:
        """Start the process and return once it answers PING."""
        command = [
            REDIS_SERVER_BINARY,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--protected-mode",
            "no",
            *self._extra_args,
        ]
        log = (self._dir / "redis.log").open("ab")
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not _ping(self.port):
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited on start:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING:\n{self.log_text()}")
            time.sleep(POLL_INTERVAL_SECONDS)
        return self

    def log_text(self) -> str:
        path = self._dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the server vanishes without a chance to answer anything."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=STOP_TIMEOUT_SECONDS)

    def restart(self) -> RedisServer:
        """Kill (if running) and start again on the same port; data does not survive."""
        self.kill()
        for leftover in self._dir.glob("nodes*.conf"):
            leftover.unlink()
        return self.start()

    def stop(self) -> None:
        """Terminate the process and remove its directory."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=STOP_TIMEOUT_SECONDS)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class RedisCluster:
    """Three ``redis-server`` masters joined into a Redis Cluster with no replicas."""

    def __init__(self, master_count: int = CLUSTER_MASTER_COUNT) -> None:
        skip_without_redis()
        self.servers = [
            RedisServer(
                port=free_port(with_cluster_bus=True),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),
            )
            for _ in range(master_count)
        ]

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(server.host, server.port) for server in self.servers]

    @property
    def url(self) -> str:
        """A URL of one node; a cluster client discovers the others from it."""
        return self.servers[0].url

    def start(self) -> RedisCluster:
        for server in self.servers:
            server.start()
        addresses = [f"{host}:{port}" for host, port in self.startup_nodes]
        create = subprocess.run(
            [REDIS_CLI_BINARY, "--cluster", "create", *addresses]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=CLUSTER_FORM_TIMEOUT_SECONDS,
            check=False,
        )
        if create.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout!r}")
        self._wait_until_ok()
        return self

    def _wait_until_ok(self) -> None:
        """Every node must see the whole slot map before a client may connect."""
        deadline = time.monotonic() + CLUSTER_FORM_TIMEOUT_SECONDS
        for server in self.servers:
            while True:
                info = subprocess.run(
                    [REDIS_CLI_BINARY, "-p", str(server.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=STARTUP_TIMEOUT_SECONDS,
                    check=False,
                ).stdout
                if "cluster_state:ok" in info:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster never reached cluster_state:ok:\n{info}")
                time.sleep(POLL_INTERVAL_SECONDS * 5)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
