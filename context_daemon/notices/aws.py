"""AWS EC2 spot interruption notices through IMDSv2.

Every read needs a session token: ``PUT /latest/api/token`` with
``X-aws-ec2-metadata-token-ttl-seconds``, then ``X-aws-ec2-metadata-token`` on each GET.
The token is renewed shortly before its TTL runs out, and at once if IMDS answers 401
(it was restarted, or the clock here disagrees).

``/latest/meta-data/spot/instance-action`` answers 404 until an interruption is scheduled,
then ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-30T12:00:00Z"}`` (two
minutes ahead). ``/latest/meta-data/events/recommendations/rebalance`` answers 404 or
``{"noticeTime": "…Z"}``: a hint without deadline.

``/latest/meta-data/autoscaling/target-lifecycle-state`` (404 outside an auto scaling group)
says ``InService`` until the group itself terminates the instance — a scale-in, an instance
refresh, a capacity rebalance — and then ``Terminated``; no spot notice comes then. The
group's lifecycle hook holds the instance in Terminating:Wait for its heartbeat timeout
(``lifecycle_drain_seconds``), so that is the deadline, counted from when the state was
first seen.
"""

from __future__ import annotations

import json
from typing import Any

from context_daemon.constants import (
    AWS_LIFECYCLE_DRAIN_SECONDS,
    AWS_METADATA_BASE_URL,
    AWS_POLL_INTERVAL_SECONDS,
    AWS_TOKEN_REFRESH_MARGIN_SECONDS,
    AWS_TOKEN_TTL_SECONDS,
    HTTP_TIMEOUT_SECONDS,
)
from context_daemon.notices.clock import Clock
from context_daemon.notices.errors import NoticeSourceError
from context_daemon.notices.metadata_http import MetadataHttp, MetadataResponse
from context_daemon.notices.notice import Notice, NoticeAction
from context_daemon.notices.timestamps import parse_iso8601_utc
from context_daemon.notices.watcher import NoticeWatcher

TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
LIFECYCLE_STATE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
TERMINATED_LIFECYCLE_STATE = "Terminated"
LIFECYCLE_EVENT_ID = "autoscaling:target-lifecycle-state:Terminated"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL_SECONDS = 21600

_ACTIONS = {
    "terminate": NoticeAction.TERMINATE,
    "stop": NoticeAction.STOP,
    "hibernate": NoticeAction.STOP,
}


