"""The Batch API routes of the HTTP front (OpenAI's shapes; see batch_jobs.py):

    POST /v1/files                      multipart: file (JSONL), purpose=batch
    GET  /v1/files/{file_id}            the file object
    GET  /v1/files/{file_id}/content    its bytes (an input, output or error file)
    POST /v1/batches                    input_file_id, endpoint, completion_window[, metadata]
    GET  /v1/batches                    ?after=ID&limit=N, newest first
    GET  /v1/batches/{batch_id}
    POST /v1/batches/{batch_id}/cancel

Without a store the coordinator cannot keep jobs across its own restart: every route
answers 503 then. Errors come in OpenAI's shape, as on the rest of the front.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from common.errors import InvalidRequest
from coordinator.batch_jobs import DEFAULT_LIST_LIMIT, BatchJobs, file_object
from coordinator.errors import BatchApiUnavailable

Route = Callable[[web.Request], Awaitable[web.StreamResponse]]
Caller = Callable[[web.Request], str]  # the tenant of the request's key


class BatchFront:
    def __init__(
        self,
        jobs: BatchJobs | None,
        tenant_of: Caller,
        answer_error: Callable[[BaseException], web.Response],
    ) -> None:
        self._jobs = jobs
        self._tenant_of = tenant_of
        self._answer_error = answer_error

    def add_routes(self, app: web.Application) -> None:
        router = app.router
        router.add_post("/v1/files", self._guard(self._upload))
        router.add_get("/v1/files/{file_id}", self._guard(self._file))
        router.add_get("/v1/files/{file_id}/content", self._guard(self._file_content))
        router.add_post("/v1/batches", self._guard(self._create))
        router.add_get("/v1/batches", self._guard(self._list))
        router.add_get("/v1/batches/{batch_id}", self._guard(self._get))
        router.add_post("/v1/batches/{batch_id}/cancel", self._guard(self._cancel))

    def _guard(self, route: Callable[[web.Request, BatchJobs, str], Awaitable[Any]]) -> Route:
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                if self._jobs is None:
                    raise BatchApiUnavailable(
                        "the Batch API keeps its jobs in the store: start the coordinator "
                        "with --redis-url"
                    )
                answer = await route(request, self._jobs, self._tenant_of(request))
            except Exception as exc:
                return self._answer_error(exc)
            if isinstance(answer, web.StreamResponse):
                return answer
            return web.json_response(answer)

        return handler

    async def _upload(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        if not request.content_type.startswith("multipart/"):
            raise InvalidRequest("upload the file as multipart/form-data (fields file, purpose)")
        try:
            form = await request.post()
        except (ValueError, HttpProcessingError) as exc:  # a malformed part (its headers)
            raise InvalidRequest(f"the form cannot be read: {exc}") from exc
        upload = form.get("file")
        purpose = form.get("purpose")
        if not isinstance(purpose, str):
            raise InvalidRequest("the form needs a purpose field ('batch')")
        if not isinstance(upload, web.FileField):
            raise InvalidRequest("the form needs a file field holding the JSONL file")
        content = upload.file.read()
        return await jobs.upload(tenant, str(upload.filename or ""), purpose, content)

    async def _file(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        return file_object(await jobs.file(tenant, request.match_info["file_id"]))

    async def _file_content(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        content = await jobs.file_content(tenant, request.match_info["file_id"])
        return web.Response(body=content, content_type="application/jsonl")

    async def _create(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        return await jobs.create(tenant, body)

    async def _list(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        limit_text = request.query.get("limit", str(DEFAULT_LIST_LIMIT))
        try:
            limit = int(limit_text)
        except ValueError:
            raise InvalidRequest(f"limit must be an integer, got {limit_text!r}") from None
        return await jobs.page(tenant, request.query.get("after", ""), limit)

    async def _get(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        return await jobs.get(tenant, request.match_info["batch_id"])

    async def _cancel(self, request: web.Request, jobs: BatchJobs, tenant: str) -> Any:
        return await jobs.cancel(tenant, request.match_info["batch_id"])
