"""OpenAI's `logprobs` objects, built token by token from the relay's chunks: a completion's
legacy shape (parallel lists) and a chat completion's (one entry per token).

    completion: {"tokens": [t0, t1], "token_logprobs": [lp0, lp1],
                 "top_logprobs": [{text: lp, ...}, {...}], "text_offset": [0, len(t0)]}
    chat:       {"content": [{"token": t0, "logprob": lp0, "bytes": [...],
                              "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}

A token's text is what it adds to the output after the tokens before it, so the tokens'
texts add up to the output's text and `text_offset` points into it; an alternative's text
is what it would have added in that place. Without a tokenizer a token reads "token_id:<id>"
(vLLM's spelling). A token that came without logprobs (a resume replays the tokens its
client lacked from the store, which keeps none) has a null logprob and no alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.requests import TokenChunk, TokenLogprobs

LOGPROB_FLOOR = -9999.0
"""JSON has no -inf: a lower logprob is written as this (vLLM's servers do the same)."""

CandidateTexts = Callable[[Sequence[int], int, Sequence[int]], list[str] | None]
"""(output token ids, output index i, candidate ids) → the text each candidate would add
at index i after ``output[:i]``; None without a tokenizer (see prompt_tokenizer.py)."""


@dataclass(frozen=True)
class Scored:
    token: str
    logprob: float | None

    def chat(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.token.encode())}


@dataclass(frozen=True)
class Position:
    """One output token and the most likely ones at its place, as text."""

    sampled: Scored
    top: tuple[Scored, ...]


def _clamped(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class Logprobs:
    """The logprobs of one choice so far, added chunk by chunk."""

    def __init__(self, texts: CandidateTexts) -> None:
        self._texts = texts

    def add(self, output_ids: Sequence[int], chunk: TokenChunk) -> dict[str, Any]:
        """Keeps the logprobs of ``chunk``'s tokens (``output_ids``: the output up to and
        including them); returns the object of just these (a stream event's)."""
        return self._keep(self._positions(output_ids, chunk))

    def _positions(self, output_ids: Sequence[int], chunk: TokenChunk) -> list[Position]:
        given: Sequence[TokenLogprobs | None] = chunk.logprobs or [None] * len(chunk.token_ids)
        return [
            self._position(output_ids, chunk.index + offset, token_id, logprobs)
            for offset, (token_id, logprobs) in enumerate(zip(chunk.token_ids, given, strict=True))
        ]

    def _position(
        self, output_ids: Sequence[int], index: int, token_id: int, logprobs: TokenLogprobs | None
    ) -> Position:
        top = logprobs.top if logprobs is not None else ()
        candidates = [token_id, *(t.token_id for t in top)]
        texts = self._texts(output_ids, index, candidates) or [f"token_id:{c}" for c in candidates]
        sampled = Scored(texts[0], _clamped(logprobs.logprob) if logprobs is not None else None)
        alternatives = tuple(
            Scored(text, _clamped(t.logprob)) for text, t in zip(texts[1:], top, strict=True)
        )
        return Position(sampled, alternatives)

    def _keep(self, positions: list[Position]) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionLogprobs(Logprobs):
    """The legacy shape: `top_logprobs` maps text to logprob, so alternatives that read the
    same keep the most likely one's."""

    def __init__(self, texts: CandidateTexts) -> None:
        super().__init__(texts)
        self._whole = self._empty()
        self._text_chars = 0

    @staticmethod
    def _empty() -> dict[str, list[Any]]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _keep(self, positions: list[Position]) -> dict[str, Any]:
        part = self._empty()
        for position in positions:
            top: dict[str, float | None] = {}
            for scored in position.top:
                top.setdefault(scored.token, scored.logprob)
            part["tokens"].append(position.sampled.token)
            part["token_logprobs"].append(position.sampled.logprob)
            part["top_logprobs"].append(top if position.sampled.logprob is not None else None)
            part["text_offset"].append(self._text_chars)
            self._text_chars += len(position.sampled.token)
        for name, values in part.items():
            self._whole[name].extend(values)
        return part

    def whole(self) -> dict[str, Any]:
        return self._whole


class ChatLogprobs(Logprobs):
    def __init__(self, texts: CandidateTexts) -> None:
        super().__init__(texts)
        self._content: list[dict[str, Any]] = []

    def _keep(self, positions: list[Position]) -> dict[str, Any]:
        part = [{**p.sampled.chat(), "top_logprobs": [t.chat() for t in p.top]} for p in positions]
        self._content.extend(part)
        return {"content": part}

    def whole(self) -> dict[str, Any]:
        return {"content": self._content}
