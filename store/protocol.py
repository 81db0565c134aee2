"""The store as the coordinator and the worker's token committer see it: request records and
committed tokens, nothing of KV blocks.

`RequestStore` names exactly the calls those callers make — adoption reads a record
(`get_request`), the reroute failover drops an abandoned one (`delete_request`), the token
committer creates, moves and ends records and commits tokens (`create_request`,
`update_status`, `finish_request`, `commit_step`), a resume reads the tokens
(`committed_tokens`), the coordinator whose client got a request's end releases its keys
(`release_request`) — so that they take any store through their constructors. `RedisStore`
is the implementation that runs; `MemoryStore` (memory_store.py) is the one unit tests give
them. KV blocks (`put_blocks`, `get_blocks`, ...) stay RedisStore's alone: their callers are
tested against real Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from store.redis_store import CommitOutcome, TokenCommit
from store.request_record import RequestRecord, RequestStatus


class RequestStore(Protocol):
    """Every method is atomic per request and raises StoreUnavailable when the store cannot
    be reached; the other failures are the typed ones of errors.py."""

    def ping(self) -> None:
        """Returns when the store answers; raises StoreUnavailable otherwise."""
        ...

    def create_request(self, record: RequestRecord) -> None:
        """Stores a new record; raises RequestExists if the id is taken."""
        ...

    def get_request(self, request_id: str) -> RequestRecord:
        """Raises RequestNotFound when there is no record (never made, ended, expired)."""
        ...

    def update_status(
        self, request_id: str, status: RequestStatus, owner_worker_id: str | None = None
    ) -> RequestStatus:
        """Moves a live request to a live ``status`` (and owner); returns the old status.
        Raises RequestNotFound, or InvalidTransition out of a terminal status."""
        ...

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED,
        finish_reason: str = "",
    ) -> bool:
        """Ends the request (deleted, or kept the retention with ``status`` and
        ``finish_reason``; a FINISHED one not yet released is kept the undelivered retention);
        False when no record exists, so a retried finish is harmless."""
        ...

    def release_request(self, request_id: str) -> bool:
        """The request's client got its end: an ended request keeps its keys for the
        retention only (0 deletes them), a live one is marked so that its finish does;
        False when no record exists."""
        ...

    def delete_request(self, request_id: str) -> int:
        """Deletes every key of the request; returns how many existed."""
        ...

    def commit_step(self, commits: Sequence[TokenCommit]) -> list[CommitOutcome]:
        """Applies each commit atomically and independently: a retry that overlaps what is
        stored and matches it is accepted (only the new suffix is appended); a gap, a
        different token at a stored index, no record or an ended request is refused with
        its conflict, and nothing of that commit is written."""
        ...

    def committed_tokens(self, request_id: str, start_index: int = 0) -> list[int]:
        """Committed token ids from ``start_index`` on; raises RequestNotFound."""
        ...

    def close(self) -> None: ...
