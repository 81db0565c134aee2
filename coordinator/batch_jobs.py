"""Batch jobs and their files as the Batch API shows them: OpenAI's `file` and `batch`
objects, made from the fields the store keeps (store/batch_store.py).

    validating ─▶ in_progress ─▶ finalizing ─▶ completed
        │              ├──▶ cancelling ─▶ cancelled      (POST /v1/batches/{id}/cancel)
        └─▶ failed     └──▶ expired                       (past completion_window)

`BatchJobs` is what the HTTP front calls: upload a file (checked line by line at once),
create a job on one (it starts at once, see batch_runner.py), read, list and cancel jobs.
Every object belongs to the tenant of the key that made it; another tenant gets a 404.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from common.errors import InvalidRequest
from coordinator.batch_files import parse_input
from coordinator.constants import (
    BATCH_COMPLETION_WINDOWS,
    BATCH_ENDPOINTS,
    BATCH_LIST_DEFAULT_LIMIT,
    BATCH_LIST_MAX_LIMIT,
    MAX_BATCH_METADATA_PAIRS,
)
from coordinator.errors import UnknownBatchObject
from store import BatchStore
from store.keys import validate_request_id

FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
# Counters of the `spotinfer` extension of a batch object (how its lines went through).
RUN_COUNTERS = (
    "migrated_lines",  # lines moved to another worker on a notice
    "recovered_lines",  # lines resumed from the store after an abrupt loss
    "recomputed_tokens",  # tokens those moves computed again
    "reattached_lines",  # lines a restarted coordinator picked up where they ran
    "restarted_lines",  # lines run again from scratch (their request could not be resumed)
    "refused_writes",  # second writes of a line's result (the store kept the first)
)
_TIMESTAMPS = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class JobStarter(Protocol):
    def launch(self, batch_id: str) -> None: ...

    def cancel(self, batch_id: str) -> None: ...


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def file_object(meta: dict[str, str]) -> dict[str, Any]:
    return {
        "id": meta["id"],
        "object": "file",
        "bytes": int(meta["bytes"]),
        "created_at": int(meta["created_at"]),
        "filename": meta["filename"],
        "purpose": meta["purpose"],
    }


def batch_object(fields: dict[str, str]) -> dict[str, Any]:
    """OpenAI's batch object, with our run counters under `spotinfer`."""
    errors = json.loads(fields["errors"]) if fields.get("errors") else None
    return {
        "id": fields["id"],
        "object": "batch",
        "endpoint": fields["endpoint"],
        "errors": errors,
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"],
        "status": fields["status"],
        "output_file_id": fields.get("output_file_id") or None,
        "error_file_id": fields.get("error_file_id") or None,
        "created_at": int(fields["created_at"]),
        **{name: _int_or_none(fields.get(name)) for name in _TIMESTAMPS},
        "request_counts": {
            "total": int(fields.get("total", "0")),
            "completed": int(fields.get("completed", "0")),
            "failed": int(fields.get("failed", "0")),
        },
        "metadata": json.loads(fields["metadata"]) if fields.get("metadata") else None,
        "spotinfer": {name: int(fields.get(name, "0")) for name in RUN_COUNTERS},
    }


@dataclass(frozen=True)
class NewBatch:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None


def new_batch(body: dict[str, Any]) -> NewBatch:
    """The body of POST /v1/batches, checked; InvalidRequest names what is wrong."""
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise InvalidRequest(f"unknown fields {unknown}")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("input_file_id must be a file id")
    endpoint = body.get("endpoint")
    if endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}")
    window = body.get("completion_window")
    if window not in BATCH_COMPLETION_WINDOWS:
        raise InvalidRequest(
            f"completion_window must be one of {', '.join(BATCH_COMPLETION_WINDOWS)}"
        )
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict)
        and len(metadata) <= MAX_BATCH_METADATA_PAIRS
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise InvalidRequest(f"metadata must map at most {MAX_BATCH_METADATA_PAIRS} strings")
    return NewBatch(file_id, str(endpoint), str(window), metadata)


def _check_id(kind: str, object_id: str) -> None:
    """An id no object can have (a brace, whitespace, too long) is simply not found."""
    try:
        validate_request_id(object_id)
    except ValueError:
        raise UnknownBatchObject(kind, object_id) from None


