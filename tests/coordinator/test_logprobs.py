"""Logprobs on both fronts equal vLLM's own: the shared coordinator and its real workers,
against an offline `vllm.LLM` run (its own process) of the same model, prompts and k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from openai.types.completion_choice import Logprobs as CompletionLogprobs

from common.requests import Sampling
from common.validation import MAX_LOGPROBS
from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from tests.coordinator.conftest import TIMEOUT_SECONDS, assemble, status_of
from tests.support.offline_runs import run_offline_reference

PROMPT = "The library opens at nine"
MESSAGES: list[Any] = [{"role": "user", "content": "What is a byte?"}]
MAX_TOKENS = 8
K = 5
TOLERANCE = 1e-4

Reference = tuple[list[int], list[tuple[float, dict[int, float]]]]  # tokens, (lp, top) each


@pytest.fixture(scope="module")
def client(coordinator: CoordinatorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=coordinator.http_url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    templated = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return {
        "text": list(tokenizer.encode(PROMPT)),
        "chat": list(tokenizer.encode(templated, add_special_tokens=False)),
    }


@pytest.fixture(scope="module")
def references(
    tiny_model: Path, prompts: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], Reference]:
    """vLLM's offline logprobs of each prompt, for k = K and k = MAX_LOGPROBS (one engine)."""
    keys = [(name, k) for name in prompts for k in (K, MAX_LOGPROBS)]
    requests = [
        {
            "prompt_token_ids": prompts[name],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "logprobs": k,
        }
        for name, k in keys
    ]
    folder = tmp_path_factory.mktemp("logprobs-reference")
    results = run_offline_reference(tiny_model, requests, folder, timeout_seconds=TIMEOUT_SECONDS)
    return {
        key: (
            result["token_ids"],
            [(lp, {int(t): alt for t, alt in top}) for lp, top in result["logprobs"]],
        )
        for key, result in zip(keys, results, strict=True)
    }


def _close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) <= TOLERANCE


def _check_top(got: dict[int, float], want: dict[int, float]) -> None:
    assert set(got) == set(want), "the top-k token ids differ from vLLM's"
    assert all(_close(got[t], want[t]) for t in want), (got, want)


def _check_values(got: list[float], want: dict[int, float]) -> None:
    """Top-k logprobs known by value only (the HTTP front names tokens by text)."""
    best = sorted(want.values(), reverse=True)
    assert len(got) == len(best)
    assert all(_close(g, w) for g, w in zip(sorted(got, reverse=True), best, strict=True))


def _grpc_request(prompt_ids: list[int], logprobs: int) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids,
        sampling=common_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
        ),
    )


@pytest.mark.parametrize("k", [K, MAX_LOGPROBS])
def test_grpc_logprobs_equal_vllms(
    coordinator: CoordinatorProcess,
    prompts: dict[str, list[int]],
    references: dict[tuple[str, int], Reference],
    k: int,
) -> None:
    responses = list(
        coordinator.inference.Generate(_grpc_request(prompts["text"], k), timeout=TIMEOUT_SECONDS)
    )
    tokens = assemble(responses)
    positions = [p for r in responses for p in r.logprobs]
    want_tokens, want = references[("text", k)]
    assert tokens == want_tokens
    assert len(positions) == len(tokens) == MAX_TOKENS
    for position, (lp, top) in zip(positions, want, strict=True):
        assert _close(position.logprob, lp)
        assert [t.logprob for t in position.top] == sorted(
            (t.logprob for t in position.top), reverse=True
        ), "most likely first"
        _check_top({t.token_id: t.logprob for t in position.top}, top)


