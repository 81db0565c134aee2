"""Dataclasses of the messages that cross a process boundary, beside those of a request's
path (`common.requests`). `protos/convert.py` turns each into its proto message and back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FlushReport:
    """How far one paused request's state reached the store (the `FlushProgress` message the
    worker streams to its daemon and the daemon to the coordinator; see worker/flush_state.py)."""

    request_id: str
    complete: bool
    committed_tokens: int
    persisted_blocks: int
    tail_persisted: bool
    context_tokens: int
    worker_id: str


# Megabytes as --kv-persist-rate-mb-s counts them.
_BYTES_PER_MB = 1_000_000


@dataclass(frozen=True)
class KvPersistence:
    """Which KV blocks a worker writes to Redis (the `KvPersistence` message): its
    ``--kv-persist-policy`` (``off`` without a store) and, under ``hybrid``, the cap."""

    policy: str = ""
    """eager | lazy | hybrid | off; empty: not reported (a launcher's registration, or a
    worker of an older release)."""
    rate_cap_bytes_per_second: float = 0.0
    """hybrid's cap; 0 under the other policies."""

    @property
    def label(self) -> str:
        """As `spotinfer status` shows it: ``hybrid 5 MB/s``, ``eager``, ``-``."""
        if not self.policy:
            return "-"
        if not self.rate_cap_bytes_per_second:
            return self.policy
        return f"{self.policy} {self.rate_cap_bytes_per_second / _BYTES_PER_MB:g} MB/s"


@dataclass(frozen=True)
class WorkerCapacity:
    """What a worker reports in Stats (the `WorkerStats` message); the coordinator keeps the
    last one of each worker as its heartbeat."""

    worker_id: str
    ready: bool
    draining: bool
    degraded: bool
    running_seqs: int
    waiting_seqs: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_tokens: int
    max_num_seqs: int
    max_model_len: int
    model: str
    tokens_per_second: float
    generated_tokens_total: int = 0
    requests_total: int = 0
    stopping_deadline_unix: float = 0.0
    """> 0: the worker is being stopped (SIGTERM) and leaves by then; its requests move as
    on a termination notice."""
    kv_persistence: KvPersistence = KvPersistence()

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free


@dataclass(frozen=True)
class PrefetchResult:
    """One migration stage on a target worker (the `PrefetchResponse` message)."""

    staged_blocks: int  # of the request, all stages so far
    new_blocks: int  # staged by this call
    staged_bytes: int
    context_tokens: int
    finished: bool  # the request ended: nothing is staged for it any more


# Actions of a notice that end the VM (a rebalance is a hint: nothing moves yet).
VM_ENDING_ACTIONS = frozenset({"terminate", "stop", "preempt"})


@dataclass(frozen=True)
class NoticeEvent:
    """A termination notice as a daemon streams it to its coordinator (``flush`` None), or one
    request's flush report under it (the `NoticeEvent` message)."""

    source: str
    action: str
    deadline_unix: float  # 0: no deadline (a hint)
    received_unix: float = 0.0
    daemon_id: str = ""
    flush: FlushReport | None = None

    @property
    def ends_vm(self) -> bool:
        return self.action in VM_ENDING_ACTIONS


POOL_CLOUDS = ("aws", "gcp", "azure", "local")


@dataclass(frozen=True)
class PoolLabels:
    """Where a worker runs; what a fleet's pools are told apart by (the `PoolLabels` message,
    and the worker's ``pool`` settings: ``--cloud``, ``--zone``, ``SPOTINFER_ZONE``, ...)."""

    cloud: str = field(
        default="",
        metadata={
            "flag": "cloud",
            "help": "aws | gcp | azure | local; a cloud also makes the advertised address "
            "default to what its metadata service says",
        },
    )
    zone: str = field(default="", metadata={"flag": "zone", "help": "the zone the VM runs in"})
    instance_type: str = field(
        default="",
        metadata={"flag": "instance-type", "help": "the VM's instance / machine type"},
    )
    spot: bool = field(
        default=False, metadata={"flag": "spot", "help": "a spot VM (else on-demand)"}
    )

    def __post_init__(self) -> None:
        if self.cloud and self.cloud not in POOL_CLOUDS:
            raise ValueError(f"pool cloud must be one of {POOL_CLOUDS}, got {self.cloud!r}")

    @property
    def fallback(self) -> bool:
        """An on-demand VM of a cloud fleet: the fallback tier, which the coordinator routes
        to only while the spot workers cannot hold the load (a worker with no cloud label
        is an ordinary one, wherever it runs)."""
        return bool(self.cloud) and not self.spot

    @property
    def name(self) -> str:
        """The pool: workers alike in cloud, zone, type and purchase option ("" when
        unlabelled)."""
        if not (self.cloud or self.zone or self.instance_type or self.spot):
            return ""
        purchase = "spot" if self.spot else "on-demand"
        return "/".join((self.cloud, self.zone, self.instance_type, purchase))


@dataclass(frozen=True)
class Registration:
    """A worker joining the cluster or renewing its lease (the `RegisterWorkerRequest`).

    ``lease_ttl_seconds`` 0 is a launcher registering a worker by address: no lease, no
    fingerprint check, the heartbeat alone decides."""

    address: str
    standby: bool = False
    worker_id: str = ""
    daemon_address: str = ""
    lease_ttl_seconds: float = 0.0
    pool: PoolLabels = PoolLabels()
    capacity: WorkerCapacity | None = None
    model_fingerprint: str = ""
    model: str = ""


@dataclass(frozen=True)
class ClassCapView:
    """One class's admission cap on one worker, as `spotinfer status` shows it: the cap, the
    batch controller's last decision and why, and what it measured (seconds; 0: none)."""

    sla_class: int  # common.requests.SlaClass
    cap: int  # 0: no class cap
    decision: str  # start | grow | shrink | hold | static
    reason: str
    ttft_p99_seconds: float = 0.0
    tpot_seconds: float = 0.0
    samples: int = 0
