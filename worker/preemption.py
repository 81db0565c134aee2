"""The engine's ends of service: a drain (stop admitting, let requests finish, abort the rest),
a termination notice (stop admitting, pause every request at an iteration boundary, and
report each one once its state is complete in the store), and a stop (SIGTERM: with a store,
the requests move as on a notice; see `Preemption.stop`)::

    preempt(deadline) ─▶ draining ─▶ abort all (paused) ─▶ streams end with a NOTICE event
                                          │                 committer: tokens, then PAUSED
                                          ▼
                          connector: tokens, unsaved full blocks, tail ─▶ Redis
    poll the store (headers only) ─▶ FlushState per request as it completes; the rest at
    the deadline, not complete
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from store import StoreUnavailable
from store.keys import shard_suffixes
from worker.boundary_abort import abort_at_step_boundary
from worker.constants import (
    DEFAULT_PREEMPT_GRACE_SECONDS,
    FLUSH_POLL_SECONDS,
    STOP_HANDOFF_SHARE,
    STREAM_END_WAIT_SECONDS,
)
from worker.engine_context import EngineContext
from worker.flush_state import FlushState, read_flush_states
from worker.streams import RequestStreams, RunningRequest

log = logging.getLogger(__name__)


class Preemption:
    """Drains and pauses the engine's streams."""

    def __init__(self, context: EngineContext, streams: RequestStreams) -> None:
        self._ctx = context
        self._streams = streams
        self.stopping_deadline_unix = 0.0  # > 0 once stopping: Stats says so
        self._preempting = 0  # preempt calls under way

    async def stop(self, grace_seconds: float) -> tuple[int, int]:
        """The worker is being stopped (SIGTERM: a scale-in, a MIG delete, a shutdown, an
        operator). With a store, its requests move as on a termination notice: it stops
        admitting and reports ``stopping_deadline_unix`` in Stats, so its coordinator stages
        them on their targets and has the daemon call Preempt; if no Preempt has begun within
        `STOP_HANDOFF_SHARE` of the grace (no coordinator watches, or none moves requests),
        it pauses and persists them itself and the coordinator resumes them from the store.
        Without a store nothing can move: it drains (see `drain`). Returns (moved, cut)."""
        if self._ctx.store is None:
            return 0, await self.drain(grace_seconds)
        self._streams.stop_admitting()
        deadline = time.time() + grace_seconds
        self.stopping_deadline_unix = deadline
        moving = len(self._streams.running)
        handoff_end = time.time() + STOP_HANDOFF_SHARE * grace_seconds
        while self._streams.running and not self._preempting and time.time() < handoff_end:
            await asyncio.sleep(FLUSH_POLL_SECONDS)
        if self._streams.running and not self._preempting:
            log.warning(
                "stopping: no coordinator moved %d request(s); pausing them here",
                len(self._streams.running),
            )
            async for _ in self.preempt(deadline):
                pass
        while self._preempting and time.time() < deadline:  # the coordinator's flush
            await asyncio.sleep(FLUSH_POLL_SECONDS)
        left = list(self._streams.running)  # admitted after all? (a resume racing the stop)
        for request_id in left:
            await self._ctx.llm.abort(request_id)
        return moving, len(left)

    async def drain(self, grace_seconds: float) -> int:
        """Stops admitting; waits up to `grace_seconds` for in-flight requests, then aborts
        the rest (their streams end CANCELLED). Returns how many had to be aborted."""
        self._streams.stop_admitting()
        deadline = time.monotonic() + grace_seconds
        while self._streams.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        remaining = list(self._streams.running)
        for request_id in remaining:
            await self._ctx.llm.abort(request_id)
        for request_id in remaining:
            running = self._streams.running.get(request_id)
            if running is not None:
                await running.done.wait()
        return len(remaining)

    async def preempt(self, deadline_unix: float) -> AsyncIterator[FlushState]:
        """A termination notice: stop admitting, pause every in-flight request and persist it
        (see the module docstring). Yields one FlushState per paused request: as soon as it
        is complete in the store, or, for those still incomplete at ``deadline_unix`` (0: the
        default grace from now), at the deadline with ``complete`` False. An idle worker
        yields nothing."""
        self._preempting += 1
        try:
            async for state in self._preempt(deadline_unix):
                yield state
        finally:
            self._preempting -= 1

    async def _preempt(self, deadline_unix: float) -> AsyncIterator[FlushState]:
        self._streams.stop_admitting()
        if not deadline_unix:
            deadline_unix = time.time() + DEFAULT_PREEMPT_GRACE_SECONDS
        paused = dict(self._streams.running)
        if not paused:
            return
        for running in paused.values():
            running.paused = True
        log.warning(
            "termination notice: pausing %d request(s), %.1f s to the deadline",
            len(paused),
            deadline_unix - time.time(),
        )
        # One abort: vLLM finishes them all in one scheduler pass, so the connector orders all
        # of their writes together. It waits for the end of the step in flight, whose tokens
        # reach the streams; the plain abort after it ends the streams.
        await abort_at_step_boundary(self._ctx.llm, list(paused))
        await self._ctx.llm.abort(list(paused))
        await asyncio.wait(
            [asyncio.ensure_future(running.done.wait()) for running in paused.values()],
            timeout=STREAM_END_WAIT_SECONDS,
        )
        if self._ctx.store is None:  # nowhere to flush to: nothing can be complete
            for request_id in paused:
                yield FlushState(request_id, 0, 0, 0, False, False)
            return
        async for state in self._await_flushed(paused, deadline_unix):
            yield state

    async def _await_flushed(
        self, paused: dict[str, RunningRequest], deadline_unix: float
    ) -> AsyncIterator[FlushState]:
        pending = dict(paused)
        while pending:
            states = await asyncio.to_thread(self._read_flush_states, pending)
            if time.time() > deadline_unix:
                for state in states:  # too late: whatever landed, it did not land in time
                    yield dataclasses.replace(state, complete=False)
                return
            for state in states:
                if state.complete:
                    del pending[state.request_id]
                    yield state
            if pending:
                await asyncio.sleep(FLUSH_POLL_SECONDS)

    def _read_flush_states(self, pending: dict[str, RunningRequest]) -> list[FlushState]:
        assert self._ctx.store is not None, "preempt reads states only with a store"
        try:
            return read_flush_states(
                self._ctx.store,
                {request_id: running.streamed_tokens for request_id, running in pending.items()},
                self._ctx.fingerprint,
                self._ctx.require_shape().kv_chunk_tokens,
                with_kv=self._ctx.config.kv_persist_policy != "off",
                shards=shard_suffixes(tp)
                if (tp := self._ctx.config.tensor_parallel_size) > 1
                else (),
            )
        except StoreUnavailable:
            return [FlushState(request_id, 0, 0, 0, False, False) for request_id in pending]
