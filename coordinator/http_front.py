"""The OpenAI-compatible HTTP front, on the same event loop and the same `Dispatcher` as gRPC.

    POST /v1/completions        prompt: text, token ids, or a list of either (choice i
                                answers prompt i, each its own request)
    POST /v1/chat/completions   messages, through the model's chat template
    GET  /v1/models
    GET  /metrics               Prometheus text format
    GET  /openapi.json          this front's OpenAPI document (coordinator/openapi.json)
    /v1/files, /v1/batches      the Batch API (batch_front.py)

Both POST routes stream as server-sent events (`"stream": true`, ending `data: [DONE]`) or
answer with one JSON object. Errors come back in OpenAI's shape, `{"error": {...}}`, with the
HTTP status our typed errors map to; a full queue is 429 with `Retry-After`.
Extensions: `sla_class` ("interactive" | "batch") and `request_id` in the body, `top_k`,
`ignore_eos`, `seed`. Logprobs: a completion's `logprobs: k`, a chat's `logprobs: true` with
`top_logprobs: k` (k up to 20; openai_logprobs.py). A field it cannot honour (penalties,
`logit_bias`, tools, `echo`, a typo) is a 400 that names it (coordinator/openai_params.py),
never ignored.

Access: with a keys file every /v1 route needs ``Authorization: Bearer <key>`` (401 with
code ``invalid_api_key`` otherwise) and a key's rate and concurrency limits answer 429 with
``Retry-After`` (common.authz). /metrics stays open for the scraper. With TLS configured the
front serves HTTPS only, rereading renewed certificate files every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from common.api_keys import TENANT_ROLE
from common.authz import Gatekeeper, roles
from common.channels import PLAINTEXT, CertificateFiles, TransportConfig, http_ssl_context
from common.errors import InvalidRequest, ServiceError, is_unexpected
from common.requests import TokenChunk
from coordinator.batch_front import BatchFront
from coordinator.batch_jobs import BatchJobs
from coordinator.constants import MAX_UPLOAD_BYTES, MODEL_OWNER
from coordinator.dispatcher import Dispatcher
from coordinator.metrics import CoordinatorMetrics
from coordinator.openai_requests import ModelNotServed, ParsedBody, parse_body
from coordinator.openai_shapes import ChatShape, CompletionShape, Shape, combined, summed_usage

log = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENAPI_DOCUMENT = "openapi.json"  # beside this module; tests check it against the routes


def openapi_document() -> bytes:
    """The OpenAPI 3 document of this front, as shipped in the package."""
    return (resources.files("coordinator") / OPENAPI_DOCUMENT).read_bytes()


CERTIFICATE_CHECK_SECONDS = 5.0
_OPEN_PATHS = ("/metrics",)
_API_ROLES = roles(TENANT_ROLE)  # an admin key holds the tenant role too
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}
        self.code = code


def http_error_for(exc: BaseException) -> HttpError:
    """The HTTP side of the error model (`common.errors`): each typed error's HTTP status,
    error type and headers; anything unexpected is logged and answered 500."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, ServiceError) and not is_unexpected(exc):
        return HttpError(
            exc.http_status, exc.http_type, str(exc), exc.http_headers(), exc.http_code
        )
    log.exception("unexpected error on the HTTP front", exc_info=exc)
    return HttpError(500, "internal_error", f"{type(exc).__name__}: {exc}")


def _error_response(error: HttpError) -> web.Response:
    code = error.code if error.code is not None else error.status
    body = {"error": {"message": str(error), "type": error.kind, "code": code}}
    return web.json_response(body, status=error.status, headers=error.headers)


_CALLER_KEY = "spotinfer.caller"  # the request's Caller, set by the access middleware


