"""Termination-notice watchers, picked by name: ``aws``, ``gcp``, ``azure``, ``file``.

``create_watcher(name, **options)`` builds one; each module documents its cloud's format.
Importing this package registers all of them.
"""

from context_daemon.notices import aws, azure, file, gcp  # noqa: F401  (registers watchers)
from context_daemon.notices.aws import AwsNoticeWatcher
from context_daemon.notices.azure import AzureNoticeWatcher
from context_daemon.notices.clock import Clock, SystemClock
from context_daemon.notices.errors import NoticeSourceError
from context_daemon.notices.file import FileNoticeWatcher
from context_daemon.notices.gcp import GcpNoticeWatcher
from context_daemon.notices.notice import Notice, NoticeAction
from context_daemon.notices.watcher import (
    NoticeWatcher,
    create_watcher,
    registered_watchers,
    watcher_class,
)

__all__ = [
    "AwsNoticeWatcher",
    "AzureNoticeWatcher",
    "Clock",
    "FileNoticeWatcher",
    "GcpNoticeWatcher",
    "Notice",
    "NoticeAction",
    "NoticeSourceError",
    "NoticeWatcher",
    "SystemClock",
    "create_watcher",
    "registered_watchers",
    "watcher_class",
]
