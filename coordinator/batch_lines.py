"""One line of a batch job, run as ordinary requests through the dispatcher: admitted in
the BATCH class, relayed, migrated on a notice and resumed after a loss like any other.

    line body ─▶ parse_body (as the front does) ─▶ Dispatcher.submit(id, BATCH) ─▶ Relay
    a restarted coordinator: Dispatcher.attach(id, 0) ─▶ the request where it ran
                             (UnknownRequest: it cannot be found ─▶ NotAttachable)

The answer is the body the HTTP front would have given for the same request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.errors import InvalidRequest, ServiceError, is_unexpected
from common.requests import EventKind, FinishReason, SlaClass, TokenChunk
from coordinator.batch_files import BatchLine
from coordinator.dispatcher import Dispatcher
from coordinator.errors import NoWorkerAvailable, NoWorkerInTime, QueueFull, UnknownRequest
from coordinator.openai_requests import ParsedBody, parse_body
from coordinator.openai_shapes import ChatShape, CompletionShape, Shape, combined


class Busy(Exception):
    """No room for the line now (a full queue, no worker, none within the capacity wait):
    the runner tries it again."""


class NotAttachable(Exception):
    """The line's request cannot be picked up where it ran (never started, finished and
    gone, or its resume failed): it never got a result, so it is run again from scratch."""


@dataclass
class LineOutcome:
    status_code: int
    body: dict[str, Any]
    migrated: int = 0  # MIGRATED events (moved on a notice)
    recovered: int = 0  # RECOVERED events (resumed after a loss)
    recomputed_tokens: int = 0
    cancelled: bool = False  # its request was cancelled (finish "abort")


@dataclass
class _Stats:
    migrated: int = 0
    recovered: int = 0
    recomputed_tokens: int = 0
    finishes: list[FinishReason] = field(default_factory=list)

    def note(self, chunk: TokenChunk) -> None:
        if chunk.event is not None and chunk.event.kind == EventKind.MIGRATED:
            self.migrated += 1
            self.recomputed_tokens += chunk.event.recomputed_tokens
        elif chunk.event is not None and chunk.event.kind == EventKind.RECOVERED:
            self.recovered += 1
            self.recomputed_tokens += chunk.event.recomputed_tokens


class LineRunner(Protocol):
    """What the job runner needs of the cluster (a fake in unit tests)."""

    async def run(
        self, request_id: str, line: BatchLine, tenant: str, attach: bool
    ) -> LineOutcome: ...

    async def cancel(self, request_id: str) -> None: ...


def _error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, ServiceError) and not is_unexpected(exc):
        status, kind, code = exc.http_status, exc.http_type, exc.http_code
    else:
        status, kind, code = 500, "internal_error", None
    message = str(exc) or type(exc).__name__
    return status, {"error": {"message": message, "type": kind, "code": code or status}}


class DispatcherLines:
    """Runs lines on this coordinator's dispatcher."""

    def __init__(self, dispatcher: Dispatcher, model_name: str) -> None:
        self._dispatcher = dispatcher
        self._model_name = model_name
        self._running: dict[str, list[str]] = {}  # a line's request id -> its requests

    def _parse(self, line: BatchLine) -> ParsedBody:
        body = line.body
        if body.get("stream"):
            raise InvalidRequest("stream is not supported in a batch")
        if str(body.get("sla_class", "batch")).lower() != "batch":
            raise InvalidRequest("a batch line runs in the batch class (sla_class 'batch')")
        if "request_id" in body:
            raise InvalidRequest("request_id is set by the batch (custom_id names the line)")
        return parse_body(
            self._dispatcher, self._model_name, body, line.url.endswith("/chat/completions")
        )

    async def run(self, request_id: str, line: BatchLine, tenant: str, attach: bool) -> LineOutcome:
        await self._dispatcher.tokenizer.ready()
        try:
            parsed = self._parse(line)
        except NoWorkerAvailable as exc:
            raise Busy(str(exc)) from exc
        except Exception as exc:
            return LineOutcome(*_error_body(exc))
        chat = line.url.endswith("/chat/completions")
        ids = [request_id]
        if len(parsed.prompts) > 1:  # one request per prompt, as on the front
            ids = [f"{request_id}-{i}" for i in range(len(parsed.prompts))]
        self._running[request_id] = ids
        shape: type[Shape] = ChatShape if chat else CompletionShape
        prefix = "chatcmpl-" if chat else "cmpl-"
        completion_id = prefix + uuid.uuid4().hex
        shapes: list[Shape] = [
            shape(completion_id, self._model_name, len(p), i) for i, p in enumerate(parsed.prompts)
        ]
        for one, prompt_ids in zip(shapes, parsed.prompts, strict=True):
            one.decode = self._dispatcher.tokenizer.whole_decoder(prompt_ids)
            if parsed.sampling.logprobs is not None:
                one.with_logprobs(self._dispatcher.tokenizer.candidate_texts(prompt_ids))
        stats = _Stats()
        try:
            streams = [
                self._stream(rid, prompt, parsed, tenant, attach)
                for rid, prompt in zip(ids, parsed.prompts, strict=True)
            ]
            await asyncio.gather(
                *(_collect(s, sh, stats) for s, sh in zip(streams, shapes, strict=True))
            )
        except (Busy, NotAttachable):
            raise
        except Exception as exc:
            if attach:  # e.g. its worker finished it in the gap and cannot resume it
                raise NotAttachable(f"{request_id}: {exc}") from exc
            return LineOutcome(*_error_body(exc))
        finally:
            self._running.pop(request_id, None)
        outcome = LineOutcome(200, combined(shapes))
        outcome.migrated, outcome.recovered = stats.migrated, stats.recovered
        outcome.recomputed_tokens = stats.recomputed_tokens
        outcome.cancelled = FinishReason.CANCELLED in stats.finishes
        if FinishReason.ERROR in stats.finishes and attach:
            raise NotAttachable(f"{request_id} ended in an error where it was re-attached")
        if FinishReason.ERROR in stats.finishes:
            outcome.status_code = 500
            outcome.body = {
                "error": {"message": "the request failed", "type": "internal_error", "code": 500}
            }
        return outcome

    async def _stream(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        parsed: ParsedBody,
        tenant: str,
        attach: bool,
    ) -> AsyncIterator[TokenChunk]:
        if attach:
            started = False
            try:
                async for chunk in self._dispatcher.attach(request_id, 0):
                    started = True
                    yield chunk
            except UnknownRequest as exc:
                if started:
                    raise
                raise NotAttachable(request_id) from exc
            return
        try:
            relay = self._dispatcher.submit(
                request_id, prompt, parsed.sampling, SlaClass.BATCH, tenant
            )
        except (QueueFull, NoWorkerAvailable) as exc:
            raise Busy(str(exc)) from exc
        try:
            async for chunk in relay.follow(0):
                yield chunk
        except NoWorkerInTime as exc:  # it waited through a capacity gap: tried again later
            raise Busy(str(exc)) from exc

    async def cancel(self, request_id: str) -> None:
        for rid in self._running.get(request_id, []):
            if self._dispatcher.existing(rid) is not None:
                await self._dispatcher.cancel(rid)


async def _collect(chunks: AsyncIterator[TokenChunk], shape: Shape, stats: _Stats) -> None:
    async for chunk in chunks:
        stats.note(chunk)
        shape.add(chunk)
        if chunk.finished:
            stats.finishes.append(chunk.finish_reason)
