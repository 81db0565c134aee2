"""The request record: what a standby needs to know to continue a request somewhere else."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.requests import Sampling
from store.block_codec import pack_token_ids, unpack_token_ids
from store.constants import FINISH_REASON_FIELD, RECORD_MAC_FIELD
from store.keys import validate_request_id
from store.mac_keyring import MacKeyring


class RequestStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # stopped at an iteration boundary, state complete in the store
    MIGRATING = "migrating"  # its KV is moving to a standby
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED}
)
_LIVE_STATUSES = frozenset(RequestStatus) - TERMINAL_STATUSES

# Meta field set ("1") by a pause that found no KV to store; absent otherwise.
PAUSED_WITHOUT_KV_FIELD = "paused_without_kv"

# A live request may move to any state (a lost worker re-queues it, a resume runs it again,
# possibly on another owner); a terminal one never leaves its state, so a late commit or a
# late status write from a worker that was presumed dead cannot revive it.
ALLOWED_PREVIOUS: dict[RequestStatus, frozenset[RequestStatus]] = {
    status: _LIVE_STATUSES | ({status} if status.is_terminal else frozenset())
    for status in RequestStatus
}


@dataclass(frozen=True)
class RequestRecord:
    """One request as the store keeps it. Token lists are the ids the engine saw."""

    request_id: str
    model_fingerprint: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: Mapping[str, Any]
    """Plain JSON-serialisable mapping (temperature, seed, max_tokens, …)."""
    kv_block_tokens: int
    status: RequestStatus = RequestStatus.QUEUED
    owner_worker_id: str = ""
    """The worker that decodes it now; empty while nobody does."""
    committed_length: int = 0
    """Generated tokens committed so far; the next one has this index."""
    created_unix_ms: int = 0
    updated_unix_ms: int = 0
    persisted_block_hashes: tuple[bytes, ...] = field(default=())
    """Hashes of the full KV blocks persisted for it, block 0 first, no gaps."""
    paused_without_kv: bool = False
    """The worker that paused it last held none of its KV (it was still waiting in the
    engine's queue): that pause stored no blocks and no tail, and owes none. Cleared when a
    worker runs it again."""
    tenant: str = ""
    """Whose request it is (GenerationRequest.tenant): a resume salts its KV with it."""
    finish_reason: str = ""
    """How it ended (a FinishReason name: STOP, LENGTH, ...); empty while it runs."""
    sla_class: str = "INTERACTIVE"
    """Its SLA class by name (GenerationRequest.sla_class): a resume keeps its place in the
    engine's order (a batch request must not come back as an interactive one)."""
    priority: int | None = None
    """Its own priority within the class (GenerationRequest.priority); None: the default."""

    def __post_init__(self) -> None:
        validate_request_id(self.request_id)
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        if self.kv_block_tokens <= 0:
            raise ValueError("kv_block_tokens must be positive")
        if self.committed_length < 0:
            raise ValueError("committed_length must not be negative")

    def to_fields(self) -> dict[str, bytes | str | int]:
        """The meta HASH fields; block hashes live in their own key (see keys.py)."""
        return {
            "request_id": self.request_id,
            "model_fingerprint": self.model_fingerprint,
            "prompt_token_ids": pack_token_ids(self.prompt_token_ids),
            "sampling_params": json.dumps(dict(self.sampling_params), sort_keys=True),
            "status": self.status.value,
            "owner_worker_id": self.owner_worker_id,
            "committed_length": self.committed_length,
            "created_unix_ms": self.created_unix_ms,
            "updated_unix_ms": self.updated_unix_ms,
            "kv_block_tokens": self.kv_block_tokens,
            "tenant": self.tenant,
            "sla_class": self.sla_class,
            "priority": "" if self.priority is None else str(self.priority),
        }

    @classmethod
    def from_fields(
        cls, fields: Mapping[bytes, bytes], block_hashes: Mapping[bytes, bytes]
    ) -> RequestRecord:
        def text(name: str) -> str:
            return fields[name.encode()].decode()

        return cls(
            request_id=text("request_id"),
            model_fingerprint=text("model_fingerprint"),
            prompt_token_ids=tuple(unpack_token_ids(fields[b"prompt_token_ids"])),
            sampling_params=json.loads(text("sampling_params")),
            kv_block_tokens=int(text("kv_block_tokens")),
            status=RequestStatus(text("status")),
            owner_worker_id=text("owner_worker_id"),
            committed_length=int(text("committed_length")),
            created_unix_ms=int(text("created_unix_ms")),
            updated_unix_ms=int(text("updated_unix_ms")),
            persisted_block_hashes=contiguous_block_hashes(block_hashes),
            paused_without_kv=fields.get(PAUSED_WITHOUT_KV_FIELD.encode()) == b"1",
            tenant=fields.get(b"tenant", b"").decode(),
            finish_reason=fields.get(FINISH_REASON_FIELD.encode(), b"").decode(),
            sla_class=fields.get(b"sla_class", b"INTERACTIVE").decode(),
            priority=int(fields[b"priority"]) if fields.get(b"priority") else None,
        )


# The fields a record is created with and that nothing changes later: what its MAC covers.
# Status, owner and lengths are moved by the Lua scripts inside Redis, so they cannot be
# signed; a forger who changes them can stall or misroute a request, never steer its output.
SIGNED_FIELDS = (
    "request_id",
    "model_fingerprint",
    "prompt_token_ids",
    "sampling_params",
    "kv_block_tokens",
    "tenant",
    "sla_class",
    "priority",
)


def signed_parts(fields: Mapping[str, bytes | str | int]) -> list[bytes]:
    """The MAC input of a record: each signed field of ``to_fields()`` (or of what Redis
    returned, names decoded), length-prefixed, in a fixed order."""
    parts: list[bytes] = []
    for name in SIGNED_FIELDS:
        value = fields.get(name, b"")
        data = value if isinstance(value, bytes) else str(value).encode()
        parts += [len(data).to_bytes(8, "little"), data]
    return parts


def record_mac(keyring: MacKeyring, fields: Mapping[str, bytes | str | int]) -> str:
    """The MAC field of a new record's ``to_fields()``: ``<key id>:<hex MAC>``."""
    key_id, mac = keyring.sign(signed_parts(fields))
    return f"{key_id}:{mac.hex()}"


def record_verifies(keyring: MacKeyring, fields: Mapping[bytes, bytes]) -> bool:
    """Whether a record as Redis returned it carries a MAC of a key of ``keyring``."""
    stored = fields.get(RECORD_MAC_FIELD.encode(), b"").decode(errors="replace")
    key_id, _, mac_hex = stored.partition(":")
    try:
        mac = bytes.fromhex(mac_hex)
    except ValueError:
        return False
    named = {name.decode(errors="replace"): value for name, value in fields.items()}
    return key_id.isdigit() and keyring.verify(int(key_id), mac, signed_parts(named))


def contiguous_block_hashes(by_index: Mapping[bytes, bytes]) -> tuple[bytes, ...]:
    """Block hashes from index 0 up to the first missing index.

    Blocks may land out of order (or one write may fail); only an unbroken prefix is usable,
    because block i's KV is worthless without blocks 0..i-1.
    """
    hashes: list[bytes] = []
    while (hex_hash := by_index.get(str(len(hashes)).encode())) is not None:
        hashes.append(bytes.fromhex(hex_hash.decode()))
    return tuple(hashes)


def sampling_to_record(sampling: Sampling) -> dict[str, Any]:
    """Sampling as the JSON mapping the request record keeps."""
    values = dataclasses.asdict(sampling)
    values["stop"] = list(sampling.stop)
    return values


def sampling_from_record(values: Mapping[str, Any]) -> Sampling:
    known = {f.name for f in dataclasses.fields(Sampling)}
    kwargs = {name: value for name, value in values.items() if name in known}
    kwargs["stop"] = tuple(kwargs.get("stop", ()))
    return Sampling(**kwargs)
