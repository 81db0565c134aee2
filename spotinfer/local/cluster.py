"""A whole spotinfer cluster on one machine, on embedded defaults.

    redis-server (own, free port, TLS) ◀─────────┬─────────────────┐
         ▲                                         │                 │
    coordinator ──▶ node-0: worker ◀── daemon ◀── metadata server (AWS / GCP / Azure format)
     (gRPC + HTTP)  node-1: worker ◀── daemon ◀── metadata server
                    node-2: worker (standby) ◀── daemon ◀── metadata server

Every node is a worker process, its context daemon and a local metadata server that speaks
the cloud's format, so a drill preempts a node exactly as the cloud would: the metadata
server starts announcing the termination, the node's daemon sees it, and the rest is the
product's own reaction. `kill` is the unannounced loss: worker and daemon die at once.

Its own redis-server runs locked down (``secure_redis``, see redis_security.py): TLS only,
its certificate signed by the same cluster CA as the gRPC TLS; each process logs in as its
role's ACL user, and KV blocks and records are signed with a keyring generated for this
cluster. With ``redis_cluster_masters`` the store is a Redis Cluster of that many masters
instead (redis_cluster_process.py), every node locked down alike; each process is given one
node and ``--redis-cluster``, as it would be in a deployment.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.channels import TransportConfig
from context_daemon.constants import GCP_MAX_NOTICE_SECONDS
from spotinfer.drills.report import ClusterEvent
from spotinfer.local.cluster_secrets import ClusterSecrets
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.daemon_process import DaemonProcess
from spotinfer.local.metadata_servers import (
    InstanceIdentity,
    MetadataServer,
    metadata_server_for,
)
from spotinfer.local.redis_cluster_process import RedisClusterProcess
from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.worker_process import WorkerProcess
from store.acl import Role
from worker.config import check_kv_persistence

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

CLOUDS = ("aws", "gcp", "azure")
# What each cloud gives between the notice and the termination.
DEFAULT_GRACE_SECONDS = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
FAILOVER_BY_POLICY = {"spotinfer": "resume", "reroute": "reroute"}
MAC_REJECTED_SAMPLE = "spotinfer_worker_kv_mac_rejected_blocks_total"
# A worker stopped by SIGTERM moves its requests within its drain grace (30 s by default),
# then exits; past this it is killed.
WORKER_STOP_WAIT_SECONDS = 60.0
# Redis's own floor for a cluster that works as expected (`redis-cli --cluster create`
# refuses fewer masters): a smaller one is no deployment a drill could stand for.
MIN_REDIS_CLUSTER_MASTERS = 3


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    workers: int = 1
    standbys: int = 1
    port: int = 0  # coordinator gRPC; 0: a free port
    http_port: int = 0
    redis_url: str = ""  # empty: start our own redis-server
    secure_redis: bool = True  # our own redis-server: TLS, ACL users per role, a MAC keyring
    cloud: str = "aws"
    dtype: str = "float32"
    max_model_len: int = 2048
    memory_gib: float = 1.0  # per worker: weights + KV + 10% reserve
    persist_policy: str = "eager"  # the workers' --kv-persist-policy
    # hybrid's cap, MB/s (the workers' --kv-persist-rate-mb-s): required by hybrid, refused
    # with another policy.
    persist_rate_mb_s: float | None = None
    # Each node's daemon writes the KV blocks (and a pause's tokens) its worker hands over
    # through shared memory (--kv-handoff-socket); False: the worker writes Redis itself.
    kv_handoff: bool = True
    policy: str = "spotinfer"  # spotinfer | reroute (restart preempted requests from scratch)
    coordinator_flags: tuple[str, ...] = ()
    worker_flags: tuple[str, ...] = ()  # added to every worker's command line
    # AWS: how long a scale-in's lifecycle hook holds a node (0: the cloud's notice grace).
    lifecycle_drain_seconds: float = 0.0
    # GCP: the VMs' preemption notice length (scheduling.preemptionNoticeDuration), which the
    # daemons are told because a GCP notice carries no deadline; 0: the cloud's 30 s.
    notice_seconds: float = 0.0
    # TLS on the public fronts, mutual TLS between the processes, and API keys (made in
    # log_dir/tls when the cluster starts); False: plaintext and no keys, as in the tests.
    secure: bool = True
    log_dir: Path = field(default_factory=lambda: Path("/tmp/spotinfer-cluster"))
    # The zones the spot nodes are spread over, each node in the least filled one (its pool
    # labels say so at registration); empty: one unnamed zone.
    zones: tuple[str, ...] = ()
    # On-demand fallback nodes (no `spot` pool label): the coordinator routes to them only
    # while the spot nodes cannot hold the load; a drill's waves never notice them.
    fallback_nodes: int = 0
    # Our own store as a Redis Cluster of this many masters, no replicas, each node locked
    # down as the single server is; every process gets one node and --redis-cluster.
    # 0: one redis-server.
    redis_cluster_masters: int = 0

    def __post_init__(self) -> None:
        if self.redis_cluster_masters and self.redis_url:
            raise ValueError(
                "--redis-cluster-masters starts a Redis Cluster of our own; it cannot go with "
                "--redis-url (an outside Redis)"
            )
        if self.redis_cluster_masters < 0 or 0 < self.redis_cluster_masters < (
            MIN_REDIS_CLUSTER_MASTERS
        ):
            raise ValueError(
                f"--redis-cluster-masters must be 0 (one redis-server) or at least "
                f"{MIN_REDIS_CLUSTER_MASTERS} (Redis Cluster's own minimum), "
                f"got {self.redis_cluster_masters}"
            )
        if self.workers < 1:
            raise ValueError("a cluster needs at least one active worker (--workers)")
        if self.fallback_nodes < 0:
            raise ValueError("--fallback-nodes must not be negative")
        if len(set(self.zones)) != len(self.zones) or not all(self.zones):
            raise ValueError(f"zones must be distinct names, got {self.zones!r}")
        if self.standbys < 0:
            raise ValueError("--standbys must not be negative")
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {CLOUDS}, got {self.cloud!r}")
        if self.policy not in FAILOVER_BY_POLICY:
            raise ValueError(f"policy must be one of {sorted(FAILOVER_BY_POLICY)}")
        check_kv_persistence(self.persist_policy, self.persist_rate_mb_s)
        if self.notice_seconds and self.cloud != "gcp":
            raise ValueError(
                "notice_seconds is a GCP VM's notice length; AWS and Azure notices carry "
                "their own deadline (give the drill's grace instead)"
            )
        if not 0 <= self.notice_seconds <= GCP_MAX_NOTICE_SECONDS:
            raise ValueError(
                f"notice_seconds must be in (0, {GCP_MAX_NOTICE_SECONDS:g}] (0: the default), "
                f"got {self.notice_seconds:g}"
            )

    @property
    def grace_seconds(self) -> float:
        return self.notice_seconds or DEFAULT_GRACE_SECONDS[self.cloud]

    @property
    def notice_has_deadline(self) -> bool:
        """Whether a notice tells its deadline (AWS, Azure): a drill can then shorten the
        grace; a GCP notice is only TRUE, and the VM lives the daemon's notice length."""
        return self.cloud != "gcp"

    @property
    def scale_in_seconds(self) -> float:
        return self.lifecycle_drain_seconds or self.grace_seconds

    @property
    def persist_flags(self) -> tuple[str, ...]:
        """Every worker's KV persistence flags."""
        rate = self.persist_rate_mb_s
        capped = ("--kv-persist-rate-mb-s", repr(rate)) if rate is not None else ()
        return ("--kv-persist-policy", self.persist_policy, *capped)


