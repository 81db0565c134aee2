"""A Terraform-shaped fleet on one machine: Redis, a coordinator and nodes, each a VM
(network namespace) booted by its real boot script and running its real units.

    client VM ──gRPC──▶ coordinator VM ◀──register/renew── node VMs (daemon + worker units)
                               │                               │  metadata server at
                               └──────── rediss:// ────────▶ redis VM   169.254.169.254

`Rehearsal.start` builds the network, starts Redis (TLS + AUTH), makes the fleet's secrets
(cluster CA, each role's TLS bundle, API keys, the KV MAC keyring: `fleet_secrets`), boots
the coordinator VM and the nodes; `add_node` boots one more at any time. The client VM speaks
TLS with a tenant's API key; the rehearsal's own control calls use an operator certificate. The disturbances are what a cloud does:
`notice` (the metadata service announces the termination), `partition` / `heal` (a VM's
link goes down), `cut_off_redis` / `reconnect_redis` (a VM's packets to Redis are lost, the
rest of the network still answers), `restart_coordinator` (its process dies and its unit's Restart= brings it
back). `close` removes every VM and process, also after a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health_pb2_grpc import HealthStub

from common.channels import sync_channel
from protos.spotinfer.v1 import control_pb2, control_pb2_grpc
from spotinfer.fleet.render import parse_env_file
from spotinfer.loadgen import PlannedRequest, RequestTrace
from spotinfer.local.metadata_servers import (
    AwsImds,
    GcpMetadata,
    InstanceIdentity,
    MetadataServer,
)
from spotinfer.rehearsal.boot import BOOT_DIR, BootResult, boot, unit_bodies
from spotinfer.rehearsal.fleet_secrets import FleetSecrets, secret_ids
from spotinfer.rehearsal.forwarder import Forwarder
from spotinfer.rehearsal.netns import (
    METADATA_ADDRESS,
    SUBNET_PREFIX,
    Host,
    Network,
    sweep_leftovers,
)
from spotinfer.rehearsal.streams import Streams, reference, run_streams
from spotinfer.rehearsal.supervisor import UnitSupervisor
from spotinfer.rehearsal.tls_redis import TlsRedis
from spotinfer.rehearsal.unit_file import load_unit
from worker.constants import DEFAULT_LEASE_INTERVAL_SECONDS, DEFAULT_LEASE_TTL_SECONDS

log = logging.getLogger(__name__)

CLOUDS = ("aws", "gcp")
COORDINATOR_UNITS = ("spotinfer-coordinator.service",)
NODE_UNITS = ("spotinfer-daemon.service", "spotinfer-worker.service")
COORDINATOR_PORT = 50051
COORDINATOR_INTERNAL_PORT = 50052  # mutual TLS: registrations and the operator's Control
WORKER_PORT = 50061
DAEMON_PEER_PORT = 50062
# The Terraform modules' defaults (infra/terraform/*/variables.tf).
COORDINATOR_HTTP_PORT = 8000
WORKER_METRICS_PORT = 9400
DAEMON_METRICS_PORT = 9401
METADATA_PORT = 80
# Every address `Network.add_host` can hand out: the one worker certificate names them all.
SUBNET_ADDRESSES = tuple(f"{SUBNET_PREFIX}.{octet}" for octet in range(2, 255))
# What a small CPU rehearsal needs of a worker, given as a systemd drop-in would
# (Environment= of /etc/systemd/system/spotinfer-worker.service.d/rehearsal.conf).
SMALL_WORKER = {
    "SPOTINFER_DTYPE": "float32",
    "SPOTINFER_MAX_MODEL_LEN": "1024",
    "SPOTINFER_MEMORY_GIB": "0.5",
    "SPOTINFER_MAX_NUM_SEQS": "16",
}
UNIT_STOP_SECONDS = 15.0
READY_NODE_WAIT_SECONDS = 60.0  # for a reference run: until a node is READY again
_PROCESS_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
_INSTANCE_TYPES = {"aws": "g5.xlarge", "gcp": "g2-standard-4"}
_ZONES = {"aws": "us-east-1a", "gcp": "us-central1-a"}


@dataclass(frozen=True)
class RehearsalConfig:
    model: Path
    """The model folder every worker loads (Terraform's ``model``)."""
    workdir: Path
    """Where each VM's folder (its /etc, /var/lib, logs) goes."""
    cloud: str = "aws"
    """aws or gcp: which boot script, metadata format and notice."""
    nodes: int = 3
    """Worker VMs booted by `start`."""
    worker_environment: Mapping[str, str] = field(default_factory=lambda: dict(SMALL_WORKER))
    """The worker unit's drop-in Environment= (small engine settings for a CPU)."""
    node_environment: Mapping[str, str] = field(default_factory=dict)
    """Environment= for every node unit (both daemon and worker), e.g. poll intervals."""
    coordinator_environment: Mapping[str, str] = field(default_factory=dict)
    """Environment= for the coordinator unit."""
    lease_interval_seconds: float = DEFAULT_LEASE_INTERVAL_SECONDS
    """Terraform's ``lease_interval_seconds``: how often a worker renews its registration."""
    lease_ttl_seconds: float = DEFAULT_LEASE_TTL_SECONDS
    """Terraform's ``lease_ttl_seconds``: a registration's life without a renewal."""

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {CLOUDS}, got {self.cloud!r}")
        if self.nodes < 0:
            raise ValueError("nodes must not be negative")


@dataclass
class Vm:
    """One rehearsal VM: its namespace, metadata server, what its boot wrote, its units."""

    name: str
    host: Host
    metadata: MetadataServer
    boot: BootResult
    services: dict[str, UnitSupervisor] = field(default_factory=dict)
    booted_at: float = 0.0

    @property
    def environment(self) -> dict[str, str]:
        return parse_env_file(self.boot.env_file.read_text())

    @property
    def worker_id(self) -> str:
        return self.environment.get("SPOTINFER_WORKER_ID", self.name)

    def stop(self, timeout_seconds: float = UNIT_STOP_SECONDS) -> None:
        # systemd stops units in the reverse of their start order: the worker, then its daemon.
        for service in reversed(list(self.services.values())):
            service.stop_for(timeout_seconds)
        with contextlib.suppress(Exception):
            self.metadata.__exit__(None, None, None)


def _terraform_number(value: float) -> str:
    """A number as Terraform prints it in a template: 2, not 2.0."""
    return f"{value:g}"


def unit_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What systemd hands a unit besides its own settings: a PATH, and here the interpreter's
    import path plus the single-thread CPU settings of every test process."""
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    if "PYTHONPATH" in os.environ:
        environment["PYTHONPATH"] = os.environ["PYTHONPATH"]
    environment.update(_PROCESS_ENVIRONMENT)
    environment.update(extra or {})
    return environment


class Rehearsal:
    """``with Rehearsal(RehearsalConfig(model, workdir)) as fleet: fleet.wait_registered()``."""

    def __init__(self, config: RehearsalConfig) -> None:
        self.config = config
        self.network = Network()
        self.vms: dict[str, Vm] = {}
        self.nodes: list[Vm] = []
        self.redis: TlsRedis | None = None
        self.secrets: FleetSecrets | None = None
        self.client: Host | None = None
        self._forwarders: list[Forwarder] = []
        self._channel: grpc.Channel | None = None
        self._node_count = 0
        self.root = config.workdir / self.network.tag

    # -- building --------------------------------------------------------------------

    def start(self) -> Rehearsal:
        sweep_leftovers(alive_only=True)
        self.network.open()
        self.root.mkdir(parents=True, exist_ok=True)
        redis_host = self.network.add_host("redis", metadata_address=False)
        self.redis = TlsRedis(redis_host, self.root / "redis").start()
        coordinator_host = self.network.add_host("coord")
        self.secrets = FleetSecrets.make(
            self.root / "operator",
            secret_ids(self.config.cloud),
            self.redis.password,
            coordinator_hosts=(coordinator_host.address,),
            worker_hosts=SUBNET_ADDRESSES,
        )
        coordinator = self._boot_vm(coordinator_host, "coordinator", COORDINATOR_UNITS)
        self.client = self.network.add_host("client", metadata_address=False)
        self.coordinator = coordinator
        self.coordinator_target = self.forward(
            (coordinator.host.address, COORDINATOR_PORT), "coordinator"
        )
        self.control_target = self.forward(
            (coordinator.host.address, COORDINATOR_INTERNAL_PORT), "coordinator-internal"
        )
        for _ in range(self.config.nodes):
            self.add_node()
        return self

    def _values(self, role: str, units: tuple[str, ...]) -> dict[str, Any]:
        """The variables Terraform passes the boot template (infra/terraform/*/main.tf)."""
        assert self.redis is not None
        coordinator_ip = self.network.hosts["coord"].address
        return {
            "role": role,
            "region": "us-east-1",
            "project": "spotinfer-rehearsal",
            "package": "spotinfer",
            "pip_args": "",
            "model": str(self.config.model),
            "worker_port": WORKER_PORT,
            "daemon_peer_port": DAEMON_PEER_PORT,
            "coordinator_address": f"{coordinator_ip}:{COORDINATOR_INTERNAL_PORT}",
            "coordinator_port": COORDINATOR_PORT,
            "coordinator_http": COORDINATOR_HTTP_PORT,
            "coordinator_internal": COORDINATOR_INTERNAL_PORT,
            "worker_metrics": WORKER_METRICS_PORT,
            "daemon_metrics": DAEMON_METRICS_PORT,
            "lease_interval": _terraform_number(self.config.lease_interval_seconds),
            "lease_ttl": _terraform_number(self.config.lease_ttl_seconds),
            "termination_drain": 120,
            "worker_stop_grace": 25,
            "redis_host": self.redis.host.address,
            "redis_port": self.redis.port,
            **secret_ids(self.config.cloud).values(self.config.cloud),
            "redis_ca_pem": self.redis.tls.ca_cert.read_text().strip(),
            "units": unit_bodies(units),
        }

    def _identity(self, host: Host) -> InstanceIdentity:
        cloud = self.config.cloud
        name = f"i-0{secrets.token_hex(8)}" if cloud == "aws" else f"spotinfer-{host.name}"
        return InstanceIdentity(
            private_ip=host.address,
            instance_id=name,
            instance_type=_INSTANCE_TYPES[cloud],
            zone=_ZONES[cloud],
            spot=host.name != "coord",
        )

    def _boot_vm(self, host: Host, role: str, units: tuple[str, ...]) -> Vm:
        assert self.secrets is not None
        name = host.name
        server_type = AwsImds if self.config.cloud == "aws" else GcpMetadata
        with host.entered():  # the server's socket belongs to the VM
            metadata = server_type(
                identity=self._identity(host), host=METADATA_ADDRESS, port=METADATA_PORT
            )
        metadata.__enter__()
        root = self.root / name
        template = (BOOT_DIR / f"{self.config.cloud}-boot.sh.tftpl").read_text()
        booted_at = time.time()
        result = boot(template, self._values(role, units), root, self.secrets, host.command)
        vm = Vm(name, host, metadata, result, booted_at=booted_at)
        self.vms[name] = vm
        self._start_units(vm, role)
        return vm

    def _start_units(self, vm: Vm, role: str) -> None:
        assert self.redis is not None
        # The VM trusts the Redis CA as a cloud image trusts the provider's (its trust store);
        # the GCP boot script also names it in the URL, as Memorystore needs.
        base = unit_environment({"SSL_CERT_FILE": str(self.redis.tls.ca_cert)})
        for name in vm.boot.enabled:
            overrides: dict[str, str] = {}
            if role == "coordinator":
                overrides.update(self.config.coordinator_environment)
            if role == "worker":
                overrides.update(self.config.node_environment)
                if name == "spotinfer-worker.service":
                    overrides.update(self.config.worker_environment)
            service = UnitSupervisor(
                load_unit(vm.boot.units[name]),
                vm.boot.root / "var" / "log" / f"{name}.log",
                wrap=vm.host.command,
                paths=vm.boot.map(),
                base_environment=base,
                overrides=overrides,
            )
            vm.services[name] = service.start()

    def add_node(self) -> Vm:
        """Boot one more worker VM (its daemon and worker units start, nothing else is told)."""
        self._node_count += 1
        host = self.network.add_host(f"node{self._node_count}")
        vm = self._boot_vm(host, "worker", NODE_UNITS)
        self.nodes.append(vm)
        return vm

    def forward(self, target: tuple[str, int], label: str) -> str:
        """A gRPC target (``unix:...``) whose connections leave from the client VM."""
        assert self.client is not None
        forwarder = Forwarder(self.client, target, self.root / f"{label}.sock")
        self._forwarders.append(forwarder.__enter__())
        return forwarder.target

    # -- looking ---------------------------------------------------------------------

    def _control_channel(self) -> grpc.Channel:
        if self._channel is None:
            assert self.secrets is not None
            self._channel = sync_channel(
                self.control_target, transport=self.secrets.operator_transport
            )
        return self._channel

    @property
    def control(self) -> control_pb2_grpc.ControlStub:
        return control_pb2_grpc.ControlStub(self._control_channel())

    def known_workers(self) -> dict[str, Any]:
        """The coordinator's ListWorkers, by worker id; empty while it does not answer."""
        try:
            reply = self.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=5)
        except grpc.RpcError:
            return {}
        return {worker.worker_id: worker for worker in reply.workers}

    def wait_registered(self, vms: list[Vm] | None = None, timeout_seconds: float = 300) -> float:
        """Wait until the coordinator knows every node in `vms` (default: all); the time it
        took. RuntimeError with the units' logs when it does not happen in time."""
        wanted = {vm.worker_id for vm in (vms if vms is not None else self.nodes)}
        start = time.monotonic()
        while not wanted <= set(self.known_workers()):
            if time.monotonic() - start > timeout_seconds:
                raise RuntimeError(
                    f"not registered after {timeout_seconds:g}s: "
                    f"{sorted(wanted - set(self.known_workers()))}\n{self.logs_tail()}"
                )
            time.sleep(0.5)
        return time.monotonic() - start

    def coordinator_serving(self) -> bool:
        """Its health says SERVING (it has a worker to route to)."""
        return self._coordinator_health() == health_pb2.HealthCheckResponse.SERVING

    def coordinator_answers(self) -> bool:
        """Its process is up and answers health checks (SERVING or not yet)."""
        return self._coordinator_health() is not None

    def _coordinator_health(self) -> int | None:
        try:
            reply = HealthStub(self._control_channel()).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return None
        return int(reply.status)

    def logs_tail(self, chars: int = 3000) -> str:
        parts = []
        for vm in self.vms.values():
            for name, service in vm.services.items():
                parts.append(f"--- {vm.name} {name} (starts {len(service.starts)})\n")
                parts.append(service.output[-chars:])
        return "".join(parts)

    def greedy_reference(self, planned: Sequence[PlannedRequest]) -> dict[str, list[int]]:
        """The requests' greedy outputs straight from one ready worker (its worker port, from
        the client VM): what every stream must equal."""
        vm = self._ready_node()
        target = self.forward((vm.host.address, WORKER_PORT), f"worker-{vm.name}")
        assert self.secrets is not None
        return reference(target, planned, self.secrets.operator_transport)

    def _ready_node(self, timeout_seconds: float = READY_NODE_WAIT_SECONDS) -> Vm:
        """A node the coordinator calls READY (a noticed one takes no new request); waits
        while none is (one may be re-registering after a disturbance)."""
        ready = control_pb2.WORKER_STATE_READY
        deadline = time.monotonic() + timeout_seconds
        while True:
            known = self.known_workers()
            for vm in self.nodes:
                if vm.worker_id in known and known[vm.worker_id].state == ready:
                    return vm
            if time.monotonic() > deadline:
                states = {w: control_pb2.WorkerState.Name(k.state) for w, k in known.items()}
                raise RuntimeError(
                    f"no READY node within {timeout_seconds:g} s: {states}\n{self.logs_tail()}"
                )
            time.sleep(0.5)

    def streams(
        self,
        planned: Sequence[PlannedRequest],
        on_done: Callable[[RequestTrace], None] | None = None,
    ) -> Streams:
        """`planned` from the client VM through the coordinator (TLS, the tenant's API key),
        in a thread of their own; call ``start()``."""
        assert self.secrets is not None
        return Streams(
            self.coordinator_target,
            planned,
            on_done=on_done,
            transport=self.secrets.client_transport,
            api_key=self.secrets.api_key,
        )

    def run_streams(self, planned: Sequence[PlannedRequest]) -> list[RequestTrace]:
        """`streams`, waited for."""
        assert self.secrets is not None
        return run_streams(
            self.coordinator_target,
            planned,
            transport=self.secrets.client_transport,
            api_key=self.secrets.api_key,
        )

    def node_named(self, worker_id: str) -> Vm:
        return next(vm for vm in self.nodes if vm.worker_id == worker_id)

    # -- disturbing ------------------------------------------------------------------

    def notice(self, vm: Vm, grace_seconds: float = 120.0) -> None:
        """The cloud announces `vm`'s termination on its metadata service."""
        vm.metadata.announce_termination(grace_seconds)  # type: ignore[attr-defined]

    def partition(self, vm: Vm) -> None:
        self.network.partition(vm.host)

    def heal(self, vm: Vm) -> None:
        self.network.heal(vm.host)

    def cut_off_redis(self, vm: Vm) -> None:
        """`vm` loses Redis (its packets there are dropped) but still reaches every other VM."""
        assert self.redis is not None
        self.network.cut_off(vm.host, self.redis.host.address)

    def reconnect_redis(self, vm: Vm) -> None:
        assert self.redis is not None
        self.network.reconnect(vm.host, self.redis.host.address)

    def terminate(self, vm: Vm) -> None:
        """The cloud takes `vm` away (the end of a grace period): its units stop as a
        shutdown stops them, then the VM and its link are gone."""
        vm.stop()
        self.nodes.remove(vm)
        del self.vms[vm.name]
        self.network.remove_host(vm.host)

    def restart_coordinator(self) -> None:
        """The coordinator process dies (SIGKILL); its unit's Restart= starts it again."""
        service = self.coordinator.services[COORDINATOR_UNITS[0]]
        service.kill()

    # -- ending ----------------------------------------------------------------------

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        for vm in reversed(list(self.vms.values())):
            with contextlib.suppress(Exception):
                vm.stop()
        for forwarder in self._forwarders:
            forwarder.__exit__(None, None, None)
        if self.redis is not None:
            self.redis.stop()
        self.network.close()

    def __enter__(self) -> Rehearsal:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
