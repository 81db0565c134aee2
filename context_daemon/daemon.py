"""The context daemon's loop: a notice watcher, the flush it triggers, and who is told.

::

    watcher thread ──notice──▶ loop: record it ──▶ hook.notice (WatchNotices subscribers)
                                     │ ends the VM?
                                     ▼
                               a subscriber moves the requests itself (a coordinator's
                               staged migration)? wait for its Flush, up to the hand-off time
                                     │ no, or it did not come
                                     ▼
                               worker.Preempt(deadline) ──FlushReport per request──▶
                                                          hook.progress, Flush callers

The hand-off keeps the daemon the one that guarantees the flush: the coordinator may use the
first part of the grace period to stage each request on its target while the source still
decodes, then calls Flush; if it is slow or gone, the daemon flushes anyway with at least
half of the time that was left.

The watcher runs on its own thread (its polls block); everything else runs on the event loop
that also serves the daemon's gRPC service. The outermost loop logs any error and goes on:
a daemon that dies misses the notice, which costs every request on the VM.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from common.messages import FlushReport
from context_daemon.config import DaemonConfig
from context_daemon.constants import (
    DAEMON_RETRY_SECONDS,
    HANDOFF_MAX_SHARE,
    SUBSCRIBER_QUEUE_EVENTS,
)
from context_daemon.notices import (
    Notice,
    NoticeAction,
    NoticeSourceError,
    NoticeWatcher,
    create_watcher,
)
from context_daemon.worker_link import WorkerLink

log = logging.getLogger(__name__)

MANUAL_SOURCE = "manual"


@dataclass(frozen=True)
class DaemonEvent:
    """What subscribers receive: a notice, or one request's flush report under that notice."""

    notice: Notice
    flush: FlushReport | None = None


class NotificationHook(abc.ABC):
    """Who learns of notices and flush progress (the coordinator, through WatchNotices).

    Called on the daemon's event loop; must not block. An exception is logged and ignored.
    """

    @abc.abstractmethod
    def notice(self, notice: Notice) -> None:
        """A notice arrived (before the flush starts)."""

    @abc.abstractmethod
    def progress(self, notice: Notice, report: FlushReport) -> None:
        """One request's flush is complete, or the deadline passed without it."""


class Subscribers(NotificationHook):
    """The default hook: fans every event out to the WatchNotices streams."""

    def __init__(self, queue_events: int = SUBSCRIBER_QUEUE_EVENTS) -> None:
        self._queues: list[asyncio.Queue[DaemonEvent]] = []
        self._queue_events = queue_events
        self._orchestrators = 0

    def notice(self, notice: Notice) -> None:
        self._publish(DaemonEvent(notice))

    def progress(self, notice: Notice, report: FlushReport) -> None:
        self._publish(DaemonEvent(notice, report))

    def _publish(self, event: DaemonEvent) -> None:
        for queue in self._queues:
            if queue.full():  # a stalled subscriber loses its oldest event, not the newest
                queue.get_nowait()
            queue.put_nowait(event)

    async def stream(
        self, ready: Callable[[], None] | None = None, orchestrates: bool = False
    ) -> AsyncIterator[DaemonEvent]:
        """Events from now on, until the caller stops iterating. ``orchestrates``: the caller
        migrates the requests itself and will call Flush (see `orchestrated`)."""
        queue: asyncio.Queue[DaemonEvent] = asyncio.Queue(self._queue_events)
        self._queues.append(queue)
        self._orchestrators += orchestrates
        try:
            if ready is not None:
                ready()
            while True:
                yield await queue.get()
        finally:
            self._queues.remove(queue)
            self._orchestrators -= orchestrates

    def orchestrated(self) -> bool:
        """Whether a subscriber moves the requests itself (the daemon then waits for it)."""
        return self._orchestrators > 0

    @property
    def count(self) -> int:
        return len(self._queues)


class Hooks(NotificationHook):
    """Several hooks as one, called in order (the subscribers, the metrics)."""

    def __init__(self, *hooks: NotificationHook) -> None:
        self._hooks = hooks

    def notice(self, notice: Notice) -> None:
        for hook in self._hooks:
            hook.notice(notice)

    def progress(self, notice: Notice, report: FlushReport) -> None:
        for hook in self._hooks:
            hook.progress(notice, report)


@dataclass
class DaemonState:
    """What Status reports (owned by the event loop)."""

    last_notice: Notice | None = None
    flushes: int = 0
    last_flush: dict[str, FlushReport] = field(default_factory=dict)
    acknowledged: list[Notice] = field(default_factory=list)
    """Notices the cloud was told it may act on now (Azure: the event approved)."""


