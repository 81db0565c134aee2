"""OpenAI request bodies turned into what `Dispatcher.submit` takes: the HTTP front and the
batch job runner read `/v1/completions` and `/v1/chat/completions` bodies the same way.

    body ─▶ parse_body ─▶ ParsedBody(prompts: one per choice, Sampling, SlaClass, id)

A completion's `prompt` may be a list of prompts (OpenAI semantics): each becomes its own
request, whose answer is choice `index` i. A field we cannot honour is refused, never
ignored (`n` other than 1, and the fields of coordinator/openai_params.py: penalties,
`logit_bias`, tools, `echo`, a typo). Log probabilities become `Sampling.logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequest
from common.requests import Sampling, SlaClass
from coordinator.constants import (
    DEFAULT_HTTP_MAX_TOKENS,
    MAX_PROMPTS_PER_REQUEST,
    OPENAI_DEFAULT_TEMPERATURE,
)
from coordinator.dispatcher import Dispatcher
from coordinator.openai_params import check_supported, requested_logprobs

SLA_BY_NAME = {"interactive": SlaClass.INTERACTIVE, "batch": SlaClass.BATCH}


class ModelNotServed(InvalidRequest):
    """The body names another model; the front answers 404 (as OpenAI does)."""


@dataclass(frozen=True)
class ParsedBody:
    prompts: tuple[tuple[int, ...], ...]  # token ids, one entry per choice
    sampling: Sampling
    sla_class: SlaClass
    request_id: str  # the client's id ("" for none); several prompts get "<id>-<i>"
    stream: bool
    include_usage: bool

    def request_ids(self) -> list[str]:
        if not self.request_id:
            return [""] * len(self.prompts)
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]


def parse_body(
    dispatcher: Dispatcher, model_name: str, body: dict[str, Any], chat: bool
) -> ParsedBody:
    """Raises InvalidRequest (ModelNotServed for another model) or NoWorkerAvailable."""
    model = body.get("model")
    if model not in (None, "", model_name):
        raise ModelNotServed(f"model {model!r} is not served here ({model_name})")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidRequest(f"n must be 1, got {n!r}")
    check_supported(body, chat)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list")
        # A list of lists is a *batch* of conversations to the chat template: one prompt of
        # token-id lists, not of token ids.
        if not all(isinstance(message, dict) for message in messages):
            raise InvalidRequest("messages must be objects (role, content)")
        prompts: tuple[tuple[int, ...], ...] = (dispatcher.prompt_ids("", (), messages=messages),)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompts = tuple(
            dispatcher.prompt_ids(text, ids) for text, ids in prompt_forms(body.get("prompt"))
        )
        max_tokens = body.get("max_tokens", DEFAULT_HTTP_MAX_TOKENS)
    if max_tokens is None:
        # Chat: up to the context length, as OpenAI's servers do.
        max_tokens = max(1, dispatcher.limits().max_model_len - len(prompts[0]))
    sla_name = str(body.get("sla_class", "interactive")).lower()
    if sla_name not in SLA_BY_NAME:
        raise InvalidRequest(f"sla_class must be one of {sorted(SLA_BY_NAME)}")
    options = body.get("stream_options") or {}
    return ParsedBody(
        prompts=prompts,
        sampling=Sampling(
            max_tokens=as_int("max_tokens", max_tokens),
            temperature=_float(body, "temperature", OPENAI_DEFAULT_TEMPERATURE),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0),
            seed=None if body.get("seed") is None else _int(body, "seed", 0),
            stop=_stop(body.get("stop")),
            ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=requested_logprobs(body, chat),
        ),
        sla_class=SLA_BY_NAME[sla_name],
        request_id=str(body.get("request_id", "")),
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def prompt_forms(prompt: Any) -> list[tuple[str, tuple[int, ...]]]:
    """OpenAI's prompt shapes, one (text, token ids) per prompt: "text", [ids], and the
    lists of several, ["text", ...] and [[ids], ...] (a list mixes no shapes)."""
    if isinstance(prompt, str):
        return [(prompt, ())]
    if _is_token_list(prompt) and prompt:
        return [("", tuple(prompt))]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise InvalidRequest(
                f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS_PER_REQUEST}"
            )
        if all(isinstance(p, str) for p in prompt):
            return [(p, ()) for p in prompt]
        if all(_is_token_list(p) and p for p in prompt):
            return [("", tuple(p)) for p in prompt]
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, a list of strings or a list of "
        "token-id lists (not empty, one shape)"
    )


def _stop(stop: Any) -> tuple[str, ...]:
    """OpenAI's `stop`: absent, one string, or a list of strings."""
    if not stop:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidRequest(f"stop must be a string or a list of strings, got {stop!r}")


def _int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    return as_int(name, default if value is None else value)


def as_int(name: str, value: Any) -> int:
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
