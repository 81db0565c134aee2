"""The worker's token commits, written by its daemon: the store calls of the token committer
(worker/token_committer.py) as messages on a hand-off connection of their own.

    worker: committer thread ──CALL {op, args}──▶ daemon: RedisStore.<op>(...) ──▶ Redis
                             ◀─REPLY {value | error}──┘

One call at a time per connection, in order, so a step's commit goes out before the next;
a call that reached the daemon is carried out even if the worker dies the next instant. The
store's errors travel by name and come back as the same exceptions. Only the committer's
calls are served: ping, create_request, update_status, finish_request, commit_step.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from store.errors import (
    CommitConflict,
    ConflictReason,
    InvalidTransition,
    RequestExists,
    RequestNotFound,
    StoreError,
    StoreUnavailable,
)
from store.redis_store import CommitOutcome, TokenCommit
from store.request_record import RequestRecord, RequestStatus

MAX_MESSAGE_BYTES = 1 << 22
CALLS_HELLO = b"\x07calls"  # the first message of a connection for store calls
OPS = ("ping", "create_request", "update_status", "finish_request", "commit_step")


def send_call(sock: socket.socket, op: str, args: Mapping[str, Any]) -> Any:
    """One call, answered: the value, or the store's error raised here."""
    sock.sendall(json.dumps({"op": op, "args": args}).encode())
    data = sock.recv(MAX_MESSAGE_BYTES)
    if not data:
        raise ConnectionResetError("the daemon closed the store connection")
    reply = json.loads(data)
    if "error" in reply:
        raise _error(reply["error"])
    return reply.get("value")


def serve_call(data: bytes, store: Any) -> bytes:
    """Carries out one call on ``store`` (a RedisStore); the reply to send back."""
    try:
        message = json.loads(data)
        op = message["op"]
        if op not in OPS:
            raise ValueError(f"no such store call {op!r}")
        value = _HANDLERS[op](store, message["args"])
        return json.dumps({"value": value}).encode()
    except StoreError as exc:
        return json.dumps({"error": _error_fields(exc)}).encode()
    except (ValueError, KeyError, TypeError) as exc:
        return json.dumps({"error": {"kind": "StoreError", "message": f"bad call: {exc}"}}).encode()


# --- arguments and values ------------------------------------------------------------------


def record_args(record: RequestRecord) -> dict[str, Any]:
    fields = record.to_fields()
    return {
        "fields": {k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()},
        "binary": [k for k, v in fields.items() if isinstance(v, bytes)],
    }


def _record(args: Mapping[str, Any]) -> RequestRecord:
    binary = set(args["binary"])
    fields = {
        k.encode(): bytes.fromhex(v) if k in binary else str(v).encode()
        for k, v in args["fields"].items()
    }
    return RequestRecord.from_fields(fields, {})


def commits_args(commits: Sequence[TokenCommit]) -> dict[str, Any]:
    return {"commits": [[c.request_id, c.start_index, list(c.token_ids)] for c in commits]}


def outcomes_value(value: Sequence[Sequence[Any]]) -> list[CommitOutcome]:
    outcomes = []
    for request_id, length, reason in value:
        conflict = None
        if reason:
            conflict = CommitConflict(request_id, ConflictReason(reason), length)
        outcomes.append(CommitOutcome(request_id, length, conflict))
    return outcomes


def _commit_step(store: Any, args: Mapping[str, Any]) -> list[list[Any]]:
    commits = [TokenCommit(rid, int(start), tuple(ids)) for rid, start, ids in args["commits"]]
    outcomes = store.commit_step(commits)
    return [
        [o.request_id, o.committed_length, o.conflict.reason.value if o.conflict else ""]
        for o in outcomes
    ]


def _update_status(store: Any, args: Mapping[str, Any]) -> str:
    before = store.update_status(
        args["request_id"], RequestStatus(args["status"]), args.get("owner_worker_id")
    )
    return str(before.value)


_HANDLERS: dict[str, Callable[[Any, Mapping[str, Any]], Any]] = {
    "ping": lambda store, args: store.ping(),
    "create_request": lambda store, args: store.create_request(_record(args)),
    "update_status": _update_status,
    "finish_request": lambda store, args: store.finish_request(
        args["request_id"], RequestStatus(args["status"]), args["finish_reason"]
    ),
    "commit_step": _commit_step,
}


# --- errors ---------------------------------------------------------------------------------


def _error_fields(exc: StoreError) -> dict[str, Any]:
    fields: dict[str, Any] = {"kind": type(exc).__name__, "message": str(exc)}
    for name in ("request_id", "current", "wanted"):
        if hasattr(exc, name):
            fields[name] = getattr(exc, name)
    return fields


def _error(fields: Mapping[str, Any]) -> StoreError:
    kind = fields.get("kind")
    if kind == "RequestExists":
        return RequestExists(fields["request_id"])
    if kind == "RequestNotFound":
        return RequestNotFound(fields["request_id"])
    if kind == "InvalidTransition":
        return InvalidTransition(fields["request_id"], fields["current"], fields["wanted"])
    if kind == "StoreUnavailable":
        return StoreUnavailable(fields["message"])
    return StoreError(fields.get("message", "the daemon's store call failed"))
