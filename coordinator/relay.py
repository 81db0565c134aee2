"""The relay: one request in flight through the coordinator, and every client reading it.

The relay keeps each output chunk it has accepted, in order, so that it can serve any
number of readers: a reader that attaches from index i gets the kept tokens from i on, then
follows live. Chunks from a worker are deduped by index — whatever a new worker repeats
after a switch is dropped — so every reader sees indices 0..n-1 once each, in order.

    worker A ──chunks──▶ ┐                     ┌──▶ reader (Generate)
                         ├─ dedupe ─▶ kept ────┼──▶ reader (Attach from 7)
    worker B ──chunks──▶ ┘   (by index)        └──▶ …

`_run` is the one place that handles an interrupted worker (its stream broke, the heartbeat
lost it, a termination notice came): it asks the failover policy for a new source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from common.errors import InvalidRequest
from common.requests import Event, EventKind, FinishReason, GenerationRequest, TokenChunk
from coordinator.admission import Admission, Lease, Ticket
from coordinator.errors import (
    IndexOutOfRange,
    NoWorkerInTime,
    RequestLost,
    WorkerStreamBroken,
)
from coordinator.failover import FailoverPolicy, Interruption, InterruptionKind

log = logging.getLogger(__name__)

REPLACEMENT_CHARACTER = "\ufffd"  # a decoder's text for the bytes of an unfinished character


class RelayStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SWITCHING = "switching"  # between a broken worker and the next
    FINISHED = "finished"


class RelayObserver(Protocol):
    """Told about a relay's progress (metrics, request records). Must not raise."""

    def placed(self, relay: Relay) -> None: ...

    def delivered(self, relay: Relay, new_tokens: int) -> None: ...

    def finished(self, relay: Relay) -> None: ...

    def unread(self, relay: Relay) -> None:
        """The last reader of a running request left (its client hung up or was cut off)."""
        ...

    def read_to_end(self, relay: Relay) -> None:
        """A reader is handed the request's last chunk (once per relay), to send at once."""
        ...


class TokenTexts(Protocol):
    """Decodes output tokens (the coordinator's tokenizer, see prompt_tokenizer.py)."""

    def span(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], start: int, end: int
    ) -> str | None:
        """The text that output tokens ``start``..``end`` add after the ones before them;
        None when there is no tokenizer."""
        ...