@dataclass
class Node:
    name: str
    role: str  # active | standby
    metadata: MetadataServer
    worker: WorkerProcess
    daemon: DaemonProcess | None = None
    alive: bool = True
    zone: str = ""
    fallback: bool = False  # an on-demand fallback node, not a spot one


class LocalCluster:
    """Starts, disturbs and stops a cluster; every disturbance is recorded as a ClusterEvent."""

    def __init__(
        self, config: ClusterConfig, on_progress: Callable[[str], None] | None = None
    ) -> None:
        self.config = config
        self._say = on_progress or (lambda message: log.info(message))
        self.redis: RedisProcess | RedisClusterProcess | None = None
        self.redis_url = config.redis_url
        self.coordinator: Any = None
        self.nodes: dict[str, Node] = {}
        self.events: list[ClusterEvent] = []
        self._lock = threading.Lock()
        self._next_node = 0
        self._coordinator_starts = 0
        self._loading: list[Node] = []  # nodes whose worker is still loading
        self._stopped = False
        self.secrets = ClusterSecrets()

    @property
    def client_transport(self) -> TransportConfig:
        """What a client of this cluster's coordinator needs (the CA; plaintext: nothing)."""
        return self.secrets.client_transport

    @property
    def operator_transport(self) -> TransportConfig:
        return self.secrets.operator_transport

    @property
    def api_key(self) -> str:
        """A tenant key of this cluster ("" without keys)."""
        return self.secrets.api_key

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> LocalCluster:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.secure:
            self.secrets = ClusterSecrets.make(self.config.log_dir)
        try:
            if not self.redis_url:
                self.redis = self._new_redis()  # `stop` removes it, also if it fails to start
                self.redis.start()
                self.redis_url = self.redis.url
                self._say(self._redis_description())
            self._start_coordinator()
            roles = ["active"] * self.config.workers + ["standby"] * self.config.standbys
            self._start_nodes([(self._new_name(), role) for role in roles])
            if self.config.fallback_nodes:
                names = [self._new_name() for _ in range(self.config.fallback_nodes)]
                self._start_nodes([(name, "active") for name in names], fallback=True)
        except BaseException:
            self.stop()
            raise
        return self

    def _new_redis(self) -> RedisProcess | RedisClusterProcess:
        # One CA for the cluster: Redis's certificate is signed by the gRPC one.
        secure, ca = self.config.secure_redis, self.secrets.ca
        if self.config.redis_cluster_masters:
            return RedisClusterProcess(self.config.redis_cluster_masters, secure=secure, ca=ca)
        return RedisProcess(secure=secure, ca=ca)

    def _redis_description(self) -> str:
        if isinstance(self.redis, RedisClusterProcess):
            ports = ", ".join(str(node.port) for node in self.redis.nodes)
            return f"Redis Cluster of {self.redis.masters} masters on ports {ports}"
        return f"redis-server at {self.redis_url}"

    def _start_coordinator(
        self,
        port: int | None = None,
        http_port: int | None = None,
        internal_port: int | None = None,
    ) -> None:
        flags = (
            *("--model", self.config.model),
            *self._store_flags(Role.COORDINATOR),
            *("--failover-policy", FAILOVER_BY_POLICY[self.config.policy]),
            *self.secrets.flags("coordinator"),
            *self.config.coordinator_flags,
        )
        # A restarted coordinator keeps its port, so its log (named by port) would overwrite
        # the log of the one that died: each start logs in a folder of its own.
        log_dir = self.config.log_dir
        if self._coordinator_starts:
            log_dir = log_dir / f"coordinator-start-{self._coordinator_starts}"
            log_dir.mkdir(parents=True, exist_ok=True)
        self._coordinator_starts += 1
        self.coordinator = CoordinatorProcess(
            *flags,
            log_dir=log_dir,
            port=port or self.config.port or None,
            http_port=http_port or self.config.http_port or None,
            internal_port=internal_port,
            transport=self.secrets.operator_transport,
        ).start()
        self._say(f"coordinator at {self.coordinator.address} (HTTP {self.coordinator.http_url})")

    def _start_nodes(
        self, names_and_roles: list[tuple[str, str]], fallback: bool = False
    ) -> list[Node]:
        """Workers load in parallel (the slow part), then daemons, then registration. Returns
        the nodes that joined: none when the cluster was stopped while they loaded."""
        zones = self._zones_for(len(names_and_roles))
        nodes = [
            self._new_node(name, role, zone, fallback)
            for (name, role), zone in zip(names_and_roles, zones, strict=True)
        ]
        with self._lock:
            if self._stopped:
                for node in nodes:
                    node.metadata.__exit__(None, None, None)
                return []
            self._loading.extend(nodes)
        errors: list[BaseException] = []

        def load(node: Node) -> None:
            try:
                node.worker.start()
            except BaseException as exc:  # reported below, after every thread is done
                errors.append(exc)

        threads = [threading.Thread(target=load, args=(node,)) for node in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with self._lock:
            for node in nodes:
                self._loading.remove(node)
            stopped = self._stopped
            if not stopped:
                self.nodes.update((node.name, node) for node in nodes)
        if stopped:  # stopped while these loaded (a drill's replacement node)
            for node in nodes:
                node.worker.stop()
                node.metadata.__exit__(None, None, None)
            return []
        if errors:
            raise errors[0]
        for node in nodes:
            node.daemon = self._daemon_for(node).start()
            with self._lock:
                stopped = self._stopped
            if stopped:  # `stop` may have passed this node before its daemon existed
                node.daemon.stop()
                return []
            self._register(node)
            self._say(f"{node.name} ({node.role}) ready: worker {node.worker.address}")
        return nodes

    def _zones_for(self, count: int) -> list[str]:
        """Zones for ``count`` new nodes: each in the zone with the fewest serving spot nodes
        (live, not noticed), counting the ones being placed."""
        if not self.config.zones:
            return [""] * count
        with self._lock:
            serving = [
                n
                for n in [*self.nodes.values(), *self._loading]
                if n.alive and n.role != "preempted" and not n.fallback
            ]
        filled = {zone: sum(1 for n in serving if n.zone == zone) for zone in self.config.zones}
        chosen = []
        for _ in range(count):
            zone = min(self.config.zones, key=lambda z: filled[z])  # the first of a tie
            filled[zone] += 1
            chosen.append(zone)
        return chosen

    def _store_flags(self, role: Role) -> tuple[str, ...]:
        """How a process of ``role`` reaches Redis: as its own ACL user over TLS on our own
        locked-down server (one node of our Redis Cluster, with --redis-cluster), else the
        plain URL it was given."""
        if self.redis is None:
            return ("--redis-url", self.redis_url)
        return tuple(self.redis.store_flags(role))

    @property
    def redis_admin_options(self) -> dict[str, str]:
        """redis-py options for the operator's user (leak checks scan every key)."""
        security = self.redis.security if self.redis is not None else None
        return security.admin_options() if security is not None else {}

    def redis_admin_client(self) -> redis.Redis | redis.RedisCluster:
        """A redis-py client as the operator's user: of every master when the store is our
        Redis Cluster (a scan then covers them all), else of the one server."""
        import redis

        if isinstance(self.redis, RedisClusterProcess):
            return redis.RedisCluster.from_url(self.redis_url, **self.redis_admin_options)
        return redis.Redis.from_url(self.redis_url, **self.redis_admin_options)

    def _new_name(self) -> str:
        with self._lock:
            name = f"node-{self._next_node}"
            self._next_node += 1
        return name

    def _new_node(self, name: str, role: str, zone: str = "", fallback: bool = False) -> Node:
        # Azure names the VM an event is for (compute/name): the daemon's --azure-vm-name.
        identity = InstanceIdentity(instance_id=name) if self.config.cloud == "azure" else None
        metadata = metadata_server_for(self.config.cloud, identity).__enter__()
        worker = WorkerProcess(
            self.config.model,
            *("--worker-id", name),
            *("--dtype", self.config.dtype),
            *("--max-model-len", str(self.config.max_model_len)),
            *("--memory-gib", str(self.config.memory_gib)),
            *self._store_flags(Role.WORKER),
            *self.config.persist_flags,
            *self._handoff_flags(name),
            *self.secrets.flags("worker", name),
            *self.config.worker_flags,
            log_dir=self.config.log_dir,
            metrics=True,
            transport=self.secrets.operator_transport,
        )
        return Node(
            name=name, role=role, metadata=metadata, worker=worker, zone=zone, fallback=fallback
        )

    def _daemon_for(self, node: Node) -> DaemonProcess:
        return DaemonProcess(
            *("--notice-source", self.config.cloud),
            *("--metadata-url", node.metadata.base_url),
            *("--worker-address", node.worker.address),
            *self._store_flags(Role.DAEMON),
            *("--azure-vm-name", node.name),
            *("--poll-interval-seconds", "0.5"),
            *self._notice_flags(),
            # A scale-in's lifecycle hook holds the node as long as a notice's grace.
            *("--lifecycle-drain-seconds", f"{self.config.scale_in_seconds:g}"),
            *self.secrets.flags("daemon", node.name),
            *self._handoff_flags(node.name),
            log_dir=self.config.log_dir,
            transport=self.secrets.operator_transport,
        )

    def _handoff_flags(self, name: str) -> tuple[str, ...]:
        """The node's hand-off socket and the folder where its daemon lays out KV a peer
        pushed, for its worker and its daemon alike (a short socket path: unix socket paths
        end at 107 bytes; the folder on tmpfs where there is one)."""
        if not self.config.kv_handoff:
            return ()
        socket_path, peer_dir = self._handoff_paths(name)
        return (
            *("--kv-handoff-socket", str(socket_path)),
            *("--kv-peer-staging-dir", str(peer_dir)),
        )

    def _handoff_paths(self, name: str) -> tuple[Path, Path]:
        stem = f"spot-{os.getpid()}-{id(self):x}-{name}"
        shm = Path("/dev/shm")
        peer_root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        return Path(tempfile.gettempdir()) / f"{stem}.sock", peer_root / f"{stem}-peer"

    def _notice_flags(self) -> tuple[str, ...]:
        if not self.config.notice_seconds:
            return ()
        return ("--grace-seconds", f"{self.config.notice_seconds:g}")

    def _register(self, node: Node) -> None:
        from protos.spotinfer.v1 import control_pb2

        role = (
            control_pb2.WORKER_ROLE_STANDBY
            if node.role == "standby"
            else control_pb2.WORKER_ROLE_ACTIVE
        )
        request = control_pb2.RegisterWorkerRequest(
            worker_id=node.name,
            address=node.worker.address,
            role=role,
            # What a VM of a real fleet says: its zone, and spot or on demand (the fallback).
            pool=control_pb2.PoolLabels(
                cloud=self.config.cloud, zone=node.zone, spot=not node.fallback
            ),
        )
        if node.daemon is not None and "daemon_address" in request.DESCRIPTOR.fields_by_name:
            request.daemon_address = node.daemon.address  # type: ignore[attr-defined]
        self.coordinator.control.RegisterWorker(request, timeout=10)

    def stop(self) -> None:
        """Everything we started goes, children included (workers still loading too: their
        loader thread dies with the caller, the process would not); safe to call twice."""
        with self._lock:
            self._stopped = True
            loading = list(self._loading)
        for node in loading:
            if node.worker.process is not None:
                node.worker.kill()
        # In parallel: each worker drains on SIGTERM, and a drill leaves a dozen of them.
        stopping = [
            threading.Thread(target=self._stop_node, args=(node,))
            for node in list(self.nodes.values())
        ]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        for name in self.nodes:
            socket_path, peer_dir = self._handoff_paths(name)
            shutil.rmtree(peer_dir, ignore_errors=True)
            socket_path.unlink(missing_ok=True)
        self.nodes.clear()
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    @staticmethod
    def _stop_node(node: Node) -> None:
        if node.daemon is not None:
            node.daemon.stop()
        node.worker.stop()
        node.metadata.__exit__(None, None, None)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- disturbances ------------------------------------------------------------------

    def _record(self, kind: str, target: str = "", detail: str = "") -> None:
        self.events.append(ClusterEvent(time.perf_counter(), kind, target, detail))

    def logs_tail(self, chars: int = 3000) -> str:
        """The end of every process's output (coordinator, each node's worker and daemon),
        for a failure message."""
        parts = []
        if self.coordinator is not None:
            parts.append(f"--- coordinator\n{self.coordinator.output[-chars:]}")
        for node in list(self.nodes.values()):
            parts.append(f"--- {node.name} worker ({node.role})\n{node.worker.output[-chars:]}")
            if node.daemon is not None:
                parts.append(f"--- {node.name} daemon\n{node.daemon.output[-chars:]}")
        return "\n".join(parts)

    def mac_rejected_blocks(self) -> int:
        """Stored KV blocks the live workers refused by their MAC (each worker's
        spotinfer_worker_kv_mac_rejected_blocks_total, summed; a dead worker's are gone)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for node in [n for n in list(self.nodes.values()) if n.alive]:
            try:
                with urllib.request.urlopen(node.worker.metrics_url, timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue  # gone since (a drill's last disturbance)
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == MAC_REJECTED_SAMPLE:
                        total += sample.value
        return int(total)

    def active_nodes(self) -> list[Node]:
        """Nodes that can serve (alive, not under a notice): spot nodes before on-demand
        fallback ones, and among them active ones first — as the coordinator sees them,
        since it promotes standbys by itself — then standbys."""
        serving = [n for n in list(self.nodes.values()) if n.alive and n.role != "preempted"]
        active = self._active_worker_ids()
        if active is None:  # the coordinator does not answer (restarting): our own roles
            return sorted(serving, key=lambda n: (n.fallback, n.role != "active"))
        return sorted(serving, key=lambda n: (n.fallback, n.name not in active))

    def spot_nodes(self) -> list[Node]:
        """The serving nodes a cloud can take away (`active_nodes` but the fallback)."""
        return [n for n in self.active_nodes() if not n.fallback]

    def _active_worker_ids(self) -> set[str] | None:
        import grpc

        from protos.spotinfer.v1 import control_pb2

        coordinator = self.coordinator
        if coordinator is None:
            return None
        try:
            listing = coordinator.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=5)
        except (grpc.RpcError, ValueError):  # ValueError: its channel closed (a restart)
            return None
        return {w.worker_id for w in listing.workers if w.role == control_pb2.WORKER_ROLE_ACTIVE}

    def preempt(self, name: str, grace_seconds: float | None = None) -> None:
        """The cloud's termination notice for `name`, in the cloud's own format."""
        node = self.nodes[name]
        grace = grace_seconds if grace_seconds is not None else self.config.grace_seconds
        node.metadata.announce_termination(grace)  # type: ignore[attr-defined]
        node.role = "preempted"
        self._record("notice", name, f"{self.config.cloud}, {grace:g} s")

    def stop_worker(self, name: str) -> None:
        """SIGTERM to the node's worker, as systemd sends it on a scale-in, a GCP managed
        group's delete or a shutdown; the node is gone once the worker has exited (its
        requests moved first). Returns at once; the stop runs on a thread."""
        node = self.nodes[name]
        node.role = "preempted"
        self._record("sigterm", name)
        grace = WORKER_STOP_WAIT_SECONDS

        def stop() -> None:
            node.worker.terminate(grace)
            if node.daemon is not None:
                node.daemon.stop(timeout=1)
            node.alive = False

        threading.Thread(target=stop, name=f"sigterm-{name}", daemon=True).start()

    def drain(self, name: str, grace_seconds: float) -> int:
        """An operator's `Control.Drain` of the node: its requests move as on a notice.
        Returns the in-flight count the coordinator reported."""
        from protos.spotinfer.v1 import control_pb2

        node = self.nodes[name]
        node.role = "preempted"
        self._record("drain", name, f"{grace_seconds:g} s")
        request = control_pb2.DrainWorkerRequest(worker_id=name, grace_seconds=grace_seconds)
        return int(self.coordinator.control.Drain(request, timeout=10).in_flight)

    def scale_in(self, name: str) -> None:
        """The auto scaling group terminates the node itself (scale-in, instance refresh): no
        spot notice, only the target lifecycle state in the node's metadata (AWS only)."""
        node = self.nodes[name]
        if not hasattr(node.metadata, "announce_scale_in"):
            raise ValueError(
                f"a scale-in is an AWS lifecycle state; this cluster is {self.config.cloud}"
            )
        node.metadata.announce_scale_in()
        node.role = "preempted"
        self._record("scale-in", name, f"{self.config.scale_in_seconds:g} s hook wait")

    def terminate(self, name: str) -> None:
        """The end of a grace period (or an unannounced loss): the VM is gone. A no-op once
        the cluster is stopped (a grace timer may outlive the drill)."""
        node = self.nodes.get(name)
        if node is None or not node.alive:
            return
        node.worker.kill()
        if node.daemon is not None:
            node.daemon.stop(timeout=1)
        node.alive = False

    def kill(self, name: str) -> None:
        """SIGKILL with no notice."""
        self._record("kill", name)
        self.terminate(name)

    def restart_redis(self) -> None:
        """Our store dies and comes back empty: the server, or every master of our Redis
        Cluster (formed again on the same ports)."""
        if self.redis is None:
            raise RuntimeError("the cluster uses an outside Redis; it cannot restart it")
        self._record("redis-restart")
        self.redis.restart()

    def restart_coordinator(self, down_seconds: float = 1.0) -> None:
        self._record("coordinator-restart")
        port, http_port = self.coordinator.port, self.coordinator.http_port
        internal_port = self.coordinator.internal_port
        self.coordinator.kill()
        time.sleep(down_seconds)
        self._start_coordinator(port, http_port, internal_port)
        for node in list(self.nodes.values()):
            if node.alive:
                self._register(node)

    def add_standby(self) -> Node | None:
        """A new node joins (a spot VM became available): it loads and waits as a standby.
        None when the cluster was stopped before it was ready."""
        name = self._new_name()
        self._record("join", name)
        joined = self._start_nodes([(name, "standby")])
        return joined[0] if joined else None
