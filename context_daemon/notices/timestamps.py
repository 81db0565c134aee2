"""Parsing the time formats the clouds put in their notices."""

from __future__ import annotations

import datetime
import email.utils

from context_daemon.notices.errors import NoticeSourceError


def parse_iso8601_utc(text: str) -> float:
    """``2026-11-30T12:00:00Z`` (AWS) -> unix seconds."""
    try:
        moment = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as error:
        raise NoticeSourceError(f"bad timestamp {text!r}") from error
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def parse_rfc1123(text: str) -> float:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` (Azure) -> unix seconds."""
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError) as error:
        raise NoticeSourceError(f"bad timestamp {text!r}") from error
