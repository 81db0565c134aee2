"""A throw-away Redis Cluster of N masters (no replicas) on loopback, for the local cluster,
tests and benchmarks.

    master 0: slots 0-5460 ◀──── cluster bus ────▶ master 1: 5461-10922 ◀──▶ master 2: 10923-16383
        ▲                    (TLS when secure)
        └── a process is given one node's URL and --redis-cluster; its client reads the
            slot map there and talks to every master itself

Each master is a RedisProcess (a free port, nothing on disk, its own temporary directory)
with an explicit bus port. Locked down (``secure=True``), every node runs with ONE set of
security files (redis_security.py): the same certificate, ACL users and MAC keyring, and TLS
on the bus too. The cluster is formed here rather than by ``redis-cli --cluster create``
(which refuses fewer than 3 masters and wants the admin password on its command line):
each master takes an even share of the slots, then meets the first, and ``start`` returns
once every node reports ``cluster_state:ok`` and knows every other.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotinfer.local.certs import CertPaths
from spotinfer.local.managed_process import free_port
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.redis_security import RedisSecurity
from store.acl import Role

if TYPE_CHECKING:
    import redis
    from typing_extensions import Self

CLUSTER_SLOTS = 16384
FORM_TIMEOUT_SECONDS = 30.0
FORM_POLL_SECONDS = 0.1
# How long a master may stay silent on the bus before the others call it failed. With no
# replicas a failed master takes the whole cluster down, so a loaded test machine (vLLM
# workers on two cores) must never look like a dead node: Redis's own default.
NODE_TIMEOUT_MS = 15000
ANNOUNCE_IP = "127.0.0.1"
ADMIN_SOCKET_TIMEOUT_SECONDS = 5.0


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """(first, last) slot of each master: contiguous, sizes within one slot of each other."""
    bounds = [i * CLUSTER_SLOTS // masters for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class RedisClusterProcess:
    """``with RedisClusterProcess(3, secure=True) as store: store.store_flags(Role.WORKER)``.

    ``url`` is the first master's; ``nodes`` are the masters in slot order. ``restart()``
    kills every master and forms the cluster again on the same ports, empty (as a lost
    cache would come back). ``stop()`` always removes every process and directory.
    """

    def __init__(self, masters: int, secure: bool = False, ca: CertPaths | None = None) -> None:
        if masters < 1:
            raise ValueError(f"a Redis Cluster needs at least one master, got {masters}")
        self._dir = Path(tempfile.mkdtemp(prefix="redis-cluster-"))
        self.nodes: list[RedisProcess] = []
        self.bus_ports: list[int] = []
        try:
            self.security = RedisSecurity.create(self._dir / "security", ca) if secure else None
            for _ in range(masters):
                bus_port = free_port()
                self.bus_ports.append(bus_port)
                self.nodes.append(
                    RedisProcess(extra_args=self._node_args(bus_port), security=self.security)
                )
        except BaseException:
            self.stop()
            raise

    @property
    def masters(self) -> int:
        return len(self.nodes)

    @property
    def url(self) -> str:
        """One node's URL: a cluster client discovers the others from it."""
        return self.nodes[0].url

    def store_flags(self, role: Role) -> list[str]:
        """The flags a process of ``role`` reaches the cluster with: one node and
        ``--redis-cluster``, as its own ACL user when the cluster is locked down."""
        return [*self.nodes[0].store_flags(role), "--redis-cluster"]

    def admin_options(self) -> dict[str, str]:
        """redis-py options of the operator's user ({} on an open cluster)."""
        return self.security.admin_options() if self.security is not None else {}

    def node_client(self, node: RedisProcess) -> redis.Redis:
        """A client of that one master as the operator (its own keys, INFO, CLUSTER)."""
        import redis

        return redis.Redis.from_url(
            node.url,
            socket_timeout=ADMIN_SOCKET_TIMEOUT_SECONDS,
            decode_responses=True,
            **self.admin_options(),
        )

    def start(self) -> Self:
        """Start every master, form the cluster, return once every node serves every slot."""
        try:
            for node in self.nodes:
                node.start()
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self) -> Self:
        """Kill every master; start them again on their ports, empty, as a new cluster."""
        for node in self.nodes:
            node.kill()
        for node in self.nodes:
            node.restart()  # forgets the old cluster's nodes.conf
        self._form()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _node_args(self, bus_port: int) -> tuple[str, ...]:
        bus_tls = self.security.cluster_bus_args() if self.security is not None else []
        return (
            *("--cluster-enabled", "yes"),
            *("--cluster-config-file", "nodes.conf"),
            *("--cluster-port", str(bus_port)),
            *("--cluster-announce-ip", ANNOUNCE_IP),
            *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
            *bus_tls,
        )

    def _form(self) -> None:
        """Slots to each master, distinct config epochs (what ``redis-cli --cluster create``
        sets, so no two masters claim the same epoch), then every master meets the first."""
        clients = [self.node_client(node) for node in self.nodes]
        try:
            ranges = slot_ranges(self.masters)
            for epoch, (client, (first, last)) in enumerate(zip(clients, ranges, strict=True), 1):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                clients[0].execute_command("CLUSTER", "MEET", ANNOUNCE_IP, node.port, bus_port)
            self._wait_until_ok(clients)
        finally:
            for client in clients:
                client.close()

    def _wait_until_ok(self, clients: list[redis.Redis]) -> None:
        deadline = time.monotonic() + FORM_TIMEOUT_SECONDS
        for node, client in zip(self.nodes, clients, strict=True):
            while True:
                info = cluster_info(client)
                if info.get("cluster_state") == "ok" and int(
                    info.get("cluster_known_nodes", 0)
                ) == len(self.nodes):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Redis Cluster never formed: node {node.port} says {info}\n"
                        f"{node.log_text()[-2000:]}"
                    )
                time.sleep(FORM_POLL_SECONDS)


def cluster_info(client: redis.Redis) -> dict[str, Any]:
    """CLUSTER INFO of one node as a dict (redis-py parses it, or leaves the text)."""
    answer = client.execute_command("CLUSTER", "INFO")
    if isinstance(answer, dict):
        return answer
    text = answer.decode() if isinstance(answer, bytes) else str(answer)
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {name: value.strip() for name, value in fields}
