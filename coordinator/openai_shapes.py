"""OpenAI's answer objects, built from the relay's chunks: a completion (`text_completion`)
and a chat completion, whole or as stream events. A completion of several prompts has one
shape per prompt (choice `index` i) and their usage summed (`combined`). A request that
asked for logprobs gets them in each choice (openai_logprobs.py); otherwise `logprobs` is
null."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from common.requests import FinishReason, TokenChunk
from coordinator.openai_logprobs import (
    CandidateTexts,
    ChatLogprobs,
    CompletionLogprobs,
    Logprobs,
)

FINISH_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}


class Shape:
    """How one endpoint's answer is built from the relay's chunks."""

    stream_object = ""
    logprobs_kind: type[Logprobs] = Logprobs

    def __init__(
        self,
        completion_id: str,
        model: str,
        prompt_tokens: int,
        index: int = 0,
        created: int | None = None,
    ) -> None:
        self.id = completion_id
        self.model = model
        self.index = index
        self.created = int(time.time()) if created is None else created
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.finish: str | None = None
        # Decodes the whole output at once (the answer given in one piece): its text then
        # does not depend on where the chunks were cut (a resume mid-character).
        self.decode: Callable[[list[int]], str | None] = lambda ids: None
        self.logprobs: Logprobs | None = None  # the request asked for them (`with_logprobs`)

    def with_logprobs(self, texts: CandidateTexts) -> None:
        self.logprobs = self.logprobs_kind(texts)

    def add(self, chunk: TokenChunk) -> dict[str, Any] | None:
        """Takes ``chunk`` in; returns the logprobs object of its tokens (None unless the
        request asked for logprobs)."""
        self.completion_tokens += len(chunk.token_ids)
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.finished:
            self.finish = FINISH_NAMES.get(chunk.finish_reason, "stop")
        if self.logprobs is None:
            return None
        return self.logprobs.add(self.token_ids, chunk)

    def whole_logprobs(self) -> dict[str, Any] | None:
        return self.logprobs.whole() if self.logprobs is not None else None

    def whole_text(self) -> str:
        decoded = self.decode(self.token_ids) if self.token_ids else None
        return decoded if decoded is not None else self.text

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

    def choice(self) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(Shape):
    stream_object = "text_completion"
    logprobs_kind = CompletionLogprobs

    def delta(self, chunk: TokenChunk) -> dict[str, Any] | None:
        logprobs = self.add(chunk)
        has_logprobs = logprobs is not None and bool(chunk.token_ids)
        if not chunk.text and not chunk.finished and not has_logprobs:
            return None
        choice = {
            "index": self.index,
            "text": chunk.text,
            "logprobs": logprobs if has_logprobs else None,
            "finish_reason": self.finish if chunk.finished else None,
        }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def choice(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.whole_text(),
            "logprobs": self.whole_logprobs(),
            "finish_reason": self.finish,
        }

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice()],
            "usage": self.usage(),
        }


class ChatShape(Shape):
    stream_object = "chat.completion.chunk"
    logprobs_kind = ChatLogprobs

    def _chunk(
        self, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            ],
        }

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, chunk: TokenChunk) -> dict[str, Any] | None:
        logprobs = self.add(chunk)
        has_logprobs = logprobs is not None and bool(chunk.token_ids)
        if not chunk.text and not chunk.finished and not has_logprobs:
            return None
        delta = {"content": chunk.text} if chunk.text else {}
        return self._chunk(
            delta, self.finish if chunk.finished else None, logprobs if has_logprobs else None
        )

    def choice(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "message": {"role": "assistant", "content": self.whole_text()},
            "logprobs": self.whole_logprobs(),
            "finish_reason": self.finish,
        }

    def whole(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice()],
            "usage": self.usage(),
        }


def summed_usage(shapes: Sequence[Shape]) -> dict[str, int]:
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for shape in shapes:
        for name, value in shape.usage().items():
            usage[name] += value
    return usage


def combined(shapes: Sequence[Shape]) -> dict[str, Any]:
    """The whole answer of several prompts: choice i from shape i, the usage summed."""
    whole = shapes[0].whole()
    whole["choices"] = [shape.choice() for shape in shapes]
    whole["usage"] = summed_usage(shapes)
    return whole