class ContextDaemon:
    """One daemon beside one worker. ``watcher``, ``worker`` and ``hook`` come in through the
    constructor; ``clock`` returns unix seconds; ``orchestrated`` says whether a subscriber
    migrates the requests itself (then a notice waits for its Flush, see the module doc)."""

    def __init__(
        self,
        config: DaemonConfig,
        watcher: NoticeWatcher,
        worker: WorkerLink,
        hook: NotificationHook,
        clock: Callable[[], float] = time.time,
        orchestrated: Callable[[], bool] = lambda: False,
    ) -> None:
        self.config = config
        self.state = DaemonState()
        self._watcher = watcher
        self._worker = worker
        self._hook = hook
        self._clock = clock
        self._orchestrated = orchestrated
        self._notices: asyncio.Queue[Notice] = asyncio.Queue()
        self._flush_lock = asyncio.Lock()
        self._flush_called = asyncio.Event()

    @classmethod
    def from_config(
        cls,
        config: DaemonConfig,
        hook: NotificationHook,
        orchestrated: Callable[[], bool] = lambda: False,
    ) -> ContextDaemon:
        watcher = create_watcher(config.notice_source, **config.watcher_options())
        return cls(
            config,
            watcher,
            WorkerLink(config.worker_address, config.transport),
            hook,
            orchestrated=orchestrated,
        )

    @property
    def worker(self) -> WorkerLink:
        return self._worker

    async def run(self, stop: asyncio.Event) -> None:
        """Watch and act until ``stop``; survives any error but cancellation."""
        loop = asyncio.get_running_loop()
        stop_watch = threading.Event()
        thread = threading.Thread(
            target=self._watch, args=(loop, stop_watch), name="notice-watcher", daemon=True
        )
        thread.start()
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                next_notice = asyncio.ensure_future(self._notices.get())
                await asyncio.wait({next_notice, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not next_notice.done():
                    next_notice.cancel()
                    break
                try:
                    await self.handle_notice(next_notice.result())
                except Exception:
                    log.exception("handling a notice failed; the daemon goes on")
                    await asyncio.sleep(DAEMON_RETRY_SECONDS)
        finally:
            stopped.cancel()
            stop_watch.set()

    def _watch(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        def on_notice(notice: Notice) -> None:
            loop.call_soon_threadsafe(self._notices.put_nowait, notice)

        while not stop.is_set():
            try:
                self._watcher.watch(on_notice, stop)
            except Exception:
                log.exception("the notice watcher failed; watching again")
                stop.wait(DAEMON_RETRY_SECONDS)

    async def handle_notice(self, notice: Notice) -> None:
        """Record and publish the notice; if it ends the VM, flush the worker before it."""
        log.warning(
            "notice from %s: %s, deadline %s",
            notice.source,
            notice.action.value,
            notice.deadline_unix,
        )
        self.state.last_notice = notice
        self._flush_called.clear()
        self._call_hook(self._hook.notice, notice)
        if not notice.action.ends_vm:
            return  # a hint: nothing to do until a real notice
        deadline = (
            notice.deadline_unix or notice.received_unix + self.config.effective_grace_seconds
        )
        if await self._handed_off(deadline):
            return
        async for _ in self.flush(deadline, notice):
            pass

    async def _handed_off(self, deadline_unix: float) -> bool:
        """True when a migrating subscriber called Flush within its share of the time."""
        if not self._orchestrated() or not self.config.handoff_seconds:
            return False
        left = deadline_unix - self._clock()
        wait = min(self.config.handoff_seconds, HANDOFF_MAX_SHARE * left)
        if wait <= 0:
            return False
        log.info("a coordinator migrates the requests; its Flush is awaited for %.1f s", wait)
        try:
            await asyncio.wait_for(self._flush_called.wait(), wait)
        except TimeoutError:
            log.warning("no Flush from the coordinator in %.1f s: flushing the worker now", wait)
            return False
        return True

    async def flush(
        self, deadline_unix: float, notice: Notice | None = None
    ) -> AsyncIterator[FlushReport]:
        """Have the worker pause and persist everything before ``deadline_unix`` (0: grace
        from now); yield each request's report as the worker gives it. Retries a worker that
        does not answer until the deadline. One flush at a time."""
        self._flush_called.set()
        now = self._clock()
        deadline_unix = deadline_unix or now + self.config.effective_grace_seconds
        if notice is None:
            notice = Notice(MANUAL_SOURCE, NoticeAction.TERMINATE, deadline_unix, now)
        async with self._flush_lock:
            self.state.flushes += 1
            self.state.last_flush = {}
            while True:
                try:
                    async for report in self._worker.preempt(deadline_unix, self._clock()):
                        self.state.last_flush[report.request_id] = report
                        self._call_hook(self._hook.progress, notice, report)
                        yield report
                    await self._acknowledge()
                    return
                except grpc.aio.AioRpcError as error:
                    if self._clock() >= deadline_unix or not _retryable(error):
                        log.error("flush on %s failed: %s", self._worker.address, error)
                        return
                    log.warning(
                        "worker %s did not answer Preempt (%s); again",
                        self._worker.address,
                        error.code(),
                    )
                    await asyncio.sleep(DAEMON_RETRY_SECONDS)

    async def _acknowledge(self) -> None:
        """After a flush in which every request's state reached the store: the cloud may take
        the VM now (Azure approves the Preempt event). A flush with an incomplete request
        approves nothing: the VM keeps its time to the deadline."""
        notice = self.state.last_notice
        if notice is None or not notice.action.ends_vm or self._acknowledged(notice):
            return
        incomplete = [r.request_id for r in self.state.last_flush.values() if not r.complete]
        if incomplete:
            log.warning("not acknowledging the notice: %d request(s) incomplete", len(incomplete))
            return
        try:
            await asyncio.to_thread(self._watcher.acknowledge, notice)
        except NoticeSourceError as error:
            log.error("acknowledging the notice failed: %s", error)
            return
        self.state.acknowledged.append(notice)
        log.info("notice from %s acknowledged: the state is safe", notice.source)

    def _acknowledged(self, notice: Notice) -> bool:
        """Told already: the same notice, or the same cloud event seen again."""
        return any(
            seen == notice or (notice.event_id is not None and seen.event_id == notice.event_id)
            for seen in self.state.acknowledged
        )

    def _call_hook(self, method: Callable[..., None], *args: object) -> None:
        try:
            method(*args)
        except Exception:
            log.exception("notification hook failed")


def _retryable(error: grpc.aio.AioRpcError) -> bool:
    return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
