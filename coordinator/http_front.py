"""The OpenAI-compatible HTTP front, on the same event loop and the same `Dispatcher` as gRPC.

    POST /v1/completions        prompt: text, token ids, or a list with one of either
    POST /v1/chat/completions   messages, through the model's chat template
    GET  /v1/models
    GET  /metrics               Prometheus text format

Both POST routes stream as server-sent events (`"stream": true`, ending `data: [DONE]`) or
answer with one JSON object. Errors come back in OpenAI's shape, `{"error": {...}}`, with the
HTTP status our typed errors map to; a full queue is 429 with `Retry-After`.
Extensions: `sla_class` ("interactive" | "batch") and `request_id` in the body, `top_k`,
`ignore_eos`, `seed`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from common.errors import InvalidRequest, ServiceError, is_unexpected
from common.requests import FinishReason, Sampling, SlaClass, TokenChunk
from coordinator.constants import (
    DEFAULT_HTTP_MAX_TOKENS,
    MODEL_OWNER,
    OPENAI_DEFAULT_TEMPERATURE,
)
from coordinator.dispatcher import Dispatcher
from coordinator.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)

_FINISH_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}
_SLA_BY_NAME = {"interactive": SlaClass.INTERACTIVE, "batch": SlaClass.BATCH}
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}


def http_error_for(exc: BaseException) -> HttpError:
    """The HTTP side of the error model (`common.errors`): each typed error's HTTP status,
    error type and headers; anything unexpected is logged and answered 500."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, ServiceError) and not is_unexpected(exc):
        return HttpError(exc.http_status, exc.http_type, str(exc), exc.http_headers())
    log.exception("unexpected error on the HTTP front", exc_info=exc)
    return HttpError(500, "internal_error", f"{type(exc).__name__}: {exc}")


def _error_response(error: HttpError) -> web.Response:
    body = {"error": {"message": str(error), "type": error.kind, "code": error.status}}
    return web.json_response(body, status=error.status, headers=error.headers)


class HttpFront:
    def __init__(self, dispatcher: Dispatcher, metrics: CoordinatorMetrics, model_name: str):
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._model_name = model_name
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._prometheus)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: a free port); returns the port."""
        # A client that hangs up cancels its handler: a request it left in the queue then
        # leaves the queue too (see Relay.follow).
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server  # aiohttp exposes the bound socket only here
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
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

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            await self._dispatcher.tokenizer.ready()
            relay = self._start(body, chat)
            stream = bool(body.get("stream", False))
        except Exception as exc:
            return _error_response(http_error_for(exc))
        completion_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _ChatShape if chat else _CompletionShape
        reply = shape(completion_id, self._model_name, len(relay.request.prompt_token_ids))
        if stream:
            options = body.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await self._stream(request, relay.follow(0), reply, include_usage)
        try:
            async for chunk in relay.follow(0):
                reply.add(chunk)
        except Exception as exc:
            return _error_response(http_error_for(exc))
        return web.json_response(reply.whole())

    def _start(self, body: dict[str, Any], chat: bool) -> Any:
        model = body.get("model")
        if model not in (None, "", self._model_name):
            raise HttpError(
                404, "not_found_error", f"model {model!r} is not served here ({self._model_name})"
            )
        if int(body.get("n", 1) or 1) != 1:
            raise InvalidRequest("n must be 1")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidRequest("messages must be a non-empty list")
            prompt_ids = self._dispatcher.prompt_ids("", (), messages=messages)
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            text, token_ids = _prompt_forms(body.get("prompt"))
            prompt_ids = self._dispatcher.prompt_ids(text, token_ids)
            max_tokens = body.get("max_tokens", DEFAULT_HTTP_MAX_TOKENS)
        if max_tokens is None:
            # Chat: up to the context length, as OpenAI's servers do.
            max_tokens = max(1, self._dispatcher.limits().max_model_len - len(prompt_ids))
        sla_name = str(body.get("sla_class", "interactive")).lower()
        if sla_name not in _SLA_BY_NAME:
            raise InvalidRequest(f"sla_class must be one of {sorted(_SLA_BY_NAME)}")
        stop = body.get("stop") or ()
        return self._dispatcher.submit(
            str(body.get("request_id", "")),
            prompt_ids,
            Sampling(
                max_tokens=_as_int("max_tokens", max_tokens),
                temperature=_float(body, "temperature", OPENAI_DEFAULT_TEMPERATURE),
                top_p=_float(body, "top_p", 1.0),
                top_k=_int(body, "top_k", 0),
                seed=None if body.get("seed") is None else _int(body, "seed", 0),
                stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
                ignore_eos=bool(body.get("ignore_eos", False)),
            ),
            _SLA_BY_NAME[sla_name],
        )

    async def _stream(
        self,
        request: web.Request,
        chunks: AsyncIterator[TokenChunk],
        reply: _Shape,
        include_usage: bool,
    ) -> web.StreamResponse:
        """SSE events, one per chunk that carries text or the finish; with
        `stream_options.include_usage`, OpenAI's last event: no choices, the token counts."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            for opening in reply.opening():
                await _send_event(response, opening)
            async for chunk in chunks:
                event = reply.delta(chunk)
                if event is not None:
                    await _send_event(response, event)
        except ConnectionResetError:
            return response  # the client left; the request runs on and stays attachable
        except Exception as exc:
            error = http_error_for(exc)
            await _send_event(response, {"error": {"message": str(error), "type": error.kind}})
        else:
            if include_usage:
                await _send_event(response, reply.usage_event())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


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


def _prompt_forms(prompt: Any) -> tuple[str, tuple[int, ...]]:
    """OpenAI's prompt shapes: "text", [ids], ["text"], [[ids]] — one prompt only."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, ()
    if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
        return "", tuple(prompt)
    raise InvalidRequest("prompt must be a string or a list of token ids (one prompt)")


def _int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    return _as_int(name, default if value is None else value)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    return value


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    return float(value)


class _Shape:
    """How one endpoint's answer is built from the relay's chunks."""

    stream_object = ""

    def __init__(self, completion_id: str, model: str, prompt_tokens: int) -> None:
        self.id = completion_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text = ""
        self.finish: str | None = None

    def add(self, chunk: TokenChunk) -> None:
        self.completion_tokens += len(chunk.token_ids)
        self.text += chunk.text
        if chunk.finished:
            self.finish = _FINISH_NAMES.get(chunk.finish_reason, "stop")

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def opening(self) -> list[dict[str, Any]]:
        return []

    def usage_event(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.stream_object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }

    def delta(self, chunk: TokenChunk) -> dict[str, Any] | None:
        raise NotImplementedError

    def whole(self) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionShape(_Shape):
    stream_object = "text_completion"

    def delta(self, chunk: TokenChunk) -> dict[str, Any] | None:
        self.add(chunk)
        if not chunk.text and not chunk.finished:
            return None
        choice = {
            "index": 0,
            "text": chunk.text,
            "logprobs": None,
            "finish_reason": self.finish if chunk.finished else None,
        }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish}
            ],
            "usage": self.usage(),
        }


class _ChatShape(_Shape):
    stream_object = "chat.completion.chunk"

    def _chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, chunk: TokenChunk) -> dict[str, Any] | None:
        self.add(chunk)
        if not chunk.text and not chunk.finished:
            return None
        delta = {"content": chunk.text} if chunk.text else {}
        return self._chunk(delta, self.finish if chunk.finished else None)

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.text},
                    "logprobs": None,
                    "finish_reason": self.finish,
                }
            ],
            "usage": self.usage(),
        }
