"""The engine's resumes: a request another worker started continues here from the store, and,
as a migration's target, its persisted blocks are staged (and warmed into vLLM's cache)
before the pause so the resume loads less.

    prefetch ─▶ stage the full blocks (prefetch.py) ─▶ warm-up: a one-token request whose
                prefill the connector serves from staging; vLLM keeps the blocks cached
    resume   ─▶ committed tokens the client lacks (from the store, at once)
             ─▶ MIGRATED / RECOVERED event ─▶ the new tokens, indices continuing
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator

from common.requests import (
    Event,
    EventKind,
    FinishReason,
    GenerationRequest,
    Sampling,
    TokenChunk,
)
from store import RequestRecord, RequestStatus, StoreUnavailable
from store.keys import shard_suffixes
from store.request_record import sampling_to_record
from worker.constants import (
    KV_PARAM_FIRST_INDEX,
    KV_PARAM_REQUEST_ID,
    KV_PARAM_RESUME,
    KV_PARAM_WARM,
    TAKE_OVER_WAIT_SECONDS,
    WARM_REQUEST_SUFFIX,
    WARM_TIMEOUT_SECONDS,
)
from worker.engine_context import EngineContext
from worker.errors import CannotResume, EngineNotReady, InvalidRequest, WorkerDraining
from worker.prefetch import PrefetchOutcome, prefetch_stage
from worker.resume_point import ResumePoint, read_resume_point
from worker.streams import RequestStreams, sla_class_named

log = logging.getLogger(__name__)


class Resumption:
    """Resumes and prefetches on top of the engine's streams."""

    def __init__(self, context: EngineContext, streams: RequestStreams) -> None:
        self._ctx = context
        self._streams = streams

    async def resume(
        self,
        request_id: str,
        from_index: int,
        delivered: tuple[int, ...] = (),
        request: GenerationRequest | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Continues a request from the store, streaming every token from ``from_index`` on:
        first the committed ones the client lacks (at once, from the store), then, once the
        engine has taken the request, a MIGRATED or RECOVERED event (how many prefill tokens
        were loaded and how many recomputed) and the new tokens, indices continuing.
        ``delivered``, when given, are the client's tokens [0, from_index): the context is
        prompt + those, also where the store holds fewer (`ResumePoint.continued_from`).
        Raises RecordNotFound, CannotResume or InvalidRequest. A run of the request still
        going on here (its old caller gone unseen) is paused first
        (`RequestStreams.take_over`)."""
        point = await self._point(request_id, from_index, delivered, request)
        assert self._ctx.committer is not None  # checked by _point
        if point.record.status is RequestStatus.FINISHED:
            # It ended before its caller got the end (that caller died, or its stream broke
            # after the last step): what the client lacks, from the store, and the end.
            yield self._finished_chunk(point, from_index)
            return
        sampling = dataclasses.replace(point.sampling, max_tokens=point.remaining_tokens)
        request = GenerationRequest(
            request_id,
            point.engine_prompt,
            sampling,
            sla_class=sla_class_named(point.record.sla_class),
            tenant=point.record.tenant,
            priority=point.record.priority,
        )
        if point.remaining_tokens == 0:
            # The old worker produced every token but died before it could say so.
            for chunk in self._all_produced(point, from_index):
                yield chunk
            return
        self._streams.validate(request)
        self._ctx.committer.admit(point.record, point.committed_token_ids, point.stored_tokens)
        staging = self._ctx.staging
        # A sharded worker stages one value per rank of every block (prefetch.py).
        ranks = self._ctx.config.tensor_parallel_size
        staged = staging.blocks_of(request_id) // ranks if staging is not None else 0
        kv_params = {
            KV_PARAM_REQUEST_ID: request_id,
            KV_PARAM_RESUME: True,
            KV_PARAM_FIRST_INDEX: point.next_index,
        }
        if from_index < point.next_index:
            # Committed, but the client never saw them: the pause dropped the token of the
            # step in flight (vLLM takes an abort before that step's output), the client's
            # stream lagged, or the old worker died between the commit and the send. They
            # need no engine, so they go out now, a step before the first new token. Text
            # is left out (the coordinator decodes them).
            yield TokenChunk(
                request_id,
                from_index,
                token_ids=point.committed_token_ids[from_index:],
                worker_id=self._ctx.config.worker_id,
            )
        event_index = max(from_index, point.next_index)
        first = True
        async with contextlib.aclosing(
            self._streams.stream(request, point.next_index, kv_params)
        ) as steps:
            async for chunk, cached_tokens in steps:
                if first:
                    first = False
                    if self._ctx.staging is not None:  # loaded by now: the copies can go
                        self._ctx.staging.drop(request_id)
                    yield self._recovered_chunk(
                        point, event_index, len(point.engine_prompt), cached_tokens or 0, staged
                    )
                trimmed = _from_index(chunk, from_index)
                if trimmed is not None:
                    yield trimmed

    async def _point(
        self,
        request_id: str,
        from_index: int,
        delivered: tuple[int, ...],
        request: GenerationRequest | None = None,
    ) -> ResumePoint:
        """Where the request continues from: the store's state, as its client saw it; when
        the store cannot be reached and the caller sent the request and its client's tokens
        (a migration whose KV came peer to peer), those."""
        if delivered and len(delivered) != from_index:
            raise InvalidRequest(
                f"delivered_token_ids holds {len(delivered)} tokens but from_index is "
                f"{from_index}: they are the client's tokens before it"
            )
        await self._streams.take_over(request_id, TAKE_OVER_WAIT_SECONDS)
        self._streams.check_admission(request_id)
        if self._ctx.store is None or self._ctx.committer is None:
            raise CannotResume("this worker runs without a store (--redis-url); it cannot resume")
        try:
            point = await asyncio.to_thread(
                read_resume_point, self._ctx.store, request_id, self._ctx.fingerprint
            )
        except StoreUnavailable as exc:
            if request is None or request.request_id != request_id:
                raise
            log.warning(
                "resume of %s: the store cannot be reached (%s); resuming from the request "
                "and the %d tokens its client received",
                request_id,
                exc,
                len(delivered),
            )
            return ResumePoint(self._unstored_record(request), delivered, stored_tokens=0)
        return point.continued_from(delivered)

    def _unstored_record(self, request: GenerationRequest) -> RequestRecord:
        """The record a resume without the store stands on (the committer writes it once
        the store answers)."""
        return RequestRecord(
            request_id=request.request_id,
            model_fingerprint=self._ctx.fingerprint,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_to_record(request.sampling),
            kv_block_tokens=self._ctx.require_shape().kv_chunk_tokens,
            status=RequestStatus.PAUSED,
            owner_worker_id=self._ctx.config.worker_id,
            tenant=request.tenant,
            sla_class=request.sla_class.name,
            priority=request.priority,
        )

    def _all_produced(self, point: ResumePoint, from_index: int) -> list[TokenChunk]:
        """Ends a request whose every token was produced: the event and the rest, ended."""
        assert self._ctx.committer is not None
        request_id = point.record.request_id
        self._ctx.committer.admit(point.record, point.committed_token_ids, point.stored_tokens)
        self._ctx.committer.finish(request_id, RequestStatus.FINISHED, FinishReason.LENGTH.name)
        return [
            self._recovered_chunk(point, from_index, len(point.engine_prompt), 0),
            TokenChunk(
                request_id,
                min(from_index, point.next_index),
                token_ids=point.committed_token_ids[from_index:],
                finish_reason=FinishReason.LENGTH,
                worker_id=self._ctx.config.worker_id,
            ),
        ]

    def _finished_chunk(self, point: ResumePoint, from_index: int) -> TokenChunk:
        name = point.record.finish_reason
        if name in (FinishReason.STOP.name, FinishReason.LENGTH.name):
            reason = FinishReason[name]
        else:  # written before finishes said how
            reason = FinishReason.LENGTH if not point.remaining_tokens else FinishReason.STOP
        return TokenChunk(
            point.record.request_id,
            min(from_index, point.next_index),
            token_ids=point.committed_token_ids[from_index:],
            finish_reason=reason,
            worker_id=self._ctx.config.worker_id,
        )

    def _recovered_chunk(
        self,
        point: ResumePoint,
        index: int,
        prompt_tokens: int,
        cached_tokens: int,
        staged_blocks: int = 0,
    ) -> TokenChunk:
        # vLLM computes the last prompt token in any case (its output is the next token);
        # everything else it did not load counts as recomputed, unless nothing is computed
        # (every token was committed) or no worker had computed any of it (it was paused
        # while still queued: this prefill is its first).
        recomputed = max(0, prompt_tokens - cached_tokens - 1) if prompt_tokens else 0
        if point.never_computed or not point.remaining_tokens:
            recomputed = 0
        # A request paused on a notice migrated; any other was recovered after a loss.
        kind = (
            EventKind.MIGRATED
            if point.record.status is RequestStatus.PAUSED
            else EventKind.RECOVERED
        )
        detail = (
            f"resumed at index {point.next_index}: {cached_tokens} of {prompt_tokens} "
            f"context tokens loaded, {recomputed} recomputed"
        )
        if staged_blocks:
            detail += f"; {staged_blocks} blocks prefetched before the pause"
        if point.stored_tokens is not None:
            detail += (
                f"; continued from the {point.next_index} tokens its client received "
                f"(the store held {point.stored_tokens})"
            )
        stats = self._ctx.stats
        refused = stats.take_mac_rejected(point.record.request_id) if stats is not None else 0
        if refused:
            blocks, their = ("block", "its") if refused == 1 else ("blocks", "their")
            detail += f"; {refused} stored {blocks} refused by {their} MAC (recomputed)"
        refused = stats.take_layout_rejected(point.record.request_id) if stats is not None else 0
        if refused:
            noun = "block" if refused == 1 else "blocks"
            detail += (
                f"; {refused} stored {noun} written in another KV layout (tensor parallel "
                f"degree, backend, dtype or block size differ from this worker's; recomputed)"
            )

        log.info("request %s %s", point.record.request_id, detail)
        return TokenChunk(
            request_id=point.record.request_id,
            index=index,
            event=Event(
                kind=kind,
                from_worker=point.record.owner_worker_id,
                to_worker=self._ctx.config.worker_id,
                recomputed_tokens=recomputed,
                loaded_tokens=cached_tokens,
                detail=detail,
            ),
            worker_id=self._ctx.config.worker_id,
        )

    async def prefetch(self, request_id: str) -> PrefetchOutcome:
        """A migration stage on this worker as its target: stage the request's persisted full
        blocks (see prefetch.py). Raises CannotResume, RecordNotFound, WorkerDraining,
        StagingFull or StoreUnavailable."""
        if self._ctx.store is None or self._ctx.staging is None:
            raise CannotResume(
                "this worker has no store or no staging memory (--redis-url, --staging-mib)"
            )
        if self._streams.draining:
            raise WorkerDraining("the worker is draining and takes no migrations")
        if self._ctx.llm is None:
            raise EngineNotReady("the engine is still loading the model")
        outcome = await asyncio.to_thread(
            prefetch_stage,
            self._ctx.store,
            self._ctx.staging,
            request_id,
            self._ctx.fingerprint,
            self._ctx.require_shape().kv_chunk_tokens,
            shard_suffixes(self._ctx.config.tensor_parallel_size),
        )
        if outcome.new_blocks:
            await self._warm(request_id, outcome.staged_prefix, outcome.tenant)
        return outcome

    async def _warm(
        self, request_id: str, staged_prefix: tuple[int, ...], tenant: str = ""
    ) -> None:
        """Loads the staged blocks into vLLM's cache ahead of the resume: a one-token request
        over the staged tokens (plus the next one, which vLLM computes itself) whose prefill
        the connector serves from staging. Once it ends, vLLM keeps the blocks in its prefix
        cache, so the resume after the pause finds them there and loads only the rest.
        Best effort: if the blocks are evicted first, or the warm-up fails, the resume loads
        them from staging as before."""
        if not staged_prefix:
            return
        warm_id = request_id + WARM_REQUEST_SUFFIX
        warm = GenerationRequest(
            warm_id,
            staged_prefix,
            Sampling(max_tokens=1, temperature=0.0, ignore_eos=True),
            tenant=tenant,
        )
        # vLLM needs one prompt token to compute: the first of the next block will do, as
        # any token would (its KV is not kept); the block hashes only cover full blocks.
        prompt = (*staged_prefix, staged_prefix[-1])
        params = self._streams.sampling_params(
            warm, {KV_PARAM_REQUEST_ID: request_id, KV_PARAM_RESUME: True, KV_PARAM_WARM: True}
        )

        async def run() -> None:
            async for _ in self._ctx.llm.generate(
                self._streams.prompt(request_id, prompt, tenant), params, request_id=warm_id
            ):
                pass

        try:
            await asyncio.wait_for(run(), WARM_TIMEOUT_SECONDS)
        except Exception as exc:  # the resume loads the staged blocks itself
            log.warning("warm-up of %s's staged blocks failed: %r", request_id, exc)
            await self._streams.abort_quietly(warm_id)

    def drop_prefetch(self, request_id: str) -> int:
        """Frees what was staged for ``request_id`` (an aborted handshake)."""
        return self._ctx.staging.drop(request_id) if self._ctx.staging is not None else 0


def _from_index(chunk: TokenChunk, from_index: int) -> TokenChunk | None:
    """The part of ``chunk`` at or after ``from_index`` (the client already has the rest).

    A chunk cut in two loses its text: the text of the kept tokens alone is not known here.
    """
    end = chunk.index + len(chunk.token_ids)
    if chunk.index >= from_index:
        return chunk
    if end <= from_index and not chunk.finished:
        return None
    return chunk.from_index(from_index, text="")
