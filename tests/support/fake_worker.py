"""In-process stand-ins for a worker and its context daemon, scripted by the test.

`FakeWorker` is a `coordinator.worker_client.WorkerEndpoint`: every Generate or Resume opens a
`ScriptedStream` that the test feeds (``emit`` tokens, ``finish``, ``pause`` on a notice,
``end`` without a finish, ``fail``); prefetch answers come from a per-request script; every
call is written to ``calls`` (share one list between fakes to see the order across them).
`FakeDaemon` is a `coordinator.daemon_client.DaemonEndpoint` whose Flush answers with the
reports the test gives it.

Output token ids are ``token_id(index)``, so a test can tell any index from its token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from common.messages import NoticeEvent
from common.requests import Event, EventKind, FinishReason, GenerationRequest, TokenChunk
from context_daemon.worker_link import FlushReport
from coordinator.errors import NothingPersisted, WorkerStreamBroken
from coordinator.worker_client import PrefetchRefused, PrefetchResult, WorkerCapacity
from tests.support.wait import wait_until_async

TOKEN_BASE = 1000


def token_id(index: int) -> int:
    """The token a fake worker generates at output index ``index``."""
    return TOKEN_BASE + index


def token_ids(start: int, end: int) -> tuple[int, ...]:
    return tuple(token_id(i) for i in range(start, end))


@dataclass(frozen=True)
class Call:
    """One call a fake received: ``what`` (generate, resume, abort, prefetch, drop_prefetch,
    drain, flush), on ``address``, for ``request_id``; ``index`` is Resume's from_index and
    ``delivered`` the client's tokens it carried (left out of comparisons)."""

    address: str
    what: str
    request_id: str = ""
    index: int = 0
    delivered: tuple[int, ...] = field(default=(), compare=False)


_END = object()


class ScriptedStream:
    """One Generate or Resume stream; whatever the test puts in comes out in order."""

    def __init__(self, worker: FakeWorker, call: Call) -> None:
        self.worker = worker
        self.call = call
        self._items: asyncio.Queue[object] = asyncio.Queue()
        self.closed = False  # the reader stopped reading (finished, switched, cancelled)

    @property
    def request_id(self) -> str:
        return self.call.request_id

    def emit(self, start: int, end: int, finish: FinishReason = FinishReason.NONE) -> None:
        """One chunk with the tokens of output indices ``start``..``end - 1``."""
        self.put(
            TokenChunk(
                self.request_id,
                start,
                token_ids(start, end),
                finish_reason=finish,
                worker_id=self.worker.worker_id,
            )
        )

    def finish(self, index: int, reason: FinishReason = FinishReason.LENGTH) -> None:
        """A finish with no token, at output index ``index``."""
        self.put(TokenChunk(self.request_id, index, finish_reason=reason))

    def pause(self, index: int) -> None:
        """What a noticed worker sends: a NOTICE event, then the stream ends cleanly."""
        event = Event(EventKind.NOTICE, from_worker=self.worker.worker_id)
        self.put(TokenChunk(self.request_id, index, event=event))
        self.end()

    def put(self, chunk: TokenChunk) -> None:
        self._items.put_nowait(chunk)

    def end(self) -> None:
        """The stream ends here (without a finish unless one was sent)."""
        self._items.put_nowait(_END)

    def fail(self, error: BaseException | None = None) -> None:
        """The stream breaks (a worker that died mid-stream, by default)."""
        self._items.put_nowait(error or WorkerStreamBroken(f"worker {self.worker.address} died"))

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        try:
            while True:
                item = await self._items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, TokenChunk)
                yield item
        finally:
            self.closed = True


