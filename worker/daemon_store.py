"""The token committer's store when the node's daemon writes for the worker (store/handoff_calls.py).

Its writes (create, status, commit, finish) go to the daemon over the hand-off socket, one
call at a time, and the daemon carries them out on its own connection to Redis: a call that
reached it is written even if this process dies the next instant. Reads go to the store
directly. While the daemon does not answer (not started yet, restarting), every call goes to
the store directly, and the daemon is tried again every RECONNECT_SECONDS.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from store import RequestRecord, RequestStatus, RequestStore, TokenCommit, handoff
from store.handoff_calls import CALLS_HELLO, commits_args, outcomes_value, record_args, send_call
from store.redis_store import CommitOutcome

log = logging.getLogger(__name__)

RECONNECT_SECONDS = 1.0
CONNECT_TIMEOUT_SECONDS = 0.5
CALL_TIMEOUT_SECONDS = 30.0  # the daemon's own Redis timeouts answer well before this


class DaemonCommitStore(RequestStore):
    def __init__(self, socket_path: str, direct: RequestStore) -> None:
        self._path = socket_path
        self._direct = direct
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_try = 0.0

    @property
    def through_daemon(self) -> bool:
        with self._lock:
            return self._connected() is not None

    # --- writes: through the daemon --------------------------------------------------------

    def ping(self) -> None:
        if self._call("ping", {}) is _DIRECT:
            self._direct.ping()

    def create_request(self, record: RequestRecord) -> None:
        if self._call("create_request", record_args(record)) is _DIRECT:
            self._direct.create_request(record)

    def update_status(
        self, request_id: str, status: RequestStatus, owner_worker_id: str | None = None
    ) -> RequestStatus:
        args = {
            "request_id": request_id,
            "status": status.value,
            "owner_worker_id": owner_worker_id,
        }
        value = self._call("update_status", args)
        if value is _DIRECT:
            return self._direct.update_status(request_id, status, owner_worker_id)
        return RequestStatus(value)

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED,
        finish_reason: str = "",
    ) -> bool:
        args = {"request_id": request_id, "status": status.value, "finish_reason": finish_reason}
        value = self._call("finish_request", args)
        if value is _DIRECT:
            return self._direct.finish_request(request_id, status, finish_reason)
        return bool(value)

    def commit_step(self, commits: Sequence[TokenCommit]) -> list[CommitOutcome]:
        value = self._call("commit_step", commits_args(commits))
        if value is _DIRECT:
            return self._direct.commit_step(commits)
        return outcomes_value(value)

    # --- reads and the rest: the store itself ------------------------------------------------

    def get_request(self, request_id: str) -> RequestRecord:
        return self._direct.get_request(request_id)

    def release_request(self, request_id: str) -> bool:
        return self._direct.release_request(request_id)

    def delete_request(self, request_id: str) -> int:
        return self._direct.delete_request(request_id)

    def committed_tokens(self, request_id: str, start_index: int = 0) -> list[int]:
        return self._direct.committed_tokens(request_id, start_index)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # --- the connection ------------------------------------------------------------------

    def _call(self, op: str, args: Mapping[str, Any]) -> Any:
        """The daemon's answer (its store errors raised here), or _DIRECT: do it yourself."""
        with self._lock:
            sock = self._connected()
            if sock is None:
                return _DIRECT
            try:
                return send_call(sock, op, args)
            except (OSError, ValueError) as exc:
                # Sent or not, the call is not known to be done: the direct store does it
                # (every call of the committer is idempotent or refused when repeated).
                log.warning("the daemon's store calls broke (%s); writing Redis directly", exc)
                sock.close()
                self._sock = None
                return _DIRECT

    def _connected(self) -> socket.socket | None:
        if self._sock is not None or time.monotonic() < self._next_try:
            return self._sock
        self._next_try = time.monotonic() + RECONNECT_SECONDS
        try:
            sock = handoff.connect(self._path, CONNECT_TIMEOUT_SECONDS)
            sock.sendall(CALLS_HELLO)
            sock.settimeout(CALL_TIMEOUT_SECONDS)
        except OSError:
            return None
        log.info("token commits go through the context daemon (%s)", self._path)
        self._sock = sock
        return sock


_DIRECT = object()