class HttpFront:
    def __init__(
        self,
        dispatcher: Dispatcher,
        metrics: CoordinatorMetrics,
        model_name: str,
        gatekeeper: Gatekeeper | None = None,
        transport: TransportConfig = PLAINTEXT,
        batch_jobs: BatchJobs | None = None,
    ):
        self._dispatcher = dispatcher
        self._batches = BatchFront(
            batch_jobs,
            lambda request: request[_CALLER_KEY].tenant,
            lambda exc: _error_response(http_error_for(exc)),
        )
        self._metrics = metrics
        self._model_name = model_name
        self._gatekeeper = gatekeeper or Gatekeeper()
        self._ssl = http_ssl_context(transport)
        self._certificates = CertificateFiles(transport) if self._ssl is not None else None
        self._reloader: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())
        self._openapi_bytes = openapi_document()

    @web.middleware
    async def _access(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The API key and its limits around every route but the open ones."""
        if request.path in _OPEN_PATHS:
            return await handler(request)
        try:
            caller = self._gatekeeper.caller(roles(), request.headers.get("Authorization", ""))
            self._gatekeeper.check(caller, _API_ROLES, request.path)
            with self._gatekeeper.admitted(caller):
                request[_CALLER_KEY] = caller
                return await handler(request)
        except ServiceError as exc:
            return _error_response(http_error_for(exc))

    async def _reload_certificates(self) -> None:
        assert self._ssl is not None and self._certificates is not None
        while True:
            await asyncio.sleep(CERTIFICATE_CHECK_SECONDS)
            if self._certificates.reload_into(self._ssl):
                log.info("the HTTP front serves the renewed certificate")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._access], client_max_size=MAX_UPLOAD_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._prometheus)
        app.router.add_get("/openapi.json", self._openapi)
        self._batches.add_routes(app)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: a free port); returns the port."""
        # A client that hangs up cancels its handler: a request it left in the queue then
        # leaves the queue too (see Relay.follow).
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self._ssl)
        await site.start()
        if self._ssl is not None:
            self._reloader = asyncio.get_running_loop().create_task(self._reload_certificates())
        server = site._server  # aiohttp exposes the bound socket only here
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
        if self._reloader is not None:
            self._reloader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reloader
        if self._runner is not None:
            await self._runner.cleanup()

    # -- routes --------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self._model_name,
            "object": "model",
            "created": self._created,
            "owned_by": MODEL_OWNER,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._metrics.exposition(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE}
        )

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi_bytes, content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            await self._dispatcher.tokenizer.ready()
            try:
                parsed = parse_body(self._dispatcher, self._model_name, body, chat)
            except ModelNotServed as exc:
                raise HttpError(404, "not_found_error", str(exc)) from exc
            relays = await self._start_all(parsed, request[_CALLER_KEY].tenant)
        except Exception as exc:
            return _error_response(http_error_for(exc))
        completion_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape: type[Shape] = ChatShape if chat else CompletionShape
        created = int(time.time())
        shapes: list[Shape] = [
            shape(completion_id, self._model_name, len(r.request.prompt_token_ids), i, created)
            for i, r in enumerate(relays)
        ]
        for one, prompt_ids in zip(shapes, parsed.prompts, strict=True):
            one.decode = self._dispatcher.tokenizer.whole_decoder(prompt_ids)
            if parsed.sampling.logprobs is not None:
                one.with_logprobs(self._dispatcher.tokenizer.candidate_texts(prompt_ids))
        if parsed.stream:
            return await self._stream(request, relays, shapes, parsed.include_usage)
        try:
            await asyncio.gather(*(_collect(r, s) for r, s in zip(relays, shapes, strict=True)))
        except Exception as exc:
            return _error_response(http_error_for(exc))
        return web.json_response(combined(shapes))

    async def _start_all(self, parsed: ParsedBody, tenant: str) -> list[Any]:
        """One request per prompt, all or none: a refusal (a full queue) cancels the ones
        already started, and the client gets that refusal."""
        relays: list[Any] = []
        try:
            for prompt_ids, request_id in zip(parsed.prompts, parsed.request_ids(), strict=True):
                relays.append(
                    self._dispatcher.submit(
                        request_id, prompt_ids, parsed.sampling, parsed.sla_class, tenant
                    )
                )
        except BaseException:
            await asyncio.gather(*(r.cancel() for r in relays), return_exceptions=True)
            raise
        return relays

    async def _stream(
        self,
        request: web.Request,
        relays: list[Any],
        shapes: list[Shape],
        include_usage: bool,
    ) -> web.StreamResponse:
        """SSE events, one per chunk that carries text or the finish, each choice under its
        prompt's index (several prompts interleave); with `stream_options.include_usage`,
        OpenAI's last event: no choices, the token counts summed."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            for shape in shapes:
                for opening in shape.opening():
                    await _send_event(response, opening)
            async for index, chunk in _merged([r.follow(0) for r in relays]):
                event = shapes[index].delta(chunk)
                if event is not None:
                    await _send_event(response, event)
        except ConnectionResetError:
            return response  # the client left; the requests run on and stay attachable
        except Exception as exc:
            error = http_error_for(exc)
            await _send_event(response, {"error": {"message": str(error), "type": error.kind}})
        else:
            if include_usage:
                usage = shapes[0].usage_event()
                usage["usage"] = summed_usage(shapes)
                await _send_event(response, usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _collect(relay: Any, shape: Shape) -> None:
    async for chunk in relay.follow(0):
        shape.add(chunk)


async def _merged(
    streams: list[AsyncIterator[TokenChunk]],
) -> AsyncIterator[tuple[int, TokenChunk]]:
    """(stream index, chunk) from every stream as they come; the first error is raised."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, TokenChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TokenChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk, None))
            await queue.put((index, None, None))
        except Exception as exc:
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                open_streams -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body