class Relay:
    """One request. Create, then `start()`; read with `follow(from_index)`."""

    def __init__(
        self,
        request: GenerationRequest,
        ticket: Ticket,
        admission: Admission,
        failover: FailoverPolicy,
        observer: RelayObserver,
        texts: TokenTexts,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request = request
        self._ticket = ticket
        self._admission = admission
        self._failover = failover
        self._observer = observer
        self._texts = texts
        self._clock = clock
        self.status = RelayStatus.QUEUED
        self.lease: Lease | None = None
        self.token_ids: list[int] = []
        self._chunks: list[TokenChunk] = []
        self._advanced = asyncio.Event()
        self.finish_reason = FinishReason.NONE
        self.error: BaseException | None = None  # raised to readers (the request's own fault)
        self.created_monotonic = clock()
        self.first_token_monotonic: float | None = None
        self.finished_monotonic: float | None = None
        self.interruptions = 0
        self._cancel_requested = False
        self.adopted = False
        self._readers = 0
        self.readers_left = 0  # how many times every reader had left (disconnect grace)
        self._end_read = False
        self._replaying = False  # a resumed source's first chunks: their text is decoded here
        self._resume_event_seen = False
        self._text_pending_from: int | None = None  # first token whose text waits
        self._interruption: Interruption | None = None
        self._stream_task: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- queries -------------------------------------------------------------------------

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def delivered_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RelayStatus.FINISHED

    @property
    def readers(self) -> int:
        return self._readers

    @property
    def worker_id(self) -> str:
        return self.lease.entry.worker_id if self.lease is not None else ""

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, adopted: bool = False) -> None:
        """``adopted``: the request was started by another coordinator (which went away)
        and is persisted: its worker stream is a Worker.Resume from index 0, which replays
        every committed token, then goes on."""
        self.adopted = adopted
        self._task = asyncio.get_running_loop().create_task(
            self._run(adopted), name=f"relay-{self.request_id}"
        )

    def replay(self, output_ids: Sequence[int], reason: FinishReason) -> None:
        """An adopted request that finished while no coordinator relayed it: ``output_ids``
        (its whole output, from the store) and its end are kept for readers at once; no
        worker is involved."""
        self.adopted = True
        output = tuple(output_ids)
        text = self._texts.span(self.request.prompt_token_ids, output, 0, len(output)) or ""
        self._chunks.append(TokenChunk(self.request_id, 0, output, text=text, finish_reason=reason))
        self.token_ids.extend(output)
        self.finish_reason = reason
        self.status = RelayStatus.FINISHED
        self.finished_monotonic = self._clock()
        self._wake()

    async def stop(self) -> None:
        """The coordinator stops: the relay lets go of its worker (which pauses the request
        and keeps it resumable, see adoption.py) and ends for its readers, if any are left."""
        if self._task is not None and not self.finished:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def wait_finished(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    def interrupt(self, kind: InterruptionKind, detail: str) -> None:
        """Stops reading the current worker; `_run` hands the request to the failover policy."""
        if self.status != RelayStatus.RUNNING or self._stream_task is None:
            return
        self._interruption = Interruption(kind, self.worker_id, detail)
        self._stream_task.cancel()

    async def cancel(self) -> bool:
        """Stops the request (the worker aborts it); False if it had already finished."""
        if self.finished:
            return False
        self._cancel_requested = True
        if self.status == RelayStatus.QUEUED:
            self._admission.withdraw(self._ticket)
            if self._task is not None:
                self._task.cancel()
            await asyncio.gather(*(t for t in [self._task] if t), return_exceptions=True)
            return True
        lease = self.lease
        if lease is not None:
            try:
                await lease.entry.client.abort(self.request_id)
            except Exception as exc:  # the worker may be gone: cut our side anyway
                log.warning("abort of %s on %s failed: %s", self.request_id, lease.entry, exc)
        if not self.finished and self._stream_task is not None:
            # The worker answers an abort with a CANCELLED chunk; if it cannot, cut here.
            done, _ = await asyncio.wait({self._stream_task}, timeout=5.0)
            if not done:
                self._stream_task.cancel()
        await asyncio.gather(*(t for t in [self._task] if t), return_exceptions=True)
        return True

    async def _run(self, adopted: bool) -> None:
        try:
            lease = await self._admission.wait(self._ticket)
            self._take(lease)
            client = lease.entry.client
            chunks = client.resume(self.request_id, 0) if adopted else client.generate(self.request)
            self._replaying, self._resume_event_seen = adopted, False
            self._text_pending_from = None
            while True:
                why = await self._stream(chunks)
                if why is None:
                    return
                self.interruptions += 1
                self.status = RelayStatus.SWITCHING
                if why.kind == InterruptionKind.STREAM_BROKEN:
                    self._admission.suspect(lease.entry)
                takeover = await self._failover.take_over(
                    self.request, tuple(self.token_ids), lease, why, self.interruptions
                )
                lease.release()
                lease = takeover.lease
                self._take(lease)
                chunks = takeover.chunks
                self._replaying, self._resume_event_seen = True, False
                self._text_pending_from = None
        except asyncio.CancelledError:
            if self._cancel_requested:
                self._finish(FinishReason.CANCELLED)
            else:
                self._finish(FinishReason.ERROR, detail="the coordinator stopped")
            raise
        except InvalidRequest as exc:
            self.error = exc
            self._finish(FinishReason.ERROR)
        except NoWorkerInTime as exc:
            # Never placed: no chunk at all, readers get the refusal and its retry hint.
            self.error = exc
            self._finish(FinishReason.ERROR, publish=False)
        except RequestLost as exc:
            log.error("request %s lost: %s", self.request_id, exc)
            self._finish(FinishReason.ERROR, detail=str(exc))
        except Exception as exc:
            log.exception("request %s failed", self.request_id)
            self._finish(FinishReason.ERROR, detail=f"{type(exc).__name__}: {exc}")
        finally:
            if self.lease is not None:
                self.lease.release()
            if not self.finished:
                self._finish(FinishReason.ERROR)

    def _take(self, lease: Lease) -> None:
        self.lease = lease
        self.status = RelayStatus.RUNNING
        self._observer.placed(self)

    async def _stream(self, chunks: AsyncIterator[TokenChunk]) -> Interruption | None:
        """Reads one worker's stream to its end; the interruption if it did not finish."""
        self._interruption = None
        self._stream_task = asyncio.get_running_loop().create_task(self._consume(chunks))
        try:
            await self._stream_task
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._interruption is None or (task is not None and task.cancelling()):
                self._stream_task.cancel()
                raise
            return self._interruption
        except WorkerStreamBroken as exc:
            return Interruption(InterruptionKind.STREAM_BROKEN, self.worker_id, str(exc))
        finally:
            await _close(chunks)
        if not self.finished:
            detail = f"worker {self.worker_id} paused the request on a termination notice"
            return Interruption(InterruptionKind.NOTICE, self.worker_id, detail)
        return None

    async def _consume(self, chunks: AsyncIterator[TokenChunk]) -> None:
        """Returns when the request finished, or when the worker paused it on a notice (its
        stream ends cleanly right after a NOTICE event: the request is persisted, not over)."""
        last: TokenChunk | None = None
        async for chunk in chunks:
            self._ingest(chunk)
            if self.finished:
                return
            last = chunk
        if last is not None and last.event is not None and last.event.kind == EventKind.NOTICE:
            return
        raise WorkerStreamBroken(f"the stream of worker {self.worker_id} ended without a finish")

    def _ingest(self, chunk: TokenChunk) -> None:
        """Accepts the part of ``chunk`` no reader has had yet (dedupe by index)."""
        delivered = self.delivered_tokens
        if chunk.index > delivered and chunk.token_ids:
            raise WorkerStreamBroken(
                f"worker {self.worker_id} sent index {chunk.index}, expected {delivered}"
            )
        skip = max(0, delivered - chunk.index)
        new_ids = chunk.token_ids[skip:]
        finish = chunk.finish_reason
        if finish == FinishReason.CANCELLED and not self._cancel_requested:
            # Cut by the worker (drained, stopped), not by the client: the request goes on.
            finish = FinishReason.NONE
            if new_ids:
                self._publish(dataclasses.replace(chunk, finish_reason=finish), delivered, new_ids)
            raise WorkerStreamBroken(f"worker {self.worker_id} cut the request")
        if not new_ids and chunk.event is None and not finish:
            return
        self._publish(chunk, delivered, new_ids)
        if finish:
            self._finish(finish, publish=False)

    def _publish(self, chunk: TokenChunk, index: int, token_ids: tuple[int, ...]) -> None:
        """Keeps ``token_ids``, the tail of ``chunk``'s tokens from output ``index`` on, with
        their logprobs (cut the same way: they stay attached to their tokens)."""
        skip = len(chunk.token_ids) - len(token_ids)
        whole = skip == 0
        if self._replaying and token_ids:
            text = self._replayed_text(chunk, index, token_ids)
        else:
            text = chunk.text if whole else self._tail_text(chunk, index, self.token_ids)
        if self._replaying and chunk.event is not None:
            self._resume_event_seen = True
        kept = TokenChunk(
            request_id=self.request_id,
            index=index,
            token_ids=token_ids,
            text=text,
            finish_reason=chunk.finish_reason,
            event=chunk.event,
            worker_id=chunk.worker_id or self.worker_id,
            engine_timing=chunk.engine_timing,
            logprobs=chunk.logprobs[skip:],
        )
        self._chunks.append(kept)
        if token_ids:
            if self.first_token_monotonic is None:
                self.first_token_monotonic = self._clock()
            self.token_ids.extend(token_ids)
            self._observer.delivered(self, len(token_ids))
        self._wake()

    def _replayed_text(self, chunk: TokenChunk, index: int, token_ids: tuple[int, ...]) -> str:
        """The text of a resumed source's first tokens, decoded here: those it replays from
        the store come without text, and its engine's first output after the resume event
        may carry the text of the whole resumed prompt. As vLLM's detokenizer does, the
        bytes of an unfinished character wait for the tokens that finish it; the source's
        own text is taken again from the first output after the event that ends whole."""
        output = [*self.token_ids, *token_ids]
        start = self._text_pending_from if self._text_pending_from is not None else index
        span = self._texts.span(self.request.prompt_token_ids, output, start, len(output))
        if span is None:  # no tokenizer here: nothing better than what came
            self._replaying = False
            return chunk.text
        if span.endswith(REPLACEMENT_CHARACTER) and not chunk.finish_reason:
            self._text_pending_from = start
            return ""
        self._text_pending_from = None
        if self._resume_event_seen:
            self._replaying = False
        return span

    def _finish(self, reason: FinishReason, detail: str = "", publish: bool = True) -> None:
        if self.finished:
            return
        if publish:
            event = (
                Event(EventKind.NONE, from_worker=self.worker_id, detail=detail) if detail else None
            )
            self._chunks.append(
                TokenChunk(
                    self.request_id,
                    self.delivered_tokens,
                    finish_reason=reason,
                    event=event,
                    worker_id=self.worker_id,
                )
            )
        self.finish_reason = reason
        self.status = RelayStatus.FINISHED
        self.finished_monotonic = self._clock()
        self._observer.finished(self)
        self._wake()

    def _wake(self) -> None:
        self._advanced.set()
        self._advanced = asyncio.Event()

    # -- readers -------------------------------------------------------------------------

    async def follow(self, from_index: int = 0) -> AsyncIterator[TokenChunk]:
        """Every chunk from output index ``from_index`` on: the kept ones, then live ones,
        until the finish. Raises IndexOutOfRange for an index past the end, and the
        request's own error (InvalidRequest, NoWorkerInTime) if it failed with one.

        A request still queued when its last reader goes (the client hung up, its deadline
        passed) leaves the queue: nobody would read what it produced. Once running, it runs
        on and stays attachable; the observer is told (`unread`), and the dispatcher cancels
        it if nobody attaches within its disconnect grace."""
        self._check_index(from_index)
        self._readers += 1
        try:
            cursor = 0
            told = False
            while True:
                while cursor < len(self._chunks):
                    kept = self._chunks[cursor]
                    chunk = self._slice(kept, from_index)
                    event_only = kept.event is not None and not kept.token_ids
                    if chunk is None and event_only and self.adopted and not told:
                        # Readers of an adopted request may join past the index where the
                        # resume's event sits: each is told how its request went on.
                        chunk = dataclasses.replace(kept, index=from_index)
                    told = told or event_only
                    cursor += 1
                    if chunk is not None:
                        if chunk.finished:
                            self._hand_end()
                        yield chunk
                if self.finished and cursor == len(self._chunks):
                    if self.error is not None:
                        raise self.error
                    return
                await self._advanced.wait()
        finally:
            self._readers -= 1
            if not self._readers and self.status == RelayStatus.QUEUED:
                self._abandon()
            elif not self._readers and not self.finished:
                self.readers_left += 1
                self._observer.unread(self)

    def _hand_end(self) -> None:
        """A reader is handed the last chunk: its client has the whole request once the
        front sends it (a client often hangs up at once, so nothing later is waited for)."""
        if self.error is None and not self._end_read:
            self._end_read = True
            self._observer.read_to_end(self)

    def _abandon(self) -> None:
        """Takes a queued request out of its queue and ends it as CANCELLED (synchronous:
        it runs while a reader's generator is being closed)."""
        log.info("request %s: no reader left while queued; withdrawn", self.request_id)
        self._cancel_requested = True
        self._admission.withdraw(self._ticket)
        if self._task is not None:
            self._task.cancel()

    def _slice(self, chunk: TokenChunk, from_index: int) -> TokenChunk | None:
        return slice_chunk(
            chunk, from_index, self.request.prompt_token_ids, self.token_ids, self._texts
        )

    def _tail_text(self, chunk: TokenChunk, from_index: int, output_ids: list[int]) -> str:
        return tail_text(chunk, from_index, self.request.prompt_token_ids, output_ids, self._texts)

    def _check_index(self, from_index: int) -> None:
        end = self.delivered_tokens if self.finished else self.request.sampling.max_tokens
        if from_index > end:
            state = "has" if self.finished else "may have at most"
            raise IndexOutOfRange(
                f"request {self.request_id} {state} {end} output tokens; "
                f"cannot attach from index {from_index}"
            )


def slice_chunk(
    chunk: TokenChunk,
    from_index: int,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    texts: TokenTexts,
) -> TokenChunk | None:
    """The part of a kept chunk at or after output index ``from_index``, with the text of
    just those tokens; None if nothing of it is. ``output_ids`` holds the request's output
    at least up to the chunk's start."""
    if chunk.index >= from_index:
        return chunk
    end = chunk.index + len(chunk.token_ids)
    if end <= from_index:
        if chunk.finished and end == from_index:
            return dataclasses.replace(chunk.from_index(from_index, text=""), event=None)
        return None
    return chunk.from_index(from_index, tail_text(chunk, from_index, prompt_ids, output_ids, texts))


def tail_text(
    chunk: TokenChunk,
    from_index: int,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    texts: TokenTexts,
) -> str:
    """The text of ``chunk``'s tokens from ``from_index`` on: what the chunk's own text holds
    after the text of its tokens before that index — so that a reader who joins mid-chunk,
    or a switch that repeats part of a chunk, gets exactly the text of the tokens it is
    given. Decoded afresh when the chunk's text does not start that way; empty when the
    coordinator has no tokenizer."""
    output = [*output_ids[: chunk.index], *chunk.token_ids]
    head = texts.span(prompt_ids, output, chunk.index, from_index)
    if head is not None and chunk.text.startswith(head):
        return chunk.text[len(head) :]
    return texts.span(prompt_ids, output, from_index, len(output)) or ""


async def _close(chunks: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception as exc:  # a generator torn down mid-call may complain; nothing to do
            log.debug("closing a worker stream: %s", exc)