@dataclass
class FakeWorker:
    """A worker at ``address``. ``capacity`` is what Stats answers (``down``: no answer);
    ``persisted``: the request ids whose Resume finds a record (None: every one)."""

    address: str
    capacity: WorkerCapacity | None = None
    down: bool = False
    persisted: set[str] | None = None
    calls: list[Call] = field(default_factory=list)
    prefetch_script: dict[str, list[PrefetchResult | BaseException]] = field(default_factory=dict)
    closed: bool = False
    streams: list[ScriptedStream] = field(default_factory=list)
    _opened: asyncio.Queue[ScriptedStream] = field(default_factory=asyncio.Queue)

    @property
    def worker_id(self) -> str:
        return self.capacity.worker_id if self.capacity else self.address

    async def next_stream(self, timeout: float = 5.0) -> ScriptedStream:
        """The next stream a caller opens here (waits for it)."""
        return await asyncio.wait_for(self._opened.get(), timeout)

    async def stream_of(self, request_id: str, timeout: float = 5.0) -> ScriptedStream:
        """The open stream of ``request_id`` here (waits for one to be opened)."""

        def found() -> ScriptedStream | None:
            mine = [s for s in self.open_streams() if s.request_id == request_id]
            return mine[-1] if mine else None

        await wait_until_async(found, f"a stream of {request_id} on {self.address}", timeout)
        stream = found()
        assert stream is not None
        return stream

    def open_streams(self) -> list[ScriptedStream]:
        return [stream for stream in self.streams if not stream.closed]

    # -- WorkerEndpoint ------------------------------------------------------------------

    async def close(self) -> None:
        self.closed = True

    async def stats(self) -> WorkerCapacity:
        if self.down or self.capacity is None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details=f"{self.address} does not answer",
            )
        return self.capacity

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        return self._open(Call(self.address, "generate", request.request_id)).chunks()

    def resume(
        self,
        request_id: str,
        from_index: int,
        delivered: Sequence[int] = (),
        request: GenerationRequest | None = None,
    ) -> AsyncIterator[TokenChunk]:
        stream = self._open(Call(self.address, "resume", request_id, from_index, tuple(delivered)))
        if self.persisted is not None and request_id not in self.persisted:
            stream.fail(NothingPersisted(f"worker {self.address}: no record of {request_id}"))
        return stream.chunks()

    async def abort(self, request_id: str) -> bool:
        """Like a worker: the request's open stream ends with a CANCELLED chunk."""
        self.calls.append(Call(self.address, "abort", request_id))
        running = [s for s in self.open_streams() if s.request_id == request_id]
        for stream in running:
            stream.finish(0, FinishReason.CANCELLED)
        return bool(running)

    async def prefetch(self, request_id: str, timeout_seconds: float) -> PrefetchResult:
        """The next scripted answer for ``request_id``; unscripted: 2 blocks staged, none
        new (the handshake's last stage)."""
        self.calls.append(Call(self.address, "prefetch", request_id))
        script = self.prefetch_script.get(request_id)
        answer: PrefetchResult | BaseException = (
            script.pop(0) if script else PrefetchResult(2, 0, 2 << 20, 64, False)
        )
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def drop_prefetch(self, request_id: str) -> int:
        self.calls.append(Call(self.address, "drop_prefetch", request_id))
        return 2

    async def drain(self, grace_seconds: float) -> int:
        self.calls.append(Call(self.address, "drain"))
        return len(self.open_streams())

    def _open(self, call: Call) -> ScriptedStream:
        self.calls.append(call)
        stream = ScriptedStream(self, call)
        self.streams.append(stream)
        self._opened.put_nowait(stream)
        return stream


def refused(detail: str = "no staging room") -> PrefetchRefused:
    return PrefetchRefused(f"RESOURCE_EXHAUSTED: {detail}")


def complete_report(request_id: str, worker_id: str, committed: int) -> FlushReport:
    return FlushReport(request_id, True, committed, 1, True, committed + 4, worker_id)


@dataclass
class FakeDaemon:
    """The context daemon beside a worker. Its Flush answers ``reports(...)`` of the moment
    (the requests the source paused, say), logged in ``calls`` like a worker's."""

    address: str
    reports: Callable[[], Sequence[FlushReport]] = lambda: ()
    calls: list[Call] = field(default_factory=list)
    closed: bool = False
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)
    _events: asyncio.Queue[NoticeEvent] = field(default_factory=asyncio.Queue)

    def notice(self, deadline_unix: float, action: str = "terminate") -> None:
        """A notice on the WatchNotices stream."""
        self._events.put_nowait(NoticeEvent("fake", action, deadline_unix))

    def delivered(self) -> bool:
        """Every notice given so far was taken by the subscriber (and acted on: the
        coordinator handles an event in the same step that takes it)."""
        return self._events.empty()

    async def close(self) -> None:
        self.closed = True

    async def watch(
        self, on_subscribed: Callable[[], None] = lambda: None, orchestrates: bool = False
    ) -> AsyncIterator[NoticeEvent]:
        on_subscribed()
        self.subscribed.set()
        while True:
            yield await self._events.get()

    async def flush(
        self,
        deadline_unix: float,
        timeout_seconds: float,
        peer_targets: Mapping[str, str] | None = None,
    ) -> AsyncIterator[FlushReport]:
        self.calls.append(Call(self.address, "flush"))
        for report in self.reports():
            yield report

    async def settle(self, timeout_seconds: float) -> bool:
        self.calls.append(Call(self.address, "settle"))
        return True
