"""The coordinator's one configuration object.

Flags, SPOTINFER_* environment variables and the [coordinator] table of a TOML file are
derived from the fields by common.config_source (`CONFIG_SOURCE`): `--max-seqs-per-worker`
for `max_seqs_per_worker`, help from the field's metadata. Tuple fields are repeatable flags
named in the singular (`--worker ADDR --worker ADDR`).

A worker flag may name the worker's context daemon after an ``=``:
``--worker 10.0.0.5:50061=10.0.0.5:50071``. The coordinator then subscribes to the daemon's
notices (live migration) and InjectNotice asks that daemon to flush.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path

from common.authz import AccessConfig
from common.channels import TransportConfig
from common.config_source import ConfigSource, unique_name
from common.messages import POOL_CLOUDS
from common.tuning_file import load_tuning_file
from coordinator.batch_controller import BatchControllerConfig
from coordinator.constants import (
    DEFAULT_BATCH_LINES_IN_FLIGHT,
    DEFAULT_BATCH_QUEUE_CAPACITY,
    DEFAULT_CAPACITY_WAIT_SECONDS,
    DEFAULT_DISCONNECT_GRACE_SECONDS,
    DEFAULT_FAILOVER_POLICY,
    DEFAULT_GRPC_PORT,
    DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
    DEFAULT_HTTP_PORT,
    DEFAULT_INTERACTIVE_QUEUE_CAPACITY,
    DEFAULT_INTERNAL_PORT,
    DEFAULT_LOST_AFTER_SECONDS,
    DEFAULT_MAX_LEASE_TTL_SECONDS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_REBALANCE_POLICY,
    DEFAULT_RECORD_RETENTION_SECONDS,
    DEFAULT_RECORD_TTL_SECONDS,
    DEFAULT_RETENTION_SECONDS,
    DEFAULT_RETRY_AFTER_MS,
    DEFAULT_ROUTING_POLICY,
    DEFAULT_STANDBY_POOL_SIZE,
    MAX_STOP_GRACE_SECONDS,
    NOTICE_DEFAULT_GRACE_SECONDS,
    REBALANCE_POLICIES,
    SERVER_STOP_GRACE_SECONDS,
)
from store.store_config import StoreConfig


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to listen on; 0.0.0.0 on a VM (the boot unit passes it)"},
    )
    advertise_address: str = field(
        default="",
        metadata={
            "help": "the address other coordinators reach this one at (route records); "
            "empty: from the --cloud metadata service, else --host"
        },
    )
    cloud: str = field(
        default="",
        metadata={
            "help": "aws | gcp | azure: the advertised address defaults to the VM's private "
            "address from that cloud's metadata service; empty: not on a cloud"
        },
    )
    port: int = field(default=DEFAULT_GRPC_PORT, metadata={"help": "gRPC port; 0 picks a free one"})
    http_port: int = field(
        default=DEFAULT_HTTP_PORT,
        metadata={"help": "OpenAI-compatible HTTP port; 0 picks a free one"},
    )
    serve_http: bool = field(default=True, metadata={"help": "serve the HTTP front"})
    workers: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "worker",
            "metavar": "ADDR[=DAEMON]",
            "help": "an active worker, host:port, or host:port=DAEMON_HOST:PORT to also name "
            "its context daemon (notices, live migration); repeatable",
        },
    )
    standbys: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "standby",
            "metavar": "ADDR[=DAEMON]",
            "help": "a warm standby worker, written as for --worker; repeatable",
        },
    )
    model: str = field(
        default="",
        metadata={
            "help": "the model folder the workers serve: its tokenizer tokenizes text prompts "
            "and applies the chat template; empty: the model the first worker registered "
            "with (token-id prompts only until one has)"
        },
    )
    model_fingerprint: str = field(
        default="",
        metadata={
            "help": "the model fingerprint every registering worker must serve; empty: the "
            "first worker to register fixes it (see coordinator/fleet_model.py)"
        },
    )
    served_model_name: str = field(
        default="", metadata={"help": "model name on the HTTP front; empty: the folder's name"}
    )
    coordinator_id: str = field(
        default_factory=functools.partial(unique_name, "coordinator"),
        metadata={"help": "name in the cluster"},
    )
    routing_policy: str = field(
        default=DEFAULT_ROUTING_POLICY, metadata={"help": "how a worker is picked for a request"}
    )
    failover_policy: str = field(
        default=DEFAULT_FAILOVER_POLICY,
        metadata={"help": "what happens to a request whose worker stream broke"},
    )
    rebalance_policy: str = field(
        default=DEFAULT_REBALANCE_POLICY,
        metadata={
            "help": "on an AWS rebalance recommendation: ignore, or migrate the worker's "
            f"requests before any notice (within {NOTICE_DEFAULT_GRACE_SECONDS:g} s)"
        },
    )
    interactive_queue_capacity: int = field(
        default=DEFAULT_INTERACTIVE_QUEUE_CAPACITY,
        metadata={"help": "most INTERACTIVE requests waiting for a worker slot"},
    )
    batch_queue_capacity: int = field(
        default=DEFAULT_BATCH_QUEUE_CAPACITY,
        metadata={"help": "most BATCH requests waiting for a worker slot"},
    )
    max_seqs_per_worker: int = field(
        default=0,
        metadata={"help": "most requests in flight on one worker; 0: its max_num_seqs"},
    )
    tuning_file: str = field(
        default="",
        metadata={
            "help": "a file written by `spotinfer tune --apply`: each class's chosen "
            "max_num_seqs becomes its per-worker cap (explicit per-class flags win)"
        },
    )
    interactive_max_per_worker: int = field(
        default=0,
        metadata={"help": "most INTERACTIVE requests on one worker; 0: no class cap"},
    )
    batch_max_per_worker: int = field(
        default=0, metadata={"help": "most BATCH requests on one worker; 0: no class cap"}
    )
    batch_lines_in_flight: int = field(
        default=DEFAULT_BATCH_LINES_IN_FLIGHT,
        metadata={
            "help": "lines of one Batch API job running at once (BATCH requests; the "
            "admission caps then set each worker's workload batch)"
        },
    )
    batch_controller: BatchControllerConfig = field(
        default_factory=BatchControllerConfig,
        metadata={
            "help": "the adaptive workload-batch controller: moves each worker's per-class "
            "caps at run time from measured TTFT / TPOT against the INTERACTIVE SLO, starting "
            "from the static caps (the tuning file's)"
        },
    )
    retry_after_ms: int = field(
        default=DEFAULT_RETRY_AFTER_MS,
        metadata={"help": "base retry hint for a client whose queue was full"},
    )
    capacity_wait_seconds: float = field(
        default=DEFAULT_CAPACITY_WAIT_SECONDS,
        metadata={
            "help": "how long a request that arrives while no worker is ready (and no standby "
            "can be promoted) waits in its queue for one, e.g. a replacement VM booting, "
            "before it is refused (RESOURCE_EXHAUSTED / 429 with the retry hint); checked at "
            "every heartbeat. 0: refused at once (UNAVAILABLE / 503). Requests already "
            "admitted that wait to move are never refused"
        },
    )
    heartbeat_interval_seconds: float = field(
        default=DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
        metadata={"help": "how often each worker's Stats is polled"},
    )
    lost_after_seconds: float = field(
        default=DEFAULT_LOST_AFTER_SECONDS,
        metadata={"help": "a worker silent this long is lost"},
    )
    disconnect_grace_seconds: float = field(
        default=DEFAULT_DISCONNECT_GRACE_SECONDS,
        metadata={
            "help": "a running INTERACTIVE request whose every client left (HTTP hang-up, "
            "cancelled gRPC call) is cancelled on its worker after this long unless one "
            "attaches again; inf: it runs to its end. BATCH requests always run to their end"
        },
    )
    max_lease_ttl_seconds: float = field(
        default=DEFAULT_MAX_LEASE_TTL_SECONDS,
        metadata={
            "help": "the longest lease a registering worker may hold (it asks for its own "
            "--lease-ttl-seconds); a worker not renewed within it takes no new request"
        },
    )
    standby_pool_size: int = field(
        default=DEFAULT_STANDBY_POOL_SIZE,
        metadata={"help": "warm standbys to keep; fewer ready is logged as a warning"},
    )
    retention_seconds: float = field(
        default=DEFAULT_RETENTION_SECONDS,
        metadata={"help": "how long a finished request stays attachable"},
    )
    store: StoreConfig = field(
        default_factory=StoreConfig,
        metadata={"help": "Redis for request records and the requests' tokens"},
    )
    record_ttl_seconds: int = field(
        default=DEFAULT_RECORD_TTL_SECONDS,
        metadata={"help": "lifetime of a running request's record in Redis"},
    )
    record_retention_seconds: float = field(
        default=DEFAULT_RECORD_RETENTION_SECONDS,
        metadata={"help": "how long a finished request's record stays in Redis"},
    )
    max_message_bytes: int = field(
        default=DEFAULT_MAX_MESSAGE_BYTES, metadata={"help": "largest gRPC message accepted"}
    )
    transport: TransportConfig = field(
        default_factory=TransportConfig,
        metadata={
            "help": "TLS: the public port and the HTTP front serve it (no client certificate), "
            "the internal port and every call to workers, daemons and coordinators are mutual"
        },
    )
    internal_port: int = field(
        default=DEFAULT_INTERNAL_PORT,
        metadata={
            "help": "with TLS, the mutual-TLS port for cluster nodes and operators "
            "(RegisterWorker, coordinator to coordinator); 0 picks a free one"
        },
    )
    api_keys: AccessConfig = field(
        default_factory=AccessConfig,
        metadata={"help": "API keys of the public API and their per-key limits"},
    )
    stop_grace_seconds: float = field(
        default=SERVER_STOP_GRACE_SECONDS,
        metadata={
            "help": "on SIGTERM, how long the clients' open streams still run before they are "
            "cut (UNAVAILABLE: they re-attach elsewhere or to the restarted coordinator); "
            "their workers then pause the requests"
        },
    )
    allow_no_keys: bool = field(
        default=False,
        metadata={
            "help": "serve without API keys on a non-loopback address (a private network "
            "that does its own access control)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("port", "http_port", "internal_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")
        for value in (*self.workers, *self.standbys):
            split_worker_flag(value)
        if self.batch_lines_in_flight < 1:
            raise ValueError("batch_lines_in_flight must be at least 1")
        for name in ("interactive_queue_capacity", "batch_queue_capacity", "record_ttl_seconds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "max_seqs_per_worker",
            "interactive_max_per_worker",
            "batch_max_per_worker",
            "retry_after_ms",
            "standby_pool_size",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.rebalance_policy not in REBALANCE_POLICIES:
            raise ValueError(
                f"rebalance_policy must be one of {REBALANCE_POLICIES}, "
                f"got {self.rebalance_policy!r}"
            )
        if not math.isfinite(self.capacity_wait_seconds) or self.capacity_wait_seconds < 0:
            raise ValueError(
                "capacity_wait_seconds must be a finite number of seconds >= 0 (0: refuse at "
                f"once), got {self.capacity_wait_seconds}"
            )
        if self.heartbeat_interval_seconds <= 0:
            raise ValueError("heartbeat_interval_seconds must be positive")
        if self.lost_after_seconds <= self.heartbeat_interval_seconds:
            raise ValueError(
                f"lost_after_seconds ({self.lost_after_seconds}) must be longer than "
                f"heartbeat_interval_seconds ({self.heartbeat_interval_seconds})"
            )
        if math.isnan(self.disconnect_grace_seconds) or self.disconnect_grace_seconds < 0:
            raise ValueError(
                "disconnect_grace_seconds must be a number of seconds >= 0 (inf: never "
                f"cancel), got {self.disconnect_grace_seconds}"
            )
        if self.max_lease_ttl_seconds <= 0:
            raise ValueError("max_lease_ttl_seconds must be positive")
        if self.retention_seconds < 0:
            raise ValueError("retention_seconds must not be negative")
        if not 0 <= self.stop_grace_seconds <= MAX_STOP_GRACE_SECONDS:
            raise ValueError(
                f"stop_grace_seconds must be in [0, {MAX_STOP_GRACE_SECONDS:g}], "
                f"got {self.stop_grace_seconds}"
            )
        if self.record_retention_seconds <= 0:
            raise ValueError("record_retention_seconds must be positive")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        if self.cloud not in ("", *POOL_CLOUDS):
            raise ValueError(f"cloud must be one of {POOL_CLOUDS} or empty, got {self.cloud!r}")
        if not self.coordinator_id:
            raise ValueError("coordinator_id must not be empty")
        if not self.api_keys.file and not self.allow_no_keys and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without API keys: give --api-keys-file "
                "(see `spotinfer keys add`), bind 127.0.0.1, or say --allow-no-keys"
            )
        if self.transport.tls and not self.transport.can_serve_tls:
            raise ValueError("a coordinator with TLS needs --transport-cert-file and key file")

    @property
    def model_name(self) -> str:
        """The name clients use for the model on the HTTP front."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if self.model else "spotinfer"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or name (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(address: str) -> None:
    """``host:port`` with a port in range; raises ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"worker address must be host:port, got {address!r}")


def split_worker_flag(value: str) -> tuple[str, str]:
    """``host:port`` or ``host:port=daemon_host:port`` -> (worker, daemon or "");
    raises ValueError for anything else."""
    address, _, daemon_address = value.partition("=")
    check_address(address)
    if daemon_address:
        try:
            check_address(daemon_address)
        except ValueError:
            raise ValueError(
                f"daemon address must be host:port, got {daemon_address!r} in {value!r}"
            ) from None
    return address, daemon_address


def apply_tuning_file(config: CoordinatorConfig) -> CoordinatorConfig:
    """The per-class caps from `config.tuning_file`, where no explicit flag set them."""
    if not config.tuning_file:
        return config
    classes = load_tuning_file(Path(config.tuning_file)).get("classes", {})
    interactive = config.interactive_max_per_worker or int(
        classes.get("interactive", {}).get("max_num_seqs", 0)
    )
    batch = config.batch_max_per_worker or int(classes.get("batch", {}).get("max_num_seqs", 0))
    return dataclasses.replace(
        config, interactive_max_per_worker=interactive, batch_max_per_worker=batch
    )


CONFIG_SOURCE = ConfigSource(CoordinatorConfig, section="coordinator")
