"""The daemon's hand-off to a coordinator that migrates the requests itself: it waits for
that coordinator's Flush (up to its share of the time), and flushes on its own otherwise;
once a flush has saved every request, the cloud is told it may take the VM (Azure)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from common.messages import FlushReport
from context_daemon.config import DaemonConfig
from context_daemon.daemon import ContextDaemon, Subscribers
from context_daemon.notices import Notice, NoticeAction
from context_daemon.notices.file import FileNoticeWatcher
from context_daemon.worker_link import WorkerLink


class RecordingLink(WorkerLink):
    """The worker's side of Preempt, answered here: one report (complete unless told), the
    call recorded."""

    def __init__(self, complete: bool = True) -> None:
        super().__init__("127.0.0.1:1")
        self.preempts: list[float] = []
        self.complete = complete

    async def preempt(self, deadline_unix: float, now_unix: float) -> AsyncIterator[FlushReport]:
        self.preempts.append(time.monotonic())
        yield FlushReport("r1", self.complete, 3, 1, self.complete, 130, "w")


class ApprovalSeen(FileNoticeWatcher):
    """A watcher that records what it was told to acknowledge, and when."""

    def __init__(self) -> None:
        super().__init__("/nonexistent/notice")
        self.acknowledged: list[tuple[Notice, float]] = []

    def acknowledge(self, notice: Notice) -> None:
        self.acknowledged.append((notice, time.monotonic()))


class NoticeSeen(Subscribers):
    """The subscribers, and an event set once the daemon has published a notice."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    def notice(self, notice: Notice) -> None:
        super().notice(notice)
        self.seen.set()


def daemon(
    handoff_seconds: float,
    orchestrated: bool,
    subscribers: Subscribers | None = None,
    link: RecordingLink | None = None,
    watcher: FileNoticeWatcher | None = None,
) -> tuple[ContextDaemon, RecordingLink]:
    config = DaemonConfig(
        notice_source="file",
        notice_file="/nonexistent/notice",
        worker_address="127.0.0.1:1",
        handoff_seconds=handoff_seconds,
    )
    link = link or RecordingLink()
    subscribers = subscribers or Subscribers()
    return (
        ContextDaemon(
            config,
            watcher or FileNoticeWatcher("/nonexistent/notice"),
            link,
            subscribers,
            orchestrated=lambda: orchestrated,
        ),
        link,
    )


def notice(grace: float) -> Notice:
    now = time.time()
    return Notice("file", NoticeAction.TERMINATE, now + grace, now)


async def test_without_an_orchestrating_subscriber_the_flush_is_immediate() -> None:
    subject, link = daemon(handoff_seconds=5.0, orchestrated=False)
    started = time.monotonic()
    await subject.handle_notice(notice(30))
    assert len(link.preempts) == 1 and link.preempts[0] - started < 1.0


async def test_the_coordinators_flush_within_the_handoff_is_the_only_one() -> None:
    subscribers = NoticeSeen()
    subject, link = daemon(handoff_seconds=5.0, orchestrated=True, subscribers=subscribers)
    handling = asyncio.ensure_future(subject.handle_notice(notice(30)))
    await asyncio.wait_for(subscribers.seen.wait(), 2.0)
    # From publishing the notice to waiting for the coordinator's Flush the daemon does not
    # yield: it waits now, or it has already flushed on its own.
    assert not link.preempts, "the daemon waits for the coordinator"
    reports = [r async for r in subject.flush(time.time() + 29)]  # the coordinator's Flush
    await asyncio.wait_for(handling, 2.0)
    assert [r.request_id for r in reports] == ["r1"] and len(link.preempts) == 1


@pytest.mark.parametrize(("grace", "handoff"), [(30.0, 0.3), (0.6, 10.0)])
async def test_without_the_coordinators_flush_the_daemon_flushes_after_its_share(
    grace: float, handoff: float
) -> None:
    subject, link = daemon(handoff_seconds=handoff, orchestrated=True)
    started = time.monotonic()
    await subject.handle_notice(notice(grace))
    waited = link.preempts[0] - started
    # The hand-off time, or half of what was left when that is shorter.
    assert len(link.preempts) == 1
    assert min(handoff, grace / 2) - 0.05 <= waited < min(handoff, grace / 2) + 2.0


async def test_the_notice_is_acknowledged_after_a_complete_flush_only() -> None:
    watcher = ApprovalSeen()
    subject, link = daemon(handoff_seconds=0.0, orchestrated=False, watcher=watcher)
    noticed = notice(30)
    await subject.handle_notice(noticed)
    assert [n for n, _ in watcher.acknowledged] == [noticed]
    assert watcher.acknowledged[0][1] >= link.preempts[0], "after the flush, never before"
    async for _ in subject.flush(time.time() + 20):  # a second flush: told once only
        pass
    assert len(watcher.acknowledged) == 1

    watcher = ApprovalSeen()
    subject, _ = daemon(0.0, False, link=RecordingLink(complete=False), watcher=watcher)
    await subject.handle_notice(notice(30))
    assert watcher.acknowledged == [], "an incomplete flush keeps the VM its time"


async def test_the_coordinators_flush_acknowledges_the_notice_it_answers() -> None:
    watcher = ApprovalSeen()
    subscribers = NoticeSeen()
    subject, link = daemon(5.0, True, subscribers=subscribers, watcher=watcher)
    noticed = notice(30)
    handling = asyncio.ensure_future(subject.handle_notice(noticed))
    await asyncio.wait_for(subscribers.seen.wait(), 2.0)
    assert watcher.acknowledged == []
    async for _ in subject.flush(time.time() + 29):  # the coordinator's Flush
        pass
    await asyncio.wait_for(handling, 2.0)
    assert [n for n, _ in watcher.acknowledged] == [noticed]
