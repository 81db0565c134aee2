"""Typed failures of the Redis store; callers branch on these, never on redis-py's errors."""

from __future__ import annotations

import enum

import grpc

from common.errors import ServiceError, UserError


class StoreError(ServiceError):
    """Base of every error the store raises on purpose; a client that sees one (other than
    StoreUnavailable) sees INTERNAL: callers are meant to handle them."""


class StoreUnavailable(StoreError):
    """Redis cannot be reached or did not answer in time; the caller degrades, it does not wait.

    Wraps redis-py's ConnectionError / TimeoutError / cluster-down errors (``__cause__``).
    Maps to UNAVAILABLE (HTTP 503).
    """

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    http_type = "service_unavailable"


class EvictingStore(StoreError, UserError):
    """Redis is set to evict keys under memory pressure: request records, which all carry
    TTLs, could vanish mid-request. A process refuses such a store at start."""


class RequestNotFound(StoreError):
    """No record exists for the request id (never created, deleted, or expired)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"no record for request {request_id!r}")
        self.request_id = request_id


class RecordRejected(RequestNotFound):
    """The stored record's MAC does not verify (planted or altered in Redis, or signed with
    a key no longer in the keyring): it is treated as absent, never resumed from."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.args = (f"record of request {request_id!r} fails its MAC; ignored",)


class RequestExists(StoreError):
    """create_request found a record already stored under the id."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} already exists")
        self.request_id = request_id


class InvalidTransition(StoreError):
    """A status change that the request lifecycle forbids (e.g. out of a terminal state)."""

    def __init__(self, request_id: str, current: str, wanted: str) -> None:
        super().__init__(f"request {request_id!r}: {current} -> {wanted} is not allowed")
        self.request_id = request_id
        self.current = current
        self.wanted = wanted


class ConflictReason(enum.Enum):
    """Why a token commit was refused. Nothing was written in any of these cases."""

    GAP = "gap"  # the commit starts beyond the committed length: tokens in between are missing
    MISMATCH = "mismatch"  # it rewrites an already committed index with a different token
    UNKNOWN_REQUEST = "unknown_request"  # no record (deleted or expired)
    REQUEST_ENDED = "request_ended"  # the request is in a terminal state


class CommitConflict(StoreError):
    """A token commit that cannot be applied without a gap, a duplicate or a reordering."""

    def __init__(self, request_id: str, reason: ConflictReason, committed_length: int) -> None:
        super().__init__(
            f"commit for {request_id!r} refused: {reason.value} "
            f"(committed length {committed_length})"
        )
        self.request_id = request_id
        self.reason = reason
        self.committed_length = committed_length


class RejectReason(enum.Enum):
    """Why a stored KV block must not be used; the caller recomputes its tokens."""

    MISSING = "missing"
    MALFORMED = "malformed"  # wrong magic, truncated, or a header that does not parse
    VERSION = "version"  # written by another block format version
    CHECKSUM = "checksum"  # header or payload bytes changed since they were written
    MAC = "mac"  # not signed by a key of the cluster keyring: planted or altered on purpose
    FINGERPRINT = "fingerprint"  # another model (or model revision) produced it
    DTYPE = "dtype"
    LAYOUT = "layout"
    GEOMETRY = "geometry"  # layer count, block size or filled-token count differ
    PREFIX_HASH = "prefix_hash"  # it holds the KV of other tokens than those asked for


class BlockRejected(StoreError):
    """A KV block failed verification; it is never returned, so no wrong KV is ever used."""

    def __init__(self, block_name: str, reason: RejectReason, detail: str = "") -> None:
        suffix = f": {detail}" if detail else ""
        super().__init__(f"block {block_name} rejected ({reason.value}){suffix}")
        self.block_name = block_name
        self.reason = reason
        self.detail = detail
