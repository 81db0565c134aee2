"""Notices from a file: for drills, tests and platforms without a metadata service.

The notice is pending as soon as the file exists. The file may hold
``{"action": "terminate", "deadline_unix": 1780000000}``; missing fields (or a file that is
empty or not JSON) mean ``terminate`` with the deadline at first sight + ``grace_seconds``.
"""

from __future__ import annotations

import json
from pathlib import Path

from context_daemon.constants import FILE_DEFAULT_GRACE_SECONDS, FILE_POLL_INTERVAL_SECONDS
from context_daemon.notices.clock import Clock
from context_daemon.notices.errors import NoticeSourceError
from context_daemon.notices.notice import Notice, NoticeAction
from context_daemon.notices.watcher import NoticeWatcher


class FileNoticeWatcher(NoticeWatcher, name="file"):
    def __init__(
        self,
        path: str | Path,
        grace_seconds: float = FILE_DEFAULT_GRACE_SECONDS,
        clock: Clock | None = None,
        poll_interval_seconds: float = FILE_POLL_INTERVAL_SECONDS,
    ) -> None:
        super().__init__(clock, poll_interval_seconds)
        if grace_seconds <= 0:
            raise ValueError("grace_seconds must be positive")
        self._path = Path(path)
        self._grace_seconds = grace_seconds
        self._first_seen_unix: float | None = None

    def poll(self) -> Notice | None:
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            self._first_seen_unix = None
            return None
        except OSError as error:
            raise NoticeSourceError(f"reading {self._path}: {error}") from error
        if self._first_seen_unix is None:
            self._first_seen_unix = self.clock.time()
        try:
            document = json.loads(text) if text.strip() else {}
        except ValueError:
            document = {}
        if not isinstance(document, dict):
            document = {}
        try:
            action = NoticeAction(str(document.get("action", NoticeAction.TERMINATE.value)))
        except ValueError:
            action = NoticeAction.TERMINATE
        deadline = document.get("deadline_unix")
        if not isinstance(deadline, (int, float)) or isinstance(deadline, bool):
            deadline = (
                None
                if action is NoticeAction.REBALANCE
                else (self._first_seen_unix + self._grace_seconds)
            )
        return Notice(
            source=self.name,
            action=action,
            deadline_unix=float(deadline) if deadline is not None else None,
            received_unix=self._first_seen_unix,
            raw=document or text,
        )
