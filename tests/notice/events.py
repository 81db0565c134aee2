"""Helpers of the notice tests: a WatchNotices subscriber on a thread, and notice timestamps."""

from __future__ import annotations

import datetime
import threading

import grpc

from protos.spotinfer.v1 import daemon_pb2
from spotinfer.local.daemon_process import DaemonProcess
from tests.support.wait import wait_until


def iso_utc(unix_seconds: float) -> str:
    """AWS's instance-action time format, e.g. 2026-11-30T12:00:00Z."""
    moment = datetime.datetime.fromtimestamp(unix_seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class NoticeSubscriber:
    """What a coordinator does: subscribe to a daemon's WatchNotices and keep every event."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self._call = daemon.stub.WatchNotices(daemon_pb2.WatchNoticesRequest(), timeout=600)
        self._lock = threading.Lock()
        self._events: list[daemon_pb2.NoticeEvent] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        # The daemon sends headers once the subscription is registered.
        wait_until(lambda: self._call.initial_metadata() is not None, "the subscription")

    def _read(self) -> None:
        try:
            for event in self._call:
                with self._lock:
                    self._events.append(event)
        except grpc.RpcError:
            pass

    @property
    def events(self) -> list[daemon_pb2.NoticeEvent]:
        with self._lock:
            return list(self._events)

    def flush_report(self, request_id: str) -> daemon_pb2.FlushProgress | None:
        for event in self.events:
            if event.HasField("flush") and event.flush.request_id == request_id:
                return event.flush
        return None

    def close(self) -> None:
        self._call.cancel()
