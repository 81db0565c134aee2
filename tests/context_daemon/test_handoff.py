"""The daemon's hand-off to a coordinator that migrates the requests itself: it waits for
that coordinator's Flush (up to its share of the time), and flushes on its own otherwise."""

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
    """The worker's side of Preempt, answered here: one complete report, the call recorded."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:1")
        self.preempts: list[float] = []

    async def preempt(self, deadline_unix: float, now_unix: float) -> AsyncIterator[FlushReport]:
        self.preempts.append(time.monotonic())
        yield FlushReport("r1", True, 3, 1, True, 130, "w")


class NoticeSeen(Subscribers):
    """The subscribers, and an event set once the daemon has published a notice."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    def notice(self, notice: Notice) -> None:
        super().notice(notice)
        self.seen.set()


def daemon(
    handoff_seconds: float, orchestrated: bool, subscribers: Subscribers | None = None
) -> tuple[ContextDaemon, RecordingLink]:
    config = DaemonConfig(
        notice_source="file",
        notice_file="/nonexistent/notice",
        worker_address="127.0.0.1:1",
        handoff_seconds=handoff_seconds,
    )
    link = RecordingLink()
    subscribers = subscribers or Subscribers()
    return (
        ContextDaemon(
            config,
            FileNoticeWatcher("/nonexistent/notice"),
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
