"""GCP preemption notices from the metadata server.

``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` answers the
text ``FALSE``, or ``TRUE`` once the VM is being preempted; the VM then has the notice period
(30 s by default, up to 120 s with ``scheduling.preemptionNoticeDuration``). With
``?wait_for_change=true`` the server holds the request until the value changes (or
``timeout_sec`` passes), so the watch learns of a preemption at once instead of a poll later;
``last_etag`` makes a change between two waits impossible to miss. A genuine metadata
server always sets ``Metadata-Flavor: Google`` on its replies; anything else is not trusted.
"""

from __future__ import annotations

import urllib.parse

from context_daemon.constants import (
    GCP_DEFAULT_NOTICE_SECONDS,
    GCP_MAX_NOTICE_SECONDS,
    GCP_METADATA_BASE_URL,
    GCP_POLL_INTERVAL_SECONDS,
    GCP_WAIT_FOR_CHANGE_TIMEOUT_SECONDS,
    HTTP_TIMEOUT_SECONDS,
)
from context_daemon.notices.clock import Clock
from context_daemon.notices.errors import NoticeSourceError
from context_daemon.notices.metadata_http import MetadataHttp, MetadataResponse
from context_daemon.notices.notice import Notice, NoticeAction
from context_daemon.notices.watcher import NoticeWatcher

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR_VALUE = "Google"


class GcpNoticeWatcher(NoticeWatcher, name="gcp"):
    def __init__(
        self,
        base_url: str = GCP_METADATA_BASE_URL,
        clock: Clock | None = None,
        notice_seconds: float = GCP_DEFAULT_NOTICE_SECONDS,
        wait_for_change: bool = True,
        wait_timeout_seconds: float = GCP_WAIT_FOR_CHANGE_TIMEOUT_SECONDS,
        poll_interval_seconds: float = GCP_POLL_INTERVAL_SECONDS,
        http_timeout_seconds: float = HTTP_TIMEOUT_SECONDS,
        http: MetadataHttp | None = None,
    ) -> None:
        super().__init__(clock, poll_interval_seconds)
        if not 0 < notice_seconds <= GCP_MAX_NOTICE_SECONDS:
            raise ValueError(f"notice_seconds must be in (0, {GCP_MAX_NOTICE_SECONDS}]")
        if wait_timeout_seconds < 1:
            raise ValueError("wait_timeout_seconds must be at least 1")
        self._base_url = base_url.rstrip("/")
        self._notice_seconds = notice_seconds
        self._wait_for_change = wait_for_change
        self._wait_timeout_seconds = int(wait_timeout_seconds)
        self._http_timeout_seconds = http_timeout_seconds
        self._http = http or MetadataHttp()
        self._etag: str | None = None
        # The deadline counts from the first TRUE seen, not from every later poll.
        self._preempted_since_unix: float | None = None

    def poll(self) -> Notice | None:
        """One immediate read of the preempted flag."""
        response = self._http.request(
            "GET",
            self._base_url + PREEMPTED_PATH,
            {FLAVOR_HEADER: FLAVOR_VALUE},
            self._http_timeout_seconds,
        )
        return self._notice_from(response)

    def wait_for_change(self) -> Notice | None:
        """Block until the flag changes (or the wait times out), then read it."""
        query = {"wait_for_change": "true", "timeout_sec": str(self._wait_timeout_seconds)}
        if self._etag:
            query["last_etag"] = self._etag
        url = f"{self._base_url}{PREEMPTED_PATH}?{urllib.parse.urlencode(query)}"
        # The server may hold the reply for the whole wait; allow for it plus a normal timeout.
        timeout = self._wait_timeout_seconds + self._http_timeout_seconds
        response = self._http.request("GET", url, {FLAVOR_HEADER: FLAVOR_VALUE}, timeout)
        return self._notice_from(response)

    def check(self) -> tuple[Notice | None, bool]:
        if self._wait_for_change:
            return self.wait_for_change(), False
        return self.poll(), True

    def _notice_from(self, response: MetadataResponse) -> Notice | None:
        if response.header(FLAVOR_HEADER) != FLAVOR_VALUE:
            raise NoticeSourceError(
                "reply without Metadata-Flavor: Google; not the metadata server"
            )
        if response.status != 200:
            raise NoticeSourceError(f"GET {PREEMPTED_PATH}: HTTP {response.status}")
        self._etag = response.header("ETag") or self._etag
        value = response.text.strip().upper()
        if value == "FALSE":
            self._preempted_since_unix = None
            return None
        if value != "TRUE":
            raise NoticeSourceError(f"preempted is neither TRUE nor FALSE: {response.text[:50]!r}")
        if self._preempted_since_unix is None:
            self._preempted_since_unix = self.clock.time()
        return Notice(
            source=self.name,
            action=NoticeAction.PREEMPT,
            deadline_unix=self._preempted_since_unix + self._notice_seconds,
            received_unix=self._preempted_since_unix,
            raw=response.text.strip(),
        )