class BatchJobs:
    """Files and jobs of the Batch API, for the front (store calls run off the loop)."""

    def __init__(
        self,
        store: BatchStore,
        runner: JobStarter,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._runner = runner
        self._clock = clock

    def _now(self) -> int:
        return int(self._clock())

    async def upload(self, tenant: str, filename: str, purpose: str, content: bytes) -> dict:
        if purpose != "batch":
            raise InvalidRequest(f"purpose must be 'batch' here, got {purpose!r}")
        parse_input(content)  # refused now, with the bad lines named
        file_id = f"file-{uuid.uuid4().hex}"
        meta = {
            "id": file_id,
            "tenant": tenant,
            "filename": filename or "input.jsonl",
            "purpose": purpose,
            "bytes": str(len(content)),
            "created_at": str(self._now()),
        }
        await asyncio.to_thread(self._store.put_file, file_id, meta, content)
        return file_object(meta)

    async def file(self, tenant: str, file_id: str) -> dict[str, str]:
        _check_id("file", file_id)
        meta = await asyncio.to_thread(self._store.file_meta, file_id)
        if meta is None or meta.get("tenant") != tenant:
            raise UnknownBatchObject("file", file_id)
        return meta

    async def file_content(self, tenant: str, file_id: str) -> bytes:
        await self.file(tenant, file_id)
        content = await asyncio.to_thread(self._store.file_content, file_id)
        if content is None:
            raise UnknownBatchObject("file", file_id)
        return content

    async def create(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        request = new_batch(body)
        meta = await self.file(tenant, request.input_file_id)
        if meta.get("purpose") != "batch":
            raise InvalidRequest(f"file {request.input_file_id} is not a batch input file")
        lines = parse_input(await self.file_content(tenant, request.input_file_id))
        if lines[0].url != request.endpoint:
            raise InvalidRequest(
                f"the file's requests are for {lines[0].url}, the batch for {request.endpoint}"
            )
        now = self._now()
        batch_id = f"batch_{uuid.uuid4().hex}"
        fields = {
            "id": batch_id,
            "tenant": tenant,
            "endpoint": request.endpoint,
            "input_file_id": request.input_file_id,
            "completion_window": request.completion_window,
            "status": "validating",
            "created_at": str(now),
            "expires_at": str(now + BATCH_COMPLETION_WINDOWS[request.completion_window]),
            "total": str(len(lines)),
            "completed": "0",
            "failed": "0",
            "metadata": json.dumps(request.metadata) if request.metadata is not None else "",
        }
        await asyncio.to_thread(self._store.create_batch, batch_id, fields, now)
        self._runner.launch(batch_id)
        return batch_object(fields)

    async def fields(self, tenant: str, batch_id: str) -> dict[str, str]:
        _check_id("batch", batch_id)
        fields = await asyncio.to_thread(self._store.batch, batch_id)
        if fields is None or fields.get("tenant") != tenant:
            raise UnknownBatchObject("batch", batch_id)
        return fields

    async def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return batch_object(await self.fields(tenant, batch_id))

    async def page(self, tenant: str, after: str, limit: int) -> dict[str, Any]:
        if not 1 <= limit <= BATCH_LIST_MAX_LIMIT:
            raise InvalidRequest(f"limit must be in [1, {BATCH_LIST_MAX_LIMIT}]")
        ids = await asyncio.to_thread(self._store.batch_ids)
        if after:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page: list[dict[str, Any]] = []
        more = False
        for batch_id in ids:
            fields = await asyncio.to_thread(self._store.batch, batch_id)
            if fields is None or fields.get("tenant") != tenant:
                continue
            if len(page) == limit:
                more = True
                break
            page.append(batch_object(fields))
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": more,
        }

    async def unfinished(self) -> list[dict[str, str]]:
        """Every tenant's unfinished jobs (the operator's status)."""
        found = []
        for batch_id in await asyncio.to_thread(self._store.active_batch_ids):
            fields = await asyncio.to_thread(self._store.batch, batch_id)
            if fields is not None:
                found.append(fields)
        return found

    async def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        fields = await self.fields(tenant, batch_id)
        if fields["status"] in FINAL_STATUSES or fields["status"] == "cancelling":
            if fields["status"] != "cancelled" and fields["status"] != "cancelling":
                raise InvalidRequest(f"batch {batch_id} is {fields['status']}; not cancellable")
            return batch_object(fields)
        change = {"status": "cancelling", "cancelling_at": str(self._now())}
        await asyncio.to_thread(self._store.update_batch, batch_id, change)
        self._runner.cancel(batch_id)
        return batch_object({**fields, **change})


DEFAULT_LIST_LIMIT = BATCH_LIST_DEFAULT_LIMIT
