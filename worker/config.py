"""The worker's one configuration object.

Flags, SPOTINFER_* environment variables and the [worker] table of a TOML file are derived
from the fields by common.config_source (`CONFIG_SOURCE`), so a new field is a new flag with
its help as the flag's help. `engine_environment` is the one place here that reads the
environment itself (what vLLM needs, not settings of the worker).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from common.channels import TransportConfig
from common.config_source import ConfigSource, unique_name
from common.messages import KvPersistence, PoolLabels
from common.validation import check_host_port
from store.store_config import StoreConfig
from worker.constants import (
    BYTES_PER_MB,
    DEFAULT_DRAIN_GRACE_SECONDS,
    DEFAULT_KV_CHUNK_TOKENS,
    DEFAULT_LEASE_INTERVAL_SECONDS,
    DEFAULT_LEASE_TTL_SECONDS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STAGING_MIB,
    DTYPES,
    KV_LOAD_MODES,
    KV_PERSIST_POLICIES,
    SCHEDULING_POLICIES,
)


@dataclass(frozen=True)
class WorkerConfig:
    model: str = field(metadata={"help": "HF-format model folder (or hub id where reachable)"})
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to listen on; 0.0.0.0 on a VM (the boot unit passes it)"},
    )
    port: int = field(default=50061, metadata={"help": "gRPC port; 0 picks a free one"})
    advertise_address: str = field(
        default="",
        metadata={
            "help": "the address the coordinator reaches this worker at (the host only; the "
            "port is --port's); empty: the VM's private address from the --cloud metadata "
            "service, else --host"
        },
    )
    metadata_url: str = field(
        default="",
        metadata={"help": "base URL of the metadata service; empty: the cloud's own address"},
    )
    coordinators: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "coordinator",
            "metavar": "ADDR[,ADDR...]",
            "help": "coordinator(s) to register with once the engine is ready, host:port, "
            "comma-separated or repeated (replicas: every one is renewed), or one DNS name / "
            "load balancer; none: wait to be registered (--worker on the coordinator)",
        },
    )
    daemon_address: str = field(
        default="",
        metadata={
            "help": "this worker's context daemon as the coordinator reaches it, host:port, "
            "or :PORT for the advertised address; empty: none (no notices reach the "
            "coordinator)"
        },
    )
    standby: bool = field(
        default=False, metadata={"help": "register as a warm standby, not an active worker"}
    )
    pool: PoolLabels = field(
        default_factory=PoolLabels,
        metadata={"help": "where the worker runs, sent with its registration"},
    )
    lease_interval_seconds: float = field(
        default=DEFAULT_LEASE_INTERVAL_SECONDS,
        metadata={"help": "how often the registration is renewed"},
    )
    lease_ttl_seconds: float = field(
        default=DEFAULT_LEASE_TTL_SECONDS,
        metadata={
            "help": "how long the coordinator keeps the registration without a renewal; past "
            "it the worker gets no new request until it registers again"
        },
    )
    metrics_port: int = field(
        default=0,
        metadata={"help": "serve Prometheus /metrics on this port (same host); 0: not served"},
    )
    unix_socket: str = field(
        default="",
        metadata={
            "help": "also listen on this unix socket path (the local context daemon's "
            "channel); empty: TCP only"
        },
    )
    worker_id: str = field(
        default_factory=functools.partial(unique_name, "worker"),
        metadata={
            "help": "name in the cluster, and the node its daemon's certificate names "
            "(spiffe://spotinfer/node/<worker id>) for Preempt, Resume and Prefetch"
        },
    )
    dtype: str = field(default="auto", metadata={"help": "weights/KV dtype", "choices": DTYPES})
    max_model_len: int = field(
        default=DEFAULT_MAX_MODEL_LEN, metadata={"help": "context length (prompt + output)"}
    )
    max_num_seqs: int = field(
        default=DEFAULT_MAX_NUM_SEQS,
        metadata={"help": "most sequences in one engine step (the workload batch size)"},
    )
    max_num_batched_tokens: int = field(
        default=0, metadata={"help": "most tokens in one engine step; 0: vLLM's default"}
    )
    kv_cache_bytes: int = field(
        default=0,
        metadata={"help": "KV cache size in bytes; 0: planned from --memory-gib, else vLLM's"},
    )
    memory_gib: float = field(
        default=0.0,
        metadata={
            "help": "memory this worker may use for weights + KV (+10%% reserve); sizes the KV "
            "cache and caps max_num_seqs so peak concurrency fits"
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "GPU: fraction of device memory vLLM may use"}
    )
    tensor_parallel_size: int = field(default=1, metadata={"help": "tensor parallel degree"})
    enforce_eager: bool | None = field(
        default=None,
        metadata={"help": "skip CUDA graph capture; unset: on CPU only (on GPU, graphs stay on)"},
    )
    enable_prefix_caching: bool = field(
        default=False,
        metadata={
            "help": "share KV prefix blocks across requests (vLLM's automatic prefix "
            "caching); without it, only a migrating request's own warmed blocks are reused"
        },
    )
    seed: int = field(default=0, metadata={"help": "engine seed"})
    scheduling_policy: str = field(
        default="priority",
        metadata={
            "help": "the engine's order of waiting requests; priority: every INTERACTIVE "
            "request before every BATCH one, then the request's own priority, then arrival "
            "(vLLM priority scheduling); fcfs: arrival alone (a request that sets a priority "
            "is refused)",
            "choices": SCHEDULING_POLICIES,
        },
    )
    tuning_file: str = field(
        default="",
        metadata={
            "help": "a file written by `spotinfer tune --apply`: its worker max_num_seqs is "
            "used unless --max-num-seqs is given"
        },
    )
    max_tokens_limit: int = field(
        default=0, metadata={"help": "largest max_tokens a request may ask; 0: max_model_len"}
    )
    drain_grace_seconds: float = field(
        default=DEFAULT_DRAIN_GRACE_SECONDS,
        metadata={"help": "on SIGTERM, how long in-flight requests may run before they are cut"},
    )
    max_message_bytes: int = field(
        default=DEFAULT_MAX_MESSAGE_BYTES, metadata={"help": "largest gRPC message accepted"}
    )
    store: StoreConfig = field(
        default_factory=StoreConfig,
        metadata={"help": "Redis for token commits and KV blocks; no URL: no persistence"},
    )
    transport: TransportConfig = field(
        default_factory=TransportConfig,
        metadata={"help": "TLS of the worker's server: mutual, clients need a cluster certificate"},
    )
    staging_mib: int = field(
        default=DEFAULT_STAGING_MIB,
        metadata={
            "help": "host memory for KV blocks prefetched as a migration target, before the "
            "source pauses (Worker.Prefetch); 0: refuse prefetches"
        },
    )
    staging_dir: str = field(
        default="",
        metadata={"help": "where staged blocks live; empty: a private folder on /dev/shm"},
    )
    kv_handoff_socket: str = field(
        default="",
        metadata={
            "help": "the node's context daemon persists KV blocks and a pause's tokens: the "
            "unix socket it listens on (its --kv-handoff-socket); empty: this process writes "
            "them to Redis itself"
        },
    )
    kv_peer_staging_dir: str = field(
        default="",
        metadata={
            "help": "where the node's daemon puts the KV blocks a peer daemon pushed for a "
            "migration to this worker (its --kv-peer-staging-dir); resumes read them there "
            "before the store; empty: no peer migration to this worker"
        },
    )
    kv_persist_policy: str = field(
        default="eager",
        metadata={
            "help": "which KV blocks go to Redis; eager: every block once it is full (an "
            "unannounced loss recomputes only the last partial block), lazy: none until a "
            "termination notice (then all of them), hybrid: as they fill up to "
            "--kv-persist-rate-mb-s, the rest at a notice, off: none (tokens are committed "
            "under every policy)",
            "choices": KV_PERSIST_POLICIES,
        },
    )
    kv_persist_rate_mb_s: float | None = field(
        default=None,
        metadata={
            "help": "hybrid only, and required there: most megabytes (10^6 bytes) per second "
            "of KV blocks written to Redis as they fill (every rank's shards counted); a "
            "request's blocks go in order, the request with most blocks unsaved first"
        },
    )
    kv_load: str = field(
        default="async",
        metadata={
            "help": "how a resume reads its stored KV; async: off the engine's step (other "
            "sequences decode on while Redis is read), sync: inside it (the baseline)",
            "choices": KV_LOAD_MODES,
        },
    )
    allow_other_vllm: bool = field(
        default=False,
        metadata={
            "help": "load the spot KV connector on a vLLM outside the release line it supports "
            "(its internals may differ)"
        },
    )
    kv_chunk_tokens: int = field(
        default=DEFAULT_KV_CHUNK_TOKENS,
        metadata={
            "help": "tokens of KV stored as one Redis value (a multiple of vLLM's block size; "
            "the connector refuses another)"
        },
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model folder or id")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.unix_socket.startswith("unix:"):
            raise ValueError("unix_socket is a path; leave out the unix: prefix")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "tensor_parallel_size", "kv_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_num_batched_tokens", "kv_cache_bytes", "max_tokens_limit", "staging_mib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.memory_gib < 0:
            raise ValueError(f"memory_gib must not be negative, got {self.memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.drain_grace_seconds < 0:
            raise ValueError("drain_grace_seconds must not be negative")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")
        for address in self.coordinator_addresses:
            check_host_port(address, "coordinator")
        if self.daemon_address and not self.daemon_address.startswith(":"):
            check_host_port(self.daemon_address, "daemon_address")
        if self.lease_interval_seconds <= 0:
            raise ValueError("lease_interval_seconds must be positive")
        if self.lease_ttl_seconds <= self.lease_interval_seconds:
            raise ValueError(
                f"lease_ttl_seconds ({self.lease_ttl_seconds}) must be longer than "
                f"lease_interval_seconds ({self.lease_interval_seconds})"
            )
        if self.metadata_url and not self.metadata_url.startswith(("http://", "https://")):
            raise ValueError(f"metadata_url must be an http(s) URL, got {self.metadata_url!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        check_kv_persistence(self.kv_persist_policy, self.kv_persist_rate_mb_s)
        if self.kv_load not in KV_LOAD_MODES:
            raise ValueError(f"kv_load must be one of {KV_LOAD_MODES}, got {self.kv_load!r}")
        if self.kv_handoff_socket and not self.store.url:
            raise ValueError(
                "--kv-handoff-socket hands KV writes to the daemon for Redis: it needs --redis-url"
            )

    @property
    def kv_persist_rate_bytes_per_second(self) -> float:
        """hybrid's cap in bytes per second; 0 under the other policies."""
        return (self.kv_persist_rate_mb_s or 0.0) * BYTES_PER_MB

    @property
    def kv_persistence(self) -> KvPersistence:
        """The policy as this worker applies it: off without a store (nothing persists)."""
        if not self.store.url:
            return KvPersistence("off")
        return KvPersistence(self.kv_persist_policy, self.kv_persist_rate_bytes_per_second)

    @property
    def effective_max_tokens_limit(self) -> int:
        return self.max_tokens_limit or self.max_model_len

    @property
    def coordinator_addresses(self) -> tuple[str, ...]:
        """Every coordinator address, the comma-separated values split."""
        return tuple(
            part.strip() for value in self.coordinators for part in value.split(",") if part.strip()
        )


