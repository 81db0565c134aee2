"""The HTTP front refuses, by name, every OpenAI field it cannot honour."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import InvalidRequest
from coordinator.openai_params import check_supported


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        ({"prompt": "hi", "max_tokens": 3, "temperature": 0, "user": "u1"}, False),
        ({"messages": [], "max_completion_tokens": 3, "stream": True}, True),
        ({"prompt": "hi", "logprobs": None, "echo": False, "presence_penalty": 0}, False),
        ({"prompt": "hi", "frequency_penalty": 0.0, "best_of": 1, "logit_bias": {}}, False),
        ({"messages": [], "logprobs": False, "top_logprobs": 0, "tools": []}, True),
    ],
)
def test_what_asks_for_nothing_passes(body: dict[str, Any], chat: bool) -> None:
    check_supported(body, chat)


@pytest.mark.parametrize(
    ("body", "chat", "named"),
    [
        ({"prompt": "hi", "logprobs": 2}, False, "logprobs"),
        ({"messages": [], "logprobs": True, "top_logprobs": 3}, True, "logprobs, top_logprobs"),
        ({"prompt": "hi", "presence_penalty": 0.5}, False, "presence_penalty"),
        ({"prompt": "hi", "logit_bias": {"50256": -100}}, False, "logit_bias"),
        ({"prompt": "hi", "echo": True}, False, "echo"),
        ({"prompt": "hi", "best_of": 3}, False, "best_of"),
        ({"prompt": "hi", "max_token": 3}, False, "max_token"),  # a typo is not ignored
        ({"prompt": "hi", "messages": []}, False, "messages"),  # the other endpoint's field
        ({"messages": [], "prompt": "hi"}, True, "prompt"),
        ({"messages": [], "tools": [{"type": "function"}]}, True, "tools"),
        ({"prompt": "hi", "logprobs": 0}, False, "logprobs"),  # 0: the sampled token's own
        ({"prompt": "hi", "echo": 0}, False, "echo"),  # not a boolean
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    body: dict[str, Any], chat: bool, named: str
) -> None:
    with pytest.raises(InvalidRequest, match=f"does not support {named}:"):
        check_supported(body, chat)
