"""The rules a request must meet before any engine sees it; coordinator and worker share them.

Every rule raises `InvalidRequest` with a message that names the field and the bound, so a
client can fix its call without reading our code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import InvalidRequest
from common.requests import PRIORITY_LEVELS, Sampling

__all__ = [
    "MAX_LOGPROBS",
    "InvalidRequest",
    "Limits",
    "check_prompt_choice",
    "check_priority",
    "check_prompt_tokens",
    "check_request_id",
    "check_sampling",
]

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
"""The most alternatives a request may ask log probabilities of: vLLM's own default
`max_logprobs`, which the worker passes to its engine (worker/engine_builder.py)."""


@dataclass(frozen=True)
class Limits:
    """What a serving engine can take."""

    max_model_len: int
    max_tokens_limit: int
    vocab_size: int


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in request_id):
        raise InvalidRequest("request_id must be printable and contain no whitespace")
    if "{" in request_id or "}" in request_id:  # the store's keys use them as hash tags
        raise InvalidRequest("request_id must not contain a brace")


def check_priority(priority: int) -> None:
    """A request's own priority within its class (lower is served first)."""
    if not 0 <= priority < PRIORITY_LEVELS:
        raise InvalidRequest(
            f"priority must be in 0..{PRIORITY_LEVELS - 1} (lower is served first), got {priority}"
        )


def check_prompt_choice(prompt: str, prompt_token_ids: Sequence[int]) -> None:
    """Exactly one of the two prompt forms, and not empty."""
    if prompt and prompt_token_ids:
        raise InvalidRequest("set exactly one of prompt and prompt_token_ids, not both")
    if not prompt and not prompt_token_ids:
        raise InvalidRequest("the prompt is empty: set prompt or prompt_token_ids")


def check_prompt_tokens(token_ids: tuple[int, ...], limits: Limits) -> None:
    if not token_ids:
        raise InvalidRequest("the prompt is empty after tokenization")
    if len(token_ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(token_ids)} tokens; this model serves at most "
            f"{limits.max_model_len} tokens of context, output included"
        )
    bad = next((t for t in token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt token id {bad} is outside the vocabulary ({limits.vocab_size})"
        )


def check_sampling(sampling: Sampling, prompt_len: int, limits: Limits) -> None:
    if sampling.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if sampling.max_tokens > limits.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens {sampling.max_tokens} is over this server's limit of "
            f"{limits.max_tokens_limit}"
        )
    if prompt_len + sampling.max_tokens > limits.max_model_len:
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) is over the "
            f"context length {limits.max_model_len}"
        )
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {sampling.temperature}")
    if not math.isfinite(sampling.top_p) or not 0 < sampling.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidRequest(f"top_k must be 0 (disabled) or positive, got {sampling.top_k}")
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(
            f"logprobs must be in 0..{MAX_LOGPROBS} (the sampled token's own, plus that many "
            f"alternatives), got {sampling.logprobs}"
        )
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in sampling.stop):
        raise InvalidRequest(f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters")


def check_host_port(address: str, what: str) -> None:
    """``host:port`` with a port in 1..65535; raises ValueError naming ``what`` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{what} must be host:port, got {address!r}")
