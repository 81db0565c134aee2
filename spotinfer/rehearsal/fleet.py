"""A Terraform-shaped fleet on one machine: Redis, a coordinator and nodes, each a VM
(network namespace) booted by its real boot script and running its real units.

    client VM ──gRPC──▶ coordinator VM ◀──register/renew── node VMs (daemon + worker units)
                               │                               │  metadata server at
                               └──────── rediss:// ────────▶ redis VM   169.254.169.254

`Rehearsal.start` builds the network, starts Redis (TLS + AUTH), boots the coordinator VM
and the nodes; `add_node` boots one more at any time. The disturbances are what a cloud does:
`notice` (the metadata service announces the termination), `partition` / `heal` (a VM's
link goes down), `restart_coordinator` (its process dies and its unit's Restart= brings it
back). `close` removes every VM and process, also after a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
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
from spotinfer.loadgen import PlannedRequest
from spotinfer.local.metadata_servers import (
    AwsImds,
    GcpMetadata,
    InstanceIdentity,
    MetadataServer,
)
from spotinfer.rehearsal.boot import BOOT_DIR, BootResult, boot, unit_bodies
from spotinfer.rehearsal.forwarder import Forwarder
from spotinfer.rehearsal.netns import METADATA_ADDRESS, Host, Network, sweep_leftovers
from spotinfer.rehearsal.streams import reference
from spotinfer.rehearsal.supervisor import UnitSupervisor
from spotinfer.rehearsal.tls_redis import TlsRedis
from spotinfer.rehearsal.unit_file import load_unit
from worker.constants import DEFAULT_LEASE_INTERVAL_SECONDS, DEFAULT_LEASE_TTL_SECONDS

log = logging.getLogger(__name__)

CLOUDS = ("aws", "gcp")
COORDINATOR_UNITS = ("spotinfer-coordinator.service",)
NODE_UNITS = ("spotinfer-daemon.service", "spotinfer-worker.service")
COORDINATOR_PORT = 50051
WORKER_PORT = 50061
DAEMON_PEER_PORT = 50062
# The Terraform modules' defaults (infra/terraform/*/variables.tf).
COORDINATOR_HTTP_PORT = 8000
WORKER_METRICS_PORT = 9400
DAEMON_METRICS_PORT = 9401
METADATA_PORT = 80
# What a small CPU rehearsal needs of a worker, given as a systemd drop-in would
# (Environment= of /etc/systemd/system/spotinfer-worker.service.d/rehearsal.conf).
SMALL_WORKER = {
    "SPOTINFER_DTYPE": "float32",
    "SPOTINFER_MAX_MODEL_LEN": "1024",
    "SPOTINFER_MEMORY_GIB": "0.5",
    "SPOTINFER_MAX_NUM_SEQS": "16",
}
UNIT_STOP_SECONDS = 15.0
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
        coordinator = self._boot_vm("coord", "coordinator", COORDINATOR_UNITS)
        self.client = self.network.add_host("client", metadata_address=False)
        self.coordinator = coordinator
        self.coordinator_target = self.forward(
            (coordinator.host.address, COORDINATOR_PORT), "coordinator"
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
            "coordinator_address": f"{coordinator_ip}:{COORDINATOR_PORT}",
            "coordinator_port": COORDINATOR_PORT,
            "coordinator_http": COORDINATOR_HTTP_PORT,
            "worker_metrics": WORKER_METRICS_PORT,
            "daemon_metrics": DAEMON_METRICS_PORT,
            "lease_interval": _terraform_number(self.config.lease_interval_seconds),
            "lease_ttl": _terraform_number(self.config.lease_ttl_seconds),
            "redis_host": self.redis.host.address,
            "redis_port": self.redis.port,
            "redis_secret_arn": "arn:aws:secretsmanager:us-east-1:000000000000:secret:redis",
            "redis_secret_id": "redis-auth",
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

    def _boot_vm(self, name: str, role: str, units: tuple[str, ...]) -> Vm:
        assert self.redis is not None
        host = self.network.add_host(name)
        server_type = AwsImds if self.config.cloud == "aws" else GcpMetadata
        with host.entered():  # the server's socket belongs to the VM
            metadata = server_type(
                identity=self._identity(host), host=METADATA_ADDRESS, port=METADATA_PORT
            )
        metadata.__enter__()
        root = self.root / name
        template = (BOOT_DIR / f"{self.config.cloud}-boot.sh.tftpl").read_text()
        booted_at = time.time()
        result = boot(template, self._values(role, units), root, self.redis.password, host.command)
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
        vm = self._boot_vm(f"node{self._node_count}", "worker", NODE_UNITS)
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
            self._channel = sync_channel(self.coordinator_target)
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
        try:
            reply = HealthStub(self._control_channel()).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

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
        known = self.known_workers()
        ready = control_pb2.WORKER_STATE_READY  # a noticed node takes no new request
        vm = next(
            vm for vm in self.nodes if vm.worker_id in known and known[vm.worker_id].state == ready
        )
        target = self.forward((vm.host.address, WORKER_PORT), f"worker-{vm.name}")
        return reference(target, planned)

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
