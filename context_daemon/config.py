"""The daemon's one configuration object.

Flags, SPOTINFER_* environment variables and the [daemon] table of a TOML file are derived
from the fields by common.config_source (`CONFIG_SOURCE`): `--notice-source` for
`notice_source`, the field's help as the flag's help.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from common.channels import TransportConfig
from common.config_source import ConfigSource
from context_daemon.constants import (
    AWS_LIFECYCLE_DRAIN_SECONDS,
    DEFAULT_DAEMON_PORT,
    DEFAULT_GRACE_SECONDS,
    DEFAULT_HANDOFF_SECONDS,
    DEFAULT_PEER_MIRROR_BYTES,
    DEFAULT_WORKER_ADDRESS,
    NOTICE_SOURCES,
)
from context_daemon.peer_staging import StagingConfig
from store.store_config import StoreConfig


def _default_daemon_id() -> str:
    return f"daemon-{os.uname().nodename}"


@dataclass(frozen=True)
class DaemonConfig:
    notice_source: str = field(
        default="aws",
        metadata={"help": "where termination notices come from", "choices": NOTICE_SOURCES},
    )
    metadata_url: str = field(
        default="",
        metadata={"help": "base URL of the metadata service; empty: the cloud's own address"},
    )
    notice_file: str = field(
        default="", metadata={"help": "notice source file: the path whose appearance is a notice"}
    )
    azure_vm_name: str = field(
        default="", metadata={"help": "notice source azure: this VM's name in scheduled events"}
    )
    worker_address: str = field(
        default=DEFAULT_WORKER_ADDRESS,
        metadata={"help": "the local worker's gRPC address: host:port or unix:/path"},
    )
    store: StoreConfig = field(
        default_factory=StoreConfig,
        metadata={
            "help": "Redis the worker persists to: the daemon writes what its worker hands "
            "over (--kv-handoff-socket) and reports whether it answers; no URL: none"
        },
    )
    kv_peer_staging_dir: str = field(
        default="",
        metadata={
            "help": "where KV blocks a peer daemon pushed for a migration to this node are "
            "laid out for the worker (its --kv-peer-staging-dir); empty: kept in memory only"
        },
    )
    peer_mirror_bytes: int = field(
        default=DEFAULT_PEER_MIRROR_BYTES,
        metadata={
            "help": "most bytes of handed-over KV kept here to push to a migration's target "
            "daemon on a notice (the least recently used requests go first); 0: none, every "
            "migration's KV goes through Redis"
        },
    )
    kv_handoff_socket: str = field(
        default="",
        metadata={
            "help": "unix socket where the worker's processes hand over KV blocks and a "
            "pause's tokens for this daemon to write (the worker's --kv-handoff-socket); "
            "empty: the worker writes Redis itself"
        },
    )
    transport: TransportConfig = field(
        default_factory=TransportConfig,
        metadata={"help": "TLS of the daemon's server (mutual) and of its calls to the worker"},
    )
    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "address to listen on; 0.0.0.0 on a VM, where the coordinator and peer "
            "daemons reach it (the boot unit passes it)"
        },
    )
    advertise_address: str = field(
        default="",
        metadata={
            "help": "the address others reach this daemon at (the host only); empty: on a "
            "wildcard --host, the VM's private address from the notice source's metadata "
            "service, else --host. The worker registers the daemon's address (its "
            "--daemon-address)"
        },
    )
    port: int = field(
        default=DEFAULT_DAEMON_PORT, metadata={"help": "gRPC port; 0 picks a free one"}
    )
    metrics_port: int = field(
        default=0,
        metadata={"help": "serve Prometheus /metrics on this port (same host); 0: not served"},
    )
    grace_seconds: float = field(
        default=0.0,
        metadata={
            "help": "grace when a notice carries no deadline (GCP: its notice length); "
            "0: the cloud's default (aws 120, gcp 30, azure 30, file 30)"
        },
    )
    handoff_seconds: float = field(
        default=DEFAULT_HANDOFF_SECONDS,
        metadata={
            "help": "with a coordinator that migrates the requests itself (a WatchNotices "
            "subscriber that says so), how long to wait for its Flush after a notice before "
            "flushing anyway (at most half the time left); 0: flush at once"
        },
    )
    lifecycle_drain_seconds: float = field(
        default=AWS_LIFECYCLE_DRAIN_SECONDS,
        metadata={
            "help": "aws: how long an instance its auto scaling group terminates stays in "
            "Terminating:Wait (the lifecycle hook's heartbeat timeout, Terraform's "
            "termination_drain_seconds): the deadline of the notice the target lifecycle "
            "state 'Terminated' gives; 0: the lifecycle state is not watched"
        },
    )
    poll_interval_seconds: float = field(
        default=0.0, metadata={"help": "seconds between metadata polls; 0: the source's default"}
    )
    daemon_id: str = field(
        default_factory=_default_daemon_id, metadata={"help": "name in logs and notices"}
    )
    staging: StagingConfig = field(
        default_factory=StagingConfig,
        metadata={
            "help": "KV blocks peer daemons push to this node (a migration's target), held "
            "in memory until its worker loads them"
        },
    )

    def __post_init__(self) -> None:
        if self.peer_mirror_bytes < 0:
            raise ValueError(
                f"peer_mirror_bytes must not be negative, got {self.peer_mirror_bytes}"
            )
        if self.kv_handoff_socket and not self.store.url:
            raise ValueError("--kv-handoff-socket needs --redis-url: the daemon writes there")
        if self.notice_source not in NOTICE_SOURCES:
            raise ValueError(
                f"notice_source must be one of {NOTICE_SOURCES}, got {self.notice_source!r}"
            )
        if self.notice_source == "file" and not self.notice_file:
            raise ValueError("notice_source file needs notice_file (the path to watch)")
        if self.notice_source == "azure" and not self.azure_vm_name:
            raise ValueError("notice_source azure needs azure_vm_name")
        if self.metadata_url and not self.metadata_url.startswith(("http://", "https://")):
            raise ValueError(f"metadata_url must be an http(s) URL, got {self.metadata_url!r}")
        if not self.worker_address:
            raise ValueError("worker_address must name the local worker")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.lifecycle_drain_seconds < 0:
            raise ValueError("lifecycle_drain_seconds must not be negative")
        if self.grace_seconds < 0 or self.poll_interval_seconds < 0 or self.handoff_seconds < 0:
            raise ValueError(
                "grace_seconds, handoff_seconds and poll_interval_seconds must not be negative"
            )

    @property
    def effective_grace_seconds(self) -> float:
        return self.grace_seconds or DEFAULT_GRACE_SECONDS[self.notice_source]

    def watcher_options(self) -> dict[str, Any]:
        """Constructor options of the notice watcher this config names."""
        options: dict[str, Any] = {}
        if self.poll_interval_seconds:
            options["poll_interval_seconds"] = self.poll_interval_seconds
        if self.notice_source in ("aws", "gcp", "azure") and self.metadata_url:
            options["base_url"] = self.metadata_url
        if self.notice_source == "aws":
            options["lifecycle_drain_seconds"] = self.lifecycle_drain_seconds
        if self.notice_source == "gcp":
            options["notice_seconds"] = self.effective_grace_seconds
        elif self.notice_source == "file":
            options["path"] = self.notice_file
            options["grace_seconds"] = self.effective_grace_seconds
        elif self.notice_source == "azure":
            options["vm_name"] = self.azure_vm_name
        return options


CONFIG_SOURCE = ConfigSource(DaemonConfig, section="daemon")
