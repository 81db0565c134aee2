"""AWS EC2 spot interruption notices through IMDSv2.

Every read needs a session token: ``PUT /latest/api/token`` with
``X-aws-ec2-metadata-token-ttl-seconds``, then ``X-aws-ec2-metadata-token`` on each GET.
The token is renewed shortly before its TTL runs out, and at once if IMDS answers 401
(it was restarted, or the clock here disagrees).

``/latest/meta-data/spot/instance-action`` answers 404 until an interruption is scheduled,
then ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-30T12:00:00Z"}`` (two
minutes ahead). ``/latest/meta-data/events/recommendations/rebalance`` answers 404 or
``{"noticeTime": "…Z"}``: a hint without deadline.
"""

from __future__ import annotations

import json
from typing import Any

from context_daemon.constants import (
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
    ) -> None:
        super().__init__(clock, poll_interval_seconds)
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

    def _get_json(self, path: str) -> dict[str, Any] | None:
        """The parsed document at ``path``, or None on 404 (nothing pending)."""
        response = self._authorized_get(path)
        if response.status == 401:  # token revoked or expired early: one fresh token, one retry
            self._token = None
            response = self._authorized_get(path)
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
