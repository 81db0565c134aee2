"""Real ``redis-server`` processes for tests: one standalone server or a 3-master cluster.

Every server is a spotinfer.local.redis_process.RedisProcess: a free loopback port, no data
on disk, its own temporary directory, so a test never touches the Redis that may already run
on 6379. ``kill()`` is a SIGKILL, as when a VM vanishes; ``restart()`` brings the server back
on the same port, empty.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

import pytest

from spotinfer.local.managed_process import free_port as loopback_free_port
from spotinfer.local.redis_process import (
    POLL_INTERVAL_SECONDS,
    REDIS_SERVER_BINARY,
    STARTUP_TIMEOUT_SECONDS,
    RedisProcess,
)

REDIS_CLI_BINARY = "redis-cli"
CLUSTER_FORM_TIMEOUT_SECONDS = 30.0
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
        return loopback_free_port()
    for _ in range(FREE_PORT_ATTEMPTS):
        port = random.randint(CLUSTER_PORT_LOW, CLUSTER_PORT_HIGH)
        if _port_is_free(port) and _port_is_free(port + CLUSTER_BUS_PORT_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer(RedisProcess):
    """One ``redis-server`` process on a loopback port (see spotinfer.local.redis_process);
    the calling test is skipped where Redis is not installed."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        skip_without_redis()
        super().__init__(port, extra_args)


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

    def __exit__(self, *exc: object) -> None:
        self.stop()