def check_kv_persistence(policy: str, rate_mb_s: float | None) -> None:
    """Raises ValueError unless ``policy`` is one of KV_PERSIST_POLICIES and ``rate_mb_s``
    fits it: a cap is hybrid's and hybrid needs one (a cap under another policy would be
    ignored, one that is not positive could never be honoured)."""
    if policy not in KV_PERSIST_POLICIES:
        raise ValueError(f"kv_persist_policy must be one of {KV_PERSIST_POLICIES}, got {policy!r}")
    if policy != "hybrid":
        if rate_mb_s is not None:
            raise ValueError(
                f"kv_persist_rate_mb_s caps the hybrid policy only; kv_persist_policy is "
                f"{policy!r} (use --kv-persist-policy hybrid, or drop the cap)"
            )
        return
    if rate_mb_s is None:
        raise ValueError("kv_persist_policy hybrid needs kv_persist_rate_mb_s (MB/s, > 0)")
    if not 0 < rate_mb_s < float("inf"):
        raise ValueError(f"kv_persist_rate_mb_s must be positive and finite, got {rate_mb_s}")


def engine_environment() -> dict[str, str]:
    """Environment a vLLM engine needs here, as defaults the caller's environment overrides."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
    }


CONFIG_SOURCE = ConfigSource(WorkerConfig, section="worker")
