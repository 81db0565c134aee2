"""Where a request stands in the store, and what a worker submits to continue it.

record (prompt, sampling, fingerprint) + committed tokens [0, n)
    ──▶ engine prompt = prompt + committed, max_tokens = max_tokens - n,
        output indices continue at n

A token reaches the client before Redis confirms it, so after an abrupt loss the client may
hold more tokens than the store: the caller's delivered tokens then extend the committed ones
(`ResumePoint.continued_from`), and the context is the one the client saw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from common.requests import Sampling
from store import RequestNotFound as StoreRequestNotFound
from store import RequestRecord, RequestStatus, RequestStore
from store.request_record import sampling_from_record
from worker.errors import CannotResume, RecordNotFound


@dataclass(frozen=True)
class ResumePoint:
    """A request as the store holds it (live, or FINISHED with its whole output)."""

    record: RequestRecord
    committed_token_ids: tuple[int, ...]
    # How many of committed_token_ids the store holds; the rest came from the client.
    stored_tokens: int | None = None

    def continued_from(self, delivered: Sequence[int]) -> ResumePoint:
        """This point as the client saw it: the client's ``delivered`` tokens, where they
        go past what the store holds, extend the committed ones (the continuation follows
        the history the client has). Tokens the store holds past them stay: they were
        sampled after the same history and are replayed. Raises CannotResume when the two
        disagree on a token (the store no longer matches what its worker sent)."""
        stored = self.committed_token_ids
        if not delivered or self.record.status.is_terminal:
            return self
        shared = min(len(delivered), len(stored))
        differ = next((i for i in range(shared) if delivered[i] != stored[i]), None)
        if differ is not None:
            raise CannotResume(
                f"request {self.record.request_id!r}: the store's token {differ} "
                f"({stored[differ]}) is not the one its client received ({delivered[differ]})"
            )
        if len(delivered) <= len(stored):
            return self
        return dataclasses.replace(
            self, committed_token_ids=tuple(delivered), stored_tokens=len(stored)
        )

    @property
    def sampling(self) -> Sampling:
        return sampling_from_record(self.record.sampling_params)

    @property
    def engine_prompt(self) -> tuple[int, ...]:
        """What the resuming engine prefills: the prompt and every committed token."""
        return self.record.prompt_token_ids + self.committed_token_ids

    @property
    def never_computed(self) -> bool:
        """No worker computed anything of it that the store knows of: no token committed,
        no block persisted, and its last pause found none of its KV (it still waited in the
        engine's queue). Its prefill here is the first, not a recompute."""
        return (
            self.record.paused_without_kv
            and not self.committed_token_ids
            and not self.record.persisted_block_hashes
        )

    @property
    def next_index(self) -> int:
        return len(self.committed_token_ids)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.sampling.max_tokens - self.next_index)


def read_resume_point(store: RequestStore, request_id: str, model_fingerprint: str) -> ResumePoint:
    """Read record and tokens (blocking: call on a thread): a live request, or one that
    FINISHED (its whole output kept until its client got it). Raises RecordNotFound,
    CannotResume (cancelled, failed, another model), or the store's StoreUnavailable."""
    point = read_stored_point(store, request_id, model_fingerprint)
    if point.record.status.is_terminal and point.record.status is not RequestStatus.FINISHED:
        raise CannotResume(f"request {request_id!r} already ended ({point.record.status.value})")
    return point


def read_stored_point(store: RequestStore, request_id: str, model_fingerprint: str) -> ResumePoint:
    """Like read_resume_point, but a request that already ended is returned, not refused."""
    try:
        record = store.get_request(request_id)
        committed = store.committed_tokens(request_id)
    except StoreRequestNotFound as exc:
        raise RecordNotFound(request_id) from exc
    if record.status.is_terminal:
        return ResumePoint(record=record, committed_token_ids=tuple(committed))
    if record.model_fingerprint != model_fingerprint:
        raise CannotResume(
            f"request {request_id!r} was written by another model "
            f"({record.model_fingerprint}, this worker runs {model_fingerprint})"
        )
    return ResumePoint(record=record, committed_token_ids=tuple(committed))
