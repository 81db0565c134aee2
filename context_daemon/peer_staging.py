"""Where a migration target's daemon keeps the KV blocks peer daemons pushed, until its worker
loads them: in memory, by block key and by request, under a byte cap, for a limited time.

    PushBlocks ──▶ reserve(block bytes) ──▶ bytes arrive, CRC + MAC ──▶ stage(request, key)
                        │ over the cap: StagingFull, nothing kept          │
                        ▼                                                  ▼
                   release (a refused or cut-off block)     blocks: key ──▶ bytes, requests
                                                            requests: id ──▶ keys, expiry
    FetchStaged(request, keys) ◀── the worker            DropStaged(request) / expiry ──▶ freed

A full block is content-addressed, so two requests with a common prefix share one staged copy:
it is freed with the last request that holds it. Room is reserved when a block's first chunk
arrives, before its bytes are kept, so the cap bounds the bytes being received as well as
those staged, and a block that does not fit is refused whole, never half kept.

Invariant (nothing leaks): every staged byte belongs to a request that is dropped, or expires
``ttl_seconds`` after it was last pushed to or read.

Not thread-safe: the daemon's event loop owns it (verification runs on threads, staging not).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from context_daemon.constants import DEFAULT_STAGING_MAX_BYTES, DEFAULT_STAGING_TTL_SECONDS
from context_daemon.peer_errors import StagingFull
from store.block_codec import Buffer


@dataclass(frozen=True)
class StagingConfig:
    """The daemon's staging area for pushed KV (``--staging-max-bytes`` ...)."""

    max_bytes: int = field(
        default=DEFAULT_STAGING_MAX_BYTES,
        metadata={
            "help": "most bytes of KV pushed by peer daemons (migrations to this node) held "
            "in memory for the worker at once, blocks being received included; a push over "
            "it is refused (RESOURCE_EXHAUSTED) and its blocks come from Redis"
        },
    )
    ttl_seconds: float = field(
        default=DEFAULT_STAGING_TTL_SECONDS,
        metadata={
            "help": "a request's staged KV that its worker neither read nor dropped in this "
            "long is freed (a migration that went away)"
        },
    )

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"staging max_bytes must be positive, got {self.max_bytes}")
        if self.ttl_seconds <= 0:
            raise ValueError(f"staging ttl_seconds must be positive, got {self.ttl_seconds}")


@dataclass(frozen=True)
class DroppedStage:
    """What dropping a request freed: its blocks, and the bytes no other request still holds."""

    blocks: int
    bytes: int


@dataclass(frozen=True)
class StagingStats:
    staged_bytes: int
    staged_blocks: int
    reserved_bytes: int
    requests: int
    refused_blocks: int
    expired_requests: int


@dataclass
class _Staged:
    data: Buffer
    request_ids: set[str] = field(default_factory=set)


@dataclass
class _Request:
    keys: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    expires_at: float = 0.0


class PeerStaging:
    """The staging area (see the module doc). ``clock``: monotonic seconds."""

    def __init__(
        self, config: StagingConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or StagingConfig()
        self._clock = clock
        self._blocks: dict[str, _Staged] = {}
        self._requests: dict[str, _Request] = {}
        self._staged_bytes = 0
        self._reserved_bytes = 0
        self._refused_blocks = 0
        self._expired_requests = 0

    # --- receiving ------------------------------------------------------------------------

    def reserve(self, block_bytes: int, what: str) -> None:
        """Room for a block about to arrive; raises StagingFull (naming ``what``) when it
        does not fit. Pair with `stage` or `release`."""
        self.expire()
        used = self._staged_bytes + self._reserved_bytes
        if used + block_bytes > self.config.max_bytes:
            raise StagingFull(
                f"staging is full: {what} needs {block_bytes:,} bytes and "
                f"{used:,} of {self.config.max_bytes:,} are taken "
                f"({self._staged_bytes:,} staged, {self._reserved_bytes:,} arriving); "
                "read it from the store"
            )
        self._reserved_bytes += block_bytes

    def release(self, block_bytes: int) -> None:
        """Gives back a reservation whose block is not staged."""
        assert 0 <= block_bytes <= self._reserved_bytes, "releasing more than was reserved"
        self._reserved_bytes -= block_bytes

    def stage(self, request_id: str, key: str, data: Buffer, reserved_bytes: int) -> bool:
        """Stages a verified block for ``request_id``, using its reservation; True when its
        bytes are kept, False when the key was staged already (shared: the request takes a
        reference, the reservation goes back)."""
        self.release(reserved_bytes)
        staged = self._blocks.get(key)
        kept = staged is None
        if staged is None:
            staged = self._blocks[key] = _Staged(data)
            self._staged_bytes += len(data)
        staged.request_ids.add(request_id)
        request = self._requests.setdefault(request_id, _Request())
        request.keys[key] = None
        request.expires_at = self._clock() + self.config.ttl_seconds
        return kept

    def count_refused(self) -> None:
        self._refused_blocks += 1

    # --- the worker's side ----------------------------------------------------------------

    def fetch(self, request_id: str, keys: Sequence[str] = ()) -> list[tuple[str, Buffer]]:
        """The staged blocks of ``request_id`` that ``keys`` names (all when empty), in that
        order; a key not staged for the request is left out. Restarts the request's TTL."""
        self.expire()
        request = self._requests.get(request_id)
        if request is None:
            return []
        request.expires_at = self._clock() + self.config.ttl_seconds
        wanted = keys or list(request.keys)
        return [(key, self._blocks[key].data) for key in wanted if key in request.keys]

    def drop(self, request_id: str) -> DroppedStage:
        """Frees what ``request_id`` holds; a block another request holds stays."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return DroppedStage(0, 0)
        freed = 0
        for key in request.keys:
            staged = self._blocks[key]
            staged.request_ids.discard(request_id)
            if not staged.request_ids:
                del self._blocks[key]
                freed += len(staged.data)
        self._staged_bytes -= freed
        return DroppedStage(len(request.keys), freed)

    def expire(self) -> int:
        """Drops every request whose TTL ran out; returns how many."""
        now = self._clock()
        stale = [rid for rid, request in self._requests.items() if request.expires_at <= now]
        for request_id in stale:
            self.drop(request_id)
        self._expired_requests += len(stale)
        return len(stale)

    async def sweep(self, stop: asyncio.Event, every_seconds: float) -> None:
        """Expires stale requests every ``every_seconds`` until ``stop``, so that memory is
        freed also when no call comes to do it."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_seconds)
            self.expire()

    # --- looking ----------------------------------------------------------------------------

    def holds(self, request_id: str, key: str) -> bool:
        request = self._requests.get(request_id)
        return request is not None and key in request.keys

    def stats(self) -> StagingStats:
        return StagingStats(
            staged_bytes=self._staged_bytes,
            staged_blocks=len(self._blocks),
            reserved_bytes=self._reserved_bytes,
            requests=len(self._requests),
            refused_blocks=self._refused_blocks,
            expired_requests=self._expired_requests,
        )
