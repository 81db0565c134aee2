"""Typed failures of notice watchers."""

from __future__ import annotations


class NoticeSourceError(Exception):
    """The metadata service could not be reached, or answered something it never answers.

    A watch loop logs it and keeps polling: a flaky metadata service must not stop the watch.
    """
