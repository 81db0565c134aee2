"""The notice watcher interface, its registry, and the watch loop all watchers share.

A watcher answers one question, ``poll()``: is a termination (or a hint of one) pending right
now? ``watch()`` repeats that until stopped and reports each distinct notice once. Watchers
are picked by name (``create_watcher("aws", ...)``); a class joins the registry by naming
itself: ``class AwsNoticeWatcher(NoticeWatcher, name="aws")``.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from context_daemon.notices.clock import Clock, SystemClock
from context_daemon.notices.errors import NoticeSourceError
from context_daemon.notices.notice import Notice

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type[NoticeWatcher]] = {}


class NoticeWatcher(abc.ABC):
    """One source of termination notices.

    Side effects: ``poll`` performs network or file reads only; ``acknowledge`` is the one
    call that changes anything outside (Azure approves its event). Invariant: ``poll`` never raises anything but
    NoticeSourceError, and returns None when nothing is pending.
    """

    name: ClassVar[str]
    poll_interval_seconds: float

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in _REGISTRY:
                raise ValueError(f"notice watcher {name!r} registered twice")
            cls.name = name
            _REGISTRY[name] = cls

    def __init__(self, clock: Clock | None, poll_interval_seconds: float) -> None:
        if poll_interval_seconds <= 0:
            raise ValueError("poll_interval_seconds must be positive")
        self.clock: Clock = clock or SystemClock()
        self.poll_interval_seconds = poll_interval_seconds

    @abc.abstractmethod
    def poll(self) -> Notice | None:
        """One check: the pending notice, or None when there is none."""

    def acknowledge(self, notice: Notice) -> None:
        """The state is safe: tell the cloud it may take the VM now, where it has a way to be
        told (raises NoticeSourceError on refusal). Most clouds do not: a no-op."""
        return None

    def check(self) -> tuple[Notice | None, bool]:
        """What the watch loop calls: (notice, whether to wait a poll interval before the next).

        Sources with a blocking long poll override it and ask for no extra wait.
        """
        return self.poll(), True

    def watch(self, on_notice: Callable[[Notice], None], stop: threading.Event) -> None:
        """Check until ``stop`` is set; call ``on_notice`` once per distinct notice.

        Runs in the caller's thread. A failing metadata service is logged and polled again:
        the watch must outlive any hiccup, since missing the notice costs the whole grace time.
        """
        last_reported: Notice | None = None
        while not stop.is_set():
            wait = True
            try:
                notice, wait = self.check()
            except NoticeSourceError as error:
                logger.warning("notice source %s: %s", self.name, error)
                notice, wait = None, True
            if notice is not None and notice != last_reported:
                last_reported = notice
                on_notice(notice)
            if wait:
                stop.wait(self.poll_interval_seconds)


def registered_watchers() -> list[str]:
    return sorted(_REGISTRY)


def watcher_class(name: str) -> type[NoticeWatcher]:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(registered_watchers())
        raise ValueError(f"unknown notice watcher {name!r}; known: {known}") from None


def create_watcher(name: str, **options: Any) -> NoticeWatcher:
    """Build the watcher registered as ``name`` with its constructor ``options``."""
    return watcher_class(name)(**options)
