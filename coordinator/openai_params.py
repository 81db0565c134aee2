"""Which OpenAI request fields the HTTP front honours, and a clear refusal for the rest.

A field we cannot honour is refused with a 400 that names it, never ignored: a client that
asks for penalties, tools or an echo and silently gets none would read a wrong answer as a
right one. Fields whose value asks for nothing (``echo: false``, a penalty of 0, ``user``,
which is only a label) pass. Log probabilities are honoured (`requested_logprobs`): a
completion's ``logprobs: k``, a chat's ``logprobs: true`` with ``top_logprobs: k``.
"""

from __future__ import annotations

from typing import Any

from common.errors import InvalidRequest
from common.validation import MAX_LOGPROBS

# Honoured by both endpoints (see http_front.py for their meaning).
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "ignore_eos",
        "sla_class",
        "request_id",
        "user",
    }
)
HONOURED = {
    False: _COMMON | {"prompt", "logprobs"},
    True: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
}
# Fields that pass when their value asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (None, 0),  # a chat field; on /v1/completions, `logprobs` says how many
    "echo": (None, False),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "min_p": (None, 0, 0.0),
}


def check_supported(body: dict[str, Any], chat: bool) -> None:
    """Raises InvalidRequest naming every field of ``body`` this front would not honour."""
    refused = []
    for name, value in body.items():
        if name in HONOURED[chat]:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is not None and any(_same(value, n) for n in neutral):
            continue
        refused.append(name)
    if refused:
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        them = "it" if len(refused) == 1 else "them"
        raise InvalidRequest(
            f"{endpoint} does not support {', '.join(sorted(refused))}: this server cannot "
            f"honour {them}; leave {them} out"
        )


def requested_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives each output token's logprobs come with (`Sampling.logprobs`),
    None when the body asks for none. A completion says it with ``logprobs: k`` (OpenAI's
    legacy field; ``false`` or null: none); a chat with ``logprobs: true`` and
    ``top_logprobs: k`` (0 when left out). Raises InvalidRequest naming the field that is
    out of 0..MAX_LOGPROBS, of the wrong type, or (``top_logprobs``) without ``logprobs``."""
    wanted = body.get("logprobs")
    if not chat:
        if wanted is None or wanted is False:
            return None
        return _count("logprobs", wanted)
    top = body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequest(f"logprobs must be true or false, got {wanted!r}")
    if not wanted:
        if top is not None and not _same(top, 0):
            raise InvalidRequest("top_logprobs needs logprobs: true")
        return None
    return 0 if top is None else _count("top_logprobs", top)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {value!r}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be in 0..{MAX_LOGPROBS}, got {value}")
    return value


def _same(value: Any, neutral: Any) -> bool:
    """``value`` is the neutral value: None is None, a boolean only a boolean (True == 1 in
    Python), a number any number of that value, anything else equal and of the same type."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    numbers = (int, float)
    if isinstance(neutral, numbers):
        return isinstance(value, numbers) and value == neutral
    return type(value) is type(neutral) and value == neutral
