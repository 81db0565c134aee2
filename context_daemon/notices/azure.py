"""Azure Scheduled Events: spot evictions announced as ``Preempt`` events.

``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` (the service
answers 400 without it) returns ``{"DocumentIncarnation": n, "Events": [...]}``; an empty
list means nothing is pending. A Preempt event names the VMs it affects in ``Resources`` and
the earliest eviction time in ``NotBefore`` (RFC 1123, at least 30 s ahead). Only events
naming this VM count. ``approve`` POSTs ``{"StartRequests": [{"EventId": id}]}`` to the same
URL to let the eviction go ahead early, once the state is saved.
"""

from __future__ import annotations

import json
from typing import Any

from context_daemon.constants import (
    AZURE_API_VERSION,
    AZURE_METADATA_BASE_URL,
    AZURE_POLL_INTERVAL_SECONDS,
    HTTP_TIMEOUT_SECONDS,
)
from context_daemon.notices.clock import Clock
from context_daemon.notices.errors import NoticeSourceError
from context_daemon.notices.metadata_http import MetadataHttp
from context_daemon.notices.notice import Notice, NoticeAction
from context_daemon.notices.timestamps import parse_rfc1123
from context_daemon.notices.watcher import NoticeWatcher

EVENTS_PATH = "/metadata/scheduledevents"
METADATA_HEADERS = {"Metadata": "true"}
PREEMPT_EVENT_TYPE = "Preempt"


class AzureNoticeWatcher(NoticeWatcher, name="azure"):
    def __init__(
        self,
        vm_name: str,
        base_url: str = AZURE_METADATA_BASE_URL,
        clock: Clock | None = None,
        poll_interval_seconds: float = AZURE_POLL_INTERVAL_SECONDS,
        http_timeout_seconds: float = HTTP_TIMEOUT_SECONDS,
        http: MetadataHttp | None = None,
    ) -> None:
        super().__init__(clock, poll_interval_seconds)
        if not vm_name:
            raise ValueError("vm_name must not be empty")
        self._vm_name = vm_name
        self._url = f"{base_url.rstrip('/')}{EVENTS_PATH}?api-version={AZURE_API_VERSION}"
        self._http_timeout_seconds = http_timeout_seconds
        self._http = http or MetadataHttp()
        self._deadlines: dict[str, float] = {}  # the first deadline seen, by event id

    def poll(self) -> Notice | None:
        received = self.clock.time()
        response = self._http.request(
            "GET", self._url, METADATA_HEADERS, self._http_timeout_seconds
        )
        if response.status != 200:
            raise NoticeSourceError(f"GET {EVENTS_PATH}: HTTP {response.status}")
        try:
            document = json.loads(response.body)
            events: list[dict[str, Any]] = list(document.get("Events") or [])
        except (ValueError, AttributeError, TypeError) as error:
            raise NoticeSourceError(f"bad scheduled events: {response.text[:200]!r}") from error
        ours = [event for event in events if self._is_our_preemption(event)]
        if not ours:
            return None
        event = min(ours, key=lambda e: self._deadline(e, received))
        event_id = str(event.get("EventId", "")) or None
        deadline = self._deadline(event, received)
        if event_id is not None:
            # Once approved (or started) the event has no NotBefore: it is the same notice,
            # with the deadline it had, not a new one at every poll.
            known = self._deadlines.get(event_id)
            deadline = min(deadline, known) if known is not None else deadline
            self._deadlines[event_id] = deadline
        return Notice(
            source=self.name,
            action=NoticeAction.PREEMPT,
            deadline_unix=deadline,
            received_unix=received,
            raw=event,
            event_id=event_id,
        )

    def acknowledge(self, notice: Notice) -> None:
        """Approves the notice's event (StartRequests): the eviction may go ahead now."""
        if notice.event_id:
            self.approve(notice.event_id)

    def approve(self, event_id: str) -> None:
        """Tell Azure it may evict now (the state is safe); raises NoticeSourceError on refusal."""
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        headers = {**METADATA_HEADERS, "Content-Type": "application/json"}
        response = self._http.request("POST", self._url, headers, self._http_timeout_seconds, body)
        if response.status != 200:
            raise NoticeSourceError(f"approving {event_id}: HTTP {response.status}")

    def _is_our_preemption(self, event: dict[str, Any]) -> bool:
        if event.get("EventType") != PREEMPT_EVENT_TYPE:
            return False
        # An event that already completed is history, not a pending eviction.
        if event.get("EventStatus") not in ("Scheduled", "Started"):
            return False
        resources = event.get("Resources") or []
        return self._vm_name in resources

    @staticmethod
    def _deadline(event: dict[str, Any], received: float) -> float:
        # A Started event carries an empty NotBefore: the eviction is under way now.
        not_before = str(event.get("NotBefore") or "")
        return parse_rfc1123(not_before) if not_before else received