class AwsNoticeWatcher(NoticeWatcher, name="aws"):
    def __init__(
        self,
        base_url: str = AWS_METADATA_BASE_URL,
        clock: Clock | None = None,
        poll_interval_seconds: float = AWS_POLL_INTERVAL_SECONDS,
        token_ttl_seconds: int = AWS_TOKEN_TTL_SECONDS,
        http_timeout_seconds: float = HTTP_TIMEOUT_SECONDS,
        http: MetadataHttp | None = None,
        lifecycle_drain_seconds: float = AWS_LIFECYCLE_DRAIN_SECONDS,
    ) -> None:
        super().__init__(clock, poll_interval_seconds)
        if lifecycle_drain_seconds < 0:
            raise ValueError("lifecycle_drain_seconds must not be negative")
        self._lifecycle_drain_seconds = lifecycle_drain_seconds
        self._terminating_since: float | None = None  # when Terminated was first seen
        if not 1 <= token_ttl_seconds <= MAX_TOKEN_TTL_SECONDS:
            raise ValueError(f"token_ttl_seconds must be in [1, {MAX_TOKEN_TTL_SECONDS}]")
        self._base_url = base_url.rstrip("/")
        self._token_ttl_seconds = token_ttl_seconds
        # Never wait until the last moment; with short TTLs renew at half-life.
        self._refresh_margin_seconds = min(AWS_TOKEN_REFRESH_MARGIN_SECONDS, token_ttl_seconds / 2)
        self._http_timeout_seconds = http_timeout_seconds
        self._http = http or MetadataHttp()
        self._token: str | None = None
        self._token_expires_unix = 0.0

    def poll(self) -> Notice | None:
        received = self.clock.time()
        instance_action = self._get_json(INSTANCE_ACTION_PATH)
        if instance_action is not None:
            action_name = str(instance_action.get("action", "")).lower()
            if "time" not in instance_action:
                raise NoticeSourceError(f"instance-action without time: {instance_action}")
            return Notice(
                source=self.name,
                # An action this code does not know still means the VM is going away.
                action=_ACTIONS.get(action_name, NoticeAction.TERMINATE),
                deadline_unix=parse_iso8601_utc(str(instance_action["time"])),
                received_unix=received,
                raw=instance_action,
            )
        terminating = self._lifecycle_termination(received)
        if terminating is not None:
            return terminating
        rebalance = self._get_json(REBALANCE_PATH)
        if rebalance is not None:
            return Notice(
                source=self.name,
                action=NoticeAction.REBALANCE,
                deadline_unix=None,
                received_unix=received,
                raw=rebalance,
            )
        return None

    def _lifecycle_termination(self, received: float) -> Notice | None:
        """The group terminates this instance (``Terminated``): a notice whose deadline is
        the lifecycle hook's wait from when it was first seen; None otherwise (0 drain
        seconds: the state is not watched)."""
        if not self._lifecycle_drain_seconds:
            return None
        response = self._get(LIFECYCLE_STATE_PATH)
        if response.status == 404:  # not in an auto scaling group
            return None
        if response.status != 200:
            raise NoticeSourceError(f"GET {LIFECYCLE_STATE_PATH}: HTTP {response.status}")
        state = response.text.strip()
        if state != TERMINATED_LIFECYCLE_STATE:
            self._terminating_since = None
            return None
        if self._terminating_since is None:
            self._terminating_since = received
        return Notice(
            source=self.name,
            action=NoticeAction.TERMINATE,
            deadline_unix=self._terminating_since + self._lifecycle_drain_seconds,
            received_unix=received,
            raw={"target-lifecycle-state": state},
            event_id=LIFECYCLE_EVENT_ID,
        )

    def _get(self, path: str) -> MetadataResponse:
        response = self._authorized_get(path)
        if response.status == 401:  # token revoked or expired early: one fresh token, one retry
            self._token = None
            response = self._authorized_get(path)
        return response

    def _get_json(self, path: str) -> dict[str, Any] | None:
        """The parsed document at ``path``, or None on 404 (nothing pending)."""
        response = self._get(path)
        if response.status == 404:
            return None
        if response.status != 200:
            raise NoticeSourceError(f"GET {path}: HTTP {response.status}")
        try:
            document = json.loads(response.body)
        except ValueError as error:
            raise NoticeSourceError(f"GET {path}: not JSON: {response.text[:200]!r}") from error
        if not isinstance(document, dict):
            raise NoticeSourceError(f"GET {path}: expected an object, got {document!r}")
        return document

    def _authorized_get(self, path: str) -> MetadataResponse:
        headers = {TOKEN_HEADER: self._valid_token()}
        return self._http.request("GET", self._base_url + path, headers, self._http_timeout_seconds)

    def _valid_token(self) -> str:
        now = self.clock.time()
        if self._token is None or now >= self._token_expires_unix - self._refresh_margin_seconds:
            response = self._http.request(
                "PUT",
                self._base_url + TOKEN_PATH,
                {TOKEN_TTL_HEADER: str(self._token_ttl_seconds)},
                self._http_timeout_seconds,
                body=b"",
            )
            if response.status != 200 or not response.body:
                raise NoticeSourceError(f"PUT {TOKEN_PATH}: HTTP {response.status}")
            self._token = response.text.strip()
            self._token_expires_unix = now + self._token_ttl_seconds
        return self._token
