"""The HTTP front refuses, by name, every OpenAI field it cannot honour."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import InvalidRequest
from common.validation import MAX_LOGPROBS
from coordinator.openai_params import check_supported, requested_logprobs


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        ({"prompt": "hi", "max_tokens": 3, "temperature": 0, "user": "u1"}, False),
        ({"messages": [], "max_completion_tokens": 3, "stream": True}, True),
        ({"prompt": "hi", "logprobs": None, "echo": False, "presence_penalty": 0}, False),
        ({"prompt": "hi", "frequency_penalty": 0.0, "best_of": 1, "logit_bias": {}}, False),
        ({"messages": [], "logprobs": False, "top_logprobs": 0, "tools": []}, True),
        ({"prompt": "hi", "logprobs": 2}, False),  # served (requested_logprobs)
        ({"messages": [], "logprobs": True, "top_logprobs": 3}, True),
    ],
)
def test_what_asks_for_nothing_passes(body: dict[str, Any], chat: bool) -> None:
    check_supported(body, chat)


@pytest.mark.parametrize(
    ("body", "chat", "named"),
    [
        ({"prompt": "hi", "top_logprobs": 3}, False, "top_logprobs"),  # a chat field
        (
            {"prompt": "hi", "frequency_penalty": 1, "repetition_penalty": 1.2},
            False,
            "frequency_penalty, repetition_penalty",
        ),
        ({"messages": [], "min_p": 0.1}, True, "min_p"),
        ({"messages": [], "response_format": {"type": "json_object"}}, True, "response_format"),
        ({"prompt": "hi", "suffix": "end"}, False, "suffix"),
        ({"prompt": "hi", "presence_penalty": 0.5}, False, "presence_penalty"),
        ({"prompt": "hi", "logit_bias": {"50256": -100}}, False, "logit_bias"),
        ({"prompt": "hi", "echo": True}, False, "echo"),
        ({"prompt": "hi", "best_of": 3}, False, "best_of"),
        ({"prompt": "hi", "max_token": 3}, False, "max_token"),  # a typo is not ignored
        ({"prompt": "hi", "messages": []}, False, "messages"),  # the other endpoint's field
        ({"messages": [], "prompt": "hi"}, True, "prompt"),
        ({"messages": [], "tools": [{"type": "function"}]}, True, "tools"),
        ({"prompt": "hi", "echo": 0}, False, "echo"),  # not a boolean
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    body: dict[str, Any], chat: bool, named: str
) -> None:
    with pytest.raises(InvalidRequest, match=f"does not support {named}:"):
        check_supported(body, chat)


@pytest.mark.parametrize(
    ("body", "chat", "k"),
    [
        ({}, False, None),
        ({"logprobs": None}, False, None),
        ({"logprobs": False}, False, None),
        ({"logprobs": 0}, False, 0),  # the sampled token's own only
        ({"logprobs": 3}, False, 3),
        ({"logprobs": MAX_LOGPROBS}, False, MAX_LOGPROBS),
        ({}, True, None),
        ({"logprobs": False, "top_logprobs": 0}, True, None),
        ({"logprobs": True}, True, 0),
        ({"logprobs": True, "top_logprobs": None}, True, 0),
        ({"logprobs": True, "top_logprobs": 4}, True, 4),
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS}, True, MAX_LOGPROBS),
    ],
)
def test_logprobs_asked_become_the_number_of_alternatives(
    body: dict[str, Any], chat: bool, k: int | None
) -> None:
    check_supported(body, chat)
    assert requested_logprobs(body, chat) == k


@pytest.mark.parametrize(
    ("body", "chat", "message"),
    [
        ({"logprobs": MAX_LOGPROBS + 1}, False, f"logprobs must be in 0..{MAX_LOGPROBS}"),
        ({"logprobs": -1}, False, "logprobs must be in"),
        ({"logprobs": True}, False, "logprobs must be an integer"),
        ({"logprobs": 2.5}, False, "logprobs must be an integer"),
        ({"logprobs": "3"}, False, "logprobs must be an integer"),
        ({"logprobs": 3}, True, "logprobs must be true or false"),
        ({"top_logprobs": 2}, True, "top_logprobs needs logprobs: true"),
        ({"logprobs": False, "top_logprobs": 2}, True, "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, True, "top_logprobs must be in"),
        ({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs must be in"),
        ({"logprobs": True, "top_logprobs": True}, True, "top_logprobs must be an integer"),
    ],
)
def test_logprobs_out_of_range_or_of_the_wrong_type_are_refused_by_name(
    body: dict[str, Any], chat: bool, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        requested_logprobs(body, chat)
