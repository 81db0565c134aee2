"""Token commits: every generated token of every running request goes to Redis, batched, off
the stream's path.

    Engine stream ──add()──▶ pending tokens per request ──(one loop turn later)──▶ thread:
                                                           create records, commit_step (one
                                                           pipelined round trip), finishes

A stream never waits on Redis: `admit`, `add` and `finish` only touch memory and wake the
flusher. The flusher lets the current event-loop turn finish first, so the chunks that vLLM
delivered for one engine step (one per request) go out in one `commit_step`. If Redis is
unavailable the committer turns degraded, logs once, keeps every token in memory and tries
again from the last index Redis confirmed; a Redis that came back empty (a restart) gets the
record created again and the tokens from index 0. With nothing to write it pings Redis every
``retry_seconds``, so an idle worker that cannot reach its store says so (Stats ``degraded``:
the coordinator then sends it no new request) before it is given one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from store import (
    ConflictReason,
    InvalidTransition,
    RequestExists,
    RequestNotFound,
    RequestRecord,
    RequestStatus,
    RequestStore,
    StoreError,
    StoreUnavailable,
    TokenCommit,
)

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """What the committer knows of one request (owned by the event loop)."""

    record: RequestRecord
    token_ids: list[int]
    committed_length: int  # tokens Redis confirmed
    resumed: bool  # the record exists already (another worker created it)
    in_store: bool = False  # the record exists in Redis with this worker as its owner
    finish_status: RequestStatus | None = None
    finish_reason: str = ""  # how it ended (a FinishReason name), kept with the record
    pause: bool = False  # paused for migration: mark it so once its tokens are in


@dataclass
class _Round:
    """One flush: planned on the loop, run on a thread, applied back on the loop."""

    claims: list[tuple[RequestRecord, bool]] = field(default_factory=list)
    commits: list[TokenCommit] = field(default_factory=list)
    finishes: list[tuple[str, RequestStatus, str]] = field(default_factory=list)
    pauses: list[str] = field(default_factory=list)
    # what completed (a StoreUnavailable can stop the round midway)
    claimed: list[str] = field(default_factory=list)
    outcomes: dict[str, tuple[int, ConflictReason | None]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    # which run of each request was planned: a resume on this worker may admit it afresh
    # while the round runs, and what the round learnt belongs to the old run only
    planned: dict[str, _Pending] = field(default_factory=dict)


class TokenCommitter:
    """Create with a store and this worker's id; `start()` on the serving loop, `close()` at exit.

    ``on_commit`` receives the seconds of each successful `commit_step` round trip, on the
    committer's thread.
    """

    def __init__(
        self,
        store: RequestStore,
        worker_id: str,
        retry_seconds: float,
        on_commit: Callable[[float], None] | None = None,
    ) -> None:
        self._store = store
        self._on_commit = on_commit
        self._worker_id = worker_id
        self._retry_seconds = retry_seconds
        self._pending: dict[str, _Pending] = {}
        self._settled: dict[str, asyncio.Event] = {}  # set once a request leaves _pending
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._degraded = False
        self._closing = False
        self._commit_calls = 0

    @property
    def degraded(self) -> bool:
        """True while the last attempt to reach Redis failed."""
        return self._degraded

    @property
    def commit_calls(self) -> int:
        """`commit_step` round trips so far (one per flush, however many requests it holds)."""
        return self._commit_calls

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="token-committer")

    async def close(self, timeout_seconds: float) -> None:
        """One last flush (bounded by ``timeout_seconds``), then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout_seconds)
            except TimeoutError:
                log.warning("token committer stopped with unsaved tokens")

    # -- called by the engine's streams (memory only) -------------------------------------

    def admit(
        self, record: RequestRecord, committed: Sequence[int] = (), stored: int | None = None
    ) -> None:
        """Start persisting a request. With ``committed`` tokens it is a resumed one: Redis
        holds its record and the first ``stored`` of those tokens already (all of them when
        None; the rest, which its client received, are written first), and ownership moves
        to this worker."""
        superseded = self._settled.pop(record.request_id, None)
        if superseded is not None:  # an earlier run's writes no longer matter
            superseded.set()
        self._pending[record.request_id] = _Pending(
            record=record,
            token_ids=list(committed),
            committed_length=len(committed) if stored is None else stored,
            resumed=bool(committed),
        )
        self._wake.set()

    def add(self, request_id: str, token_ids: Sequence[int]) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and token_ids:
            pending.token_ids.extend(token_ids)
            self._wake.set()

    def finish(self, request_id: str, status: RequestStatus, finish_reason: str = "") -> None:
        """The request ended (``finish_reason``: how, a FinishReason name): commit what is
        pending, then end its record."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.finish_status = status
            pending.finish_reason = finish_reason
            self._wake.set()

    def pause(self, request_id: str) -> None:
        """The request stopped here but lives on (a standby resumes it): commit what is
        pending, then mark it PAUSED instead of ending it."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.pause = True
            self._wake.set()

    # -- the flusher ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if self._closing and not self._plan_needed():
                return
            if not await self._woken_or_probed():
                continue
            self._wake.clear()
            # Let the rest of this loop turn run: the other streams' chunks of the same
            # engine step arrive in it and join this round trip.
            await asyncio.sleep(0)
            work = self._plan()
            if work is None:
                if self._closing:
                    return
                continue
            failed = True
            try:
                await asyncio.to_thread(self._execute, work)
                failed = False
                self._set_degraded(False, None)
            except StoreUnavailable as exc:
                self._set_degraded(True, exc)
            except StoreError as exc:
                log.error("token commit failed: %s", exc)
            self._apply(work)
            if failed:
                if self._closing:
                    return
                await asyncio.sleep(self._retry_seconds)
                self._wake.set()
            elif self._plan_needed():
                self._wake.set()

    async def _woken_or_probed(self) -> bool:
        """Waits for work; after ``retry_seconds`` without any, pings the store instead and
        returns False (its answer sets `degraded`)."""
        try:
            await asyncio.wait_for(self._wake.wait(), self._retry_seconds)
            return True
        except TimeoutError:
            pass
        try:
            await asyncio.to_thread(self._store.ping)
            self._set_degraded(False, None)
        except StoreUnavailable as exc:
            self._set_degraded(True, exc)
        return False

    def _set_degraded(self, degraded: bool, exc: Exception | None) -> None:
        if degraded and not self._degraded:
            log.warning("Redis unavailable, serving without persistence: %s", exc)
        elif not degraded and self._degraded:
            log.warning("Redis is back: token commits resumed")
        self._degraded = degraded

    def _plan_needed(self) -> bool:
        return any(
            not p.in_store
            or p.committed_length < len(p.token_ids)
            or p.finish_status is not None
            or p.pause
            for p in self._pending.values()
        )

    def _plan(self) -> _Round | None:
        work = _Round()
        for request_id, pending in self._pending.items():
            work.planned[request_id] = pending
            if not pending.in_store:
                work.claims.append((pending.record, pending.resumed))
            if len(pending.token_ids) > pending.committed_length:
                work.commits.append(
                    TokenCommit(
                        request_id,
                        pending.committed_length,
                        tuple(pending.token_ids[pending.committed_length :]),
                    )
                )
            elif pending.finish_status is not None and pending.in_store:
                work.finishes.append((request_id, pending.finish_status, pending.finish_reason))
            elif pending.pause and pending.in_store:
                work.pauses.append(request_id)
        if not (work.claims or work.commits or work.finishes or work.pauses):
            return None
        return work

    def _execute(self, work: _Round) -> None:
        """The I/O of one round, on a thread: claims first, so the commits find their record."""
        for record, resumed in work.claims:
            self._claim(record, resumed)
            work.claimed.append(record.request_id)
        if work.commits:
            self._commit_calls += 1
            started = time.perf_counter()
            outcomes = self._store.commit_step(work.commits)
            if self._on_commit is not None:
                self._on_commit(time.perf_counter() - started)
            for outcome in outcomes:
                reason = outcome.conflict.reason if outcome.conflict is not None else None
                work.outcomes[outcome.request_id] = (outcome.committed_length, reason)
        for request_id, status, finish_reason in work.finishes:
            self._store.finish_request(request_id, status, finish_reason)
            work.finished.append(request_id)
        for request_id in work.pauses:
            try:
                self._store.update_status(request_id, RequestStatus.PAUSED)
            except (RequestNotFound, InvalidTransition) as exc:
                log.warning("request %s could not be marked paused: %s", request_id, exc)
            work.paused.append(request_id)

    def _claim(self, record: RequestRecord, resumed: bool) -> None:
        """Make the record exist, owned by this worker."""
        if resumed:
            try:
                self._store.update_status(record.request_id, RequestStatus.RUNNING, self._worker_id)
                return
            except RequestNotFound:
                pass  # Redis lost it: create it again (the commit from 0 follows)
        try:
            self._store.create_request(record)
        except RequestExists:
            try:
                self._store.update_status(record.request_id, RequestStatus.RUNNING, self._worker_id)
            except InvalidTransition:
                log.warning("request %s already ended in the store", record.request_id)

    def _apply(self, work: _Round) -> None:
        def planned(request_id: str) -> _Pending | None:
            pending = self._pending.get(request_id)
            return pending if pending is work.planned.get(request_id) else None

        for request_id in work.claimed:
            pending = planned(request_id)
            if pending is not None:
                pending.in_store = True
        for request_id, (length, reason) in work.outcomes.items():
            pending = planned(request_id)
            if pending is None:
                continue
            if reason is None or reason is ConflictReason.GAP:
                # GAP: Redis holds fewer tokens than believed; continue from its length.
                pending.committed_length = min(length, len(pending.token_ids))
            elif reason is ConflictReason.UNKNOWN_REQUEST:
                # The record vanished (Redis restarted empty): create it, commit from 0.
                pending.in_store = False
                pending.resumed = False
                pending.committed_length = 0
                pending.record = _fresh(pending.record, self._worker_id)
            else:
                log.error(
                    "request %s: commits refused (%s); it is no longer persisted",
                    request_id,
                    reason.value,
                )
                self._drop(request_id)
        for request_id in work.finished + work.paused:
            if planned(request_id) is not None:
                self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        waiters = self._settled.pop(request_id, None)
        if waiters is not None:
            waiters.set()

    async def settled(self, request_id: str, timeout_seconds: float) -> bool:
        """Waits until nothing of ``request_id`` is left to write (its tokens and its pause or
        finish are in the store, or it was given up); False if that took too long."""
        if request_id not in self._pending:
            return True
        done = self._settled.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(done.wait(), timeout_seconds)
        except TimeoutError:
            return False
        return True


def _fresh(record: RequestRecord, worker_id: str) -> RequestRecord:
    """The record as first created: nothing committed yet, running here."""
    return RequestRecord(
        request_id=record.request_id,
        model_fingerprint=record.model_fingerprint,
        prompt_token_ids=record.prompt_token_ids,
        sampling_params=record.sampling_params,
        kv_block_tokens=record.kv_block_tokens,
        status=RequestStatus.RUNNING,
        owner_worker_id=worker_id,
        tenant=record.tenant,
    )
