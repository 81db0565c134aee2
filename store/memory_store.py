"""MemoryStore: the RequestStore protocol in a dict, for unit tests of the code above it.

It keeps the semantics callers rely on, as RedisStore's scripts (lua_scripts.py) define them:
creating a taken id raises RequestExists; status moves follow ALLOWED_PREVIOUS (nothing
leaves a terminal status); a token commit appends only at the committed length, accepts a
matching overlap (idempotent retries) and refuses a gap, a mismatch, an unknown or an ended
request without writing anything; a finish with retention 0 deletes the request, unless it
FINISHED and nobody released it yet (`release_request`: a coordinator's client got its end)
while the undelivered retention is on: then it is kept, and its release deletes it.

What it leaves out, on purpose: there is no expiry (TTLs are ignored: a record stays until it
is finished without retention or deleted), no KV blocks (records never list persisted block
hashes) and no outage (it never raises StoreUnavailable). Tests that need any of these run
against real Redis.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from store.errors import (
    CommitConflict,
    ConflictReason,
    InvalidTransition,
    RequestExists,
    RequestNotFound,
)
from store.redis_store import CommitOutcome, TokenCommit
from store.request_record import ALLOWED_PREVIOUS, RequestRecord, RequestStatus
from store.store_config import StoreConfig


@dataclass
class _Stored:
    record: RequestRecord
    token_ids: list[int] = field(default_factory=list)
    released: bool = False  # a coordinator's client got its end


class MemoryStore:
    """Not thread-safe beyond the GIL's atomicity of each call; ``clock`` returns unix
    seconds (record timestamps), as RedisStore's does."""

    def __init__(
        self, config: StoreConfig | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._config = config or StoreConfig()
        self._clock = clock
        self._requests: dict[str, _Stored] = {}
        self.closed = False

    @property
    def config(self) -> StoreConfig:
        return self._config

    def request_ids(self) -> list[str]:
        """Every request with a record, sorted (what a test inspects)."""
        return sorted(self._requests)

    # --- request records ------------------------------------------------------------------

    def create_request(self, record: RequestRecord) -> None:
        if record.request_id in self._requests:
            raise RequestExists(record.request_id)
        now_ms = self._now_ms()
        stored = dataclasses.replace(
            record,
            created_unix_ms=record.created_unix_ms or now_ms,
            updated_unix_ms=now_ms,
            persisted_block_hashes=(),
            paused_without_kv=False,
        )
        self._requests[record.request_id] = _Stored(stored)

    def get_request(self, request_id: str) -> RequestRecord:
        return self._stored(request_id).record

    def update_status(
        self, request_id: str, status: RequestStatus, owner_worker_id: str | None = None
    ) -> RequestStatus:
        if status.is_terminal:
            raise ValueError("use finish_request for a terminal status")
        stored = self._stored(request_id)
        before = stored.record.status
        if before not in ALLOWED_PREVIOUS[status]:
            raise InvalidTransition(request_id, before.value, status.value)
        changes: dict[str, object] = {"status": status, "updated_unix_ms": self._now_ms()}
        if owner_worker_id is not None:
            changes["owner_worker_id"] = owner_worker_id
        if status is RequestStatus.RUNNING:
            changes["paused_without_kv"] = False
        stored.record = dataclasses.replace(stored.record, **changes)  # type: ignore[arg-type]
        return before

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED,
        finish_reason: str = "",
    ) -> bool:
        if not status.is_terminal:
            raise ValueError(f"{status} is not a terminal status")
        stored = self._requests.get(request_id)
        if stored is None:
            return False
        before = stored.record.status
        if before not in ALLOWED_PREVIOUS[status]:
            raise InvalidTransition(request_id, before.value, status.value)
        held = (
            status is RequestStatus.FINISHED
            and not stored.released
            and self._config.undelivered_retention_seconds > 0
        )
        if self._config.retention_seconds == 0 and not held:
            del self._requests[request_id]
        else:  # kept with its final status (for good: no expiry here)
            stored.record = dataclasses.replace(
                stored.record,
                status=status,
                finish_reason=finish_reason,
                updated_unix_ms=self._now_ms(),
            )
        return True

    def release_request(self, request_id: str) -> bool:
        stored = self._requests.get(request_id)
        if stored is None:
            return False
        if not stored.record.status.is_terminal:
            stored.released = True
        elif self._config.retention_seconds == 0:
            del self._requests[request_id]
        return True

    def delete_request(self, request_id: str) -> int:
        """The keys RedisStore would have held: the record, and its tokens once committed."""
        stored = self._requests.pop(request_id, None)
        if stored is None:
            return 0
        return 1 + int(bool(stored.token_ids))

    # --- committed tokens -----------------------------------------------------------------

    def commit(self, request_id: str, start_index: int, token_ids: Sequence[int]) -> int:
        (outcome,) = self.commit_step([TokenCommit(request_id, start_index, tuple(token_ids))])
        if outcome.conflict is not None:
            raise outcome.conflict
        return outcome.committed_length

    def commit_step(self, commits: Sequence[TokenCommit]) -> list[CommitOutcome]:
        return [self._commit(commit) for commit in commits]

    def committed_tokens(self, request_id: str, start_index: int = 0) -> list[int]:
        return list(self._stored(request_id).token_ids[start_index:])

    def ping(self) -> None:
        """Always answers (no outage here)."""

    def close(self) -> None:
        self.closed = True

    # --- plumbing -------------------------------------------------------------------------

    def _commit(self, commit: TokenCommit) -> CommitOutcome:
        stored = self._requests.get(commit.request_id)
        if stored is None:
            return _refused(commit, ConflictReason.UNKNOWN_REQUEST, 0)
        tokens = stored.token_ids
        length = len(tokens)
        if stored.record.status.is_terminal:
            return _refused(commit, ConflictReason.REQUEST_ENDED, length)
        start, new = commit.start_index, list(commit.token_ids)
        if start > length:
            return _refused(commit, ConflictReason.GAP, length)
        overlap = min(length, start + len(new)) - start
        if overlap > 0 and tokens[start : start + overlap] != new[:overlap]:
            return _refused(commit, ConflictReason.MISMATCH, length)
        if start + len(new) > length:
            tokens.extend(new[overlap:])
            length = len(tokens)
            stored.record = dataclasses.replace(
                stored.record, committed_length=length, updated_unix_ms=self._now_ms()
            )
        return CommitOutcome(commit.request_id, length)

    def _stored(self, request_id: str) -> _Stored:
        stored = self._requests.get(request_id)
        if stored is None:
            raise RequestNotFound(request_id)
        return stored

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def _refused(commit: TokenCommit, reason: ConflictReason, length: int) -> CommitOutcome:
    conflict = CommitConflict(commit.request_id, reason, length)
    return CommitOutcome(commit.request_id, length, conflict)