def test_the_python_client_carries_logprobs(
    coordinator: CoordinatorProcess,
    prompts: dict[str, list[int]],
    references: dict[tuple[str, int], Reference],
) -> None:
    from spotinfer.client import Client, ClientConfig

    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=K)
    with Client(ClientConfig(targets=(coordinator.address,))) as grpc_client:
        output = grpc_client.generate(prompts["text"], sampling)
    want_tokens, want = references[("text", K)]
    assert output.token_ids == want_tokens
    assert len(output.logprobs) == MAX_TOKENS
    for position, (lp, top) in zip(output.logprobs, want, strict=True):
        assert position is not None and _close(position.logprob, lp)
        _check_top({t.token_id: t.logprob for t in position.top}, top)


@pytest.mark.parametrize("logprobs", [MAX_LOGPROBS + 1, -1])
def test_grpc_refuses_logprobs_out_of_range_by_name(
    coordinator: CoordinatorProcess, prompts: dict[str, list[int]], logprobs: int
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        list(
            coordinator.inference.Generate(
                _grpc_request(prompts["text"], logprobs), timeout=TIMEOUT_SECONDS
            )
        )
    assert status_of(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in refused.value.details()  # type: ignore[attr-defined]


def _check_completion_logprobs(logprobs: Any, want: list[tuple[float, dict[int, float]]]) -> None:
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == MAX_TOKENS
    for got_lp, got_top, (lp, top) in zip(
        logprobs.token_logprobs, logprobs.top_logprobs, want, strict=True
    ):
        assert _close(got_lp, lp)
        # Alternatives that read alike share a key: each value is one of vLLM's top-k.
        assert 1 <= len(got_top) <= K
        assert all(any(_close(v, w) for w in top.values()) for v in got_top.values())
        assert _close(max(got_top.values()), max(top.values()))
    offsets = logprobs.text_offset
    assert offsets[0] == 0
    assert all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens, strict=False)
    )


def test_completion_logprobs_equal_vllms(
    client: openai.OpenAI,
    prompts: dict[str, list[int]],
    references: dict[tuple[str, int], Reference],
) -> None:
    _, want = references[("text", K)]
    asked: dict[str, Any] = {
        "model": "",
        "prompt": prompts["text"],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": K,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**asked)
    _check_completion_logprobs(whole.choices[0].logprobs, want)

    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for event in client.completions.create(**asked, stream=True):
        part = event.choices[0].logprobs
        if part is not None:
            for name, values in merged.items():
                values.extend(getattr(part, name))
    streamed = CompletionLogprobs(**merged)
    _check_completion_logprobs(streamed, want)
    assert streamed == whole.choices[0].logprobs


def _check_chat_logprobs(content: list[Any], want: list[tuple[float, dict[int, float]]]) -> None:
    assert len(content) == MAX_TOKENS
    for entry, (lp, top) in zip(content, want, strict=True):
        assert _close(entry.logprob, lp)
        assert entry.bytes == list(entry.token.encode())
        _check_values([t.logprob for t in entry.top_logprobs], top)
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)


def test_chat_logprobs_equal_vllms(
    client: openai.OpenAI, references: dict[tuple[str, int], Reference]
) -> None:
    _, want = references[("chat", K)]
    asked: dict[str, Any] = {
        "model": "",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": K,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**asked)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    _check_chat_logprobs(logprobs.content, want)

    streamed: list[Any] = []
    for event in client.chat.completions.create(**asked, stream=True):
        if event.choices and event.choices[0].logprobs is not None:
            streamed.extend(event.choices[0].logprobs.content or [])
    _check_chat_logprobs(streamed, want)
    assert streamed == logprobs.content


@pytest.mark.parametrize(
    ("chat", "fields", "named"),
    [
        (False, {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        (False, {"logprobs": -1}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        (True, {"top_logprobs": 3}, "top_logprobs"),
        (True, {"logprobs": 2}, "logprobs"),
    ],
)
def test_logprobs_out_of_range_are_400s_that_name_the_field(
    client: openai.OpenAI, chat: bool, fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        if chat:
            client.chat.completions.create(
                model="", messages=MESSAGES, max_tokens=2, extra_body=fields
            )
        else:
            client.completions.create(model="", prompt="hi", max_tokens=2, extra_body=fields)
    assert named in str(refused.value)
