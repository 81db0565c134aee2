"""The OpenAI-compatible HTTP front, driven by the `openai` package, and /metrics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.spotinfer.v1 import common_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from tests.coordinator.conftest import TIMEOUT_SECONDS, assemble, greedy

PROMPT = "The library opens at nine"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def client(coordinator: CoordinatorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=coordinator.http_url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def _grpc_text(coordinator: CoordinatorProcess, prompt_ids: list[int]) -> tuple[list[int], str]:
    responses = list(
        coordinator.inference.Generate(greedy(prompt_ids, MAX_TOKENS), timeout=TIMEOUT_SECONDS)
    )
    return assemble(responses), "".join(r.text for r in responses)


def _metrics(coordinator: CoordinatorProcess) -> dict[str, float]:
    with urllib.request.urlopen(coordinator.http_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_streamed_completion_equals_the_grpc_output(
    coordinator: CoordinatorProcess, client: openai.OpenAI, model_name: str, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    prompt_ids = list(AutoTokenizer.from_pretrained(tiny_model).encode(PROMPT))
    tokens, text = _grpc_text(coordinator, prompt_ids)
    assert len(tokens) == MAX_TOKENS and text

    stream = client.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    # The same text prompt, tokenized by the coordinator, answered in one piece.
    whole = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].text == text
    assert whole.usage is not None and whole.usage.completion_tokens == MAX_TOKENS
    assert whole.usage.prompt_tokens == len(prompt_ids)


def test_chat_completion_uses_the_chat_template(
    client: openai.OpenAI, model_name: str, tiny_model: Path, coordinator: CoordinatorProcess
) -> None:
    from transformers import AutoTokenizer

    messages: list[Any] = [{"role": "user", "content": "What is a byte?"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = list(tokenizer.encode(templated, add_special_tokens=False))
    _, text = _grpc_text(coordinator, prompt_ids)

    answer = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert answer.choices[0].message.content == text
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    streamed = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta.content or "" for c in streamed]
    assert "".join(deltas) == text


def test_bad_requests_get_openai_errors(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    # What we cannot honour is refused by name, never ignored.
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=model_name, prompt="hi", max_tokens=2, presence_penalty=1)
    assert "does not support presence_penalty" in str(unsupported.value)
    with pytest.raises(openai.BadRequestError) as penalty:
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            frequency_penalty=0.5,
        )
    assert "does not support frequency_penalty" in str(penalty.value)
    # A value that asks for nothing passes.
    done = client.completions.create(
        model=model_name, prompt="hi", max_tokens=2, logprobs=None, presence_penalty=0
    )
    assert done.choices[0].finish_reason == "length"


def test_metrics_count_what_happened(
    coordinator: CoordinatorProcess, client: openai.OpenAI, model_name: str
) -> None:
    before = _metrics(coordinator)
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=7, temperature=0)
    list(coordinator.inference.Generate(greedy([5, 17, 42], 5), timeout=TIMEOUT_SECONDS))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="hi", max_tokens=0)
    after = _metrics(coordinator)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("spotinfer_coordinator_tokens_relayed_total{}") == 12
    assert (
        moved("spotinfer_coordinator_requests_total{finish_reason=LENGTH,sla_class=INTERACTIVE}")
        == 2
    )
    assert moved("spotinfer_coordinator_rejected_requests_total{reason=invalid}") == 1
    assert (
        moved("spotinfer_coordinator_time_to_first_token_seconds_count{sla_class=INTERACTIVE}") == 2
    )
    assert (
        moved("spotinfer_coordinator_time_per_output_token_seconds_count{sla_class=INTERACTIVE}")
        == 2
    )
    assert after["spotinfer_coordinator_queue_depth{sla_class=BATCH}"] == 0
    assert after["spotinfer_coordinator_queue_depth{sla_class=INTERACTIVE}"] == 0
    assert after["spotinfer_coordinator_requests_in_flight{}"] == 0
    assert after["spotinfer_coordinator_workers{role=active,state=ready}"] == 2


def test_unknown_sla_class_is_400(coordinator: CoordinatorProcess) -> None:
    request = urllib.request.Request(
        coordinator.http_url + "/v1/completions",
        data=json.dumps({"prompt": [1, 2], "max_tokens": 2, "sla_class": "bulk"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    assert "sla_class" in json.loads(refused.value.read())["error"]["message"]


def test_grpc_and_http_share_one_request_table(
    coordinator: CoordinatorProcess, client: openai.OpenAI, model_name: str
) -> None:
    client.completions.create(
        model=model_name,
        prompt=[5, 17, 42],
        max_tokens=6,
        temperature=0,
        extra_body={"request_id": "from-http", "ignore_eos": True},
    )
    from protos.spotinfer.v1 import inference_pb2

    attached = list(
        coordinator.inference.Attach(inference_pb2.AttachRequest(request_id="from-http"))
    )
    assert len(assemble(attached)) == 6
    assert attached[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


BATCH_PROMPTS = [f"Question {i}: where does the river {w} go?" for i, w in enumerate("abcdefgh")]


def test_a_list_of_prompts_answers_each_as_its_own_request(
    coordinator: CoordinatorProcess, client: openai.OpenAI, model_name: str, tiny_model: Path
) -> None:
    def one(prompt: str | list[int]) -> openai.types.Completion:
        return client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    singles = [one(prompt) for prompt in BATCH_PROMPTS]
    together = client.completions.create(
        model=model_name,
        prompt=BATCH_PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "request_id": "listed"},
    )
    assert [c.index for c in together.choices] == list(range(len(BATCH_PROMPTS)))
    assert [c.text for c in together.choices] == [s.choices[0].text for s in singles]
    assert all(c.finish_reason == "length" for c in together.choices)
    assert together.usage is not None
    assert together.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert together.usage.completion_tokens == MAX_TOKENS * len(BATCH_PROMPTS)
    # Each prompt was its own request, under its own id, run once.
    from protos.spotinfer.v1 import inference_pb2

    streamed_singles = []
    for i in range(len(singles)):
        attached = list(
            coordinator.inference.Attach(inference_pb2.AttachRequest(request_id=f"listed-{i}"))
        )
        assert len(assemble(attached)) == MAX_TOKENS
        streamed_singles.append("".join(r.text for r in attached))

    # Streamed, as token-id lists: the events interleave, each under its prompt's index.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    id_prompts = [list(tokenizer.encode(p)) for p in BATCH_PROMPTS]
    texts = [""] * len(id_prompts)
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        model=model_name,
        prompt=id_prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    # A stream's text is its chunks' texts (a whole answer decodes its output at once).
    assert texts == streamed_singles
    assert finishes == dict.fromkeys(range(len(id_prompts)), "length")
    assert usage is not None and usage.completion_tokens == MAX_TOKENS * len(id_prompts)


def test_prompt_lists_that_cannot_be_served_are_refused(
    client: openai.OpenAI, model_name: str
) -> None:
    for prompt, words in (
        (["text", [1, 2]], "one shape"),
        ([], "not empty"),
        (["p"] * 65, "at most 64"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=model_name, prompt=prompt, max_tokens=2)  # type: ignore[arg-type]
        assert words in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt="hi", max_tokens=2, echo=True)
    assert "does not support echo" in str(bad.value)


def test_the_python_client_runs_a_request_batch(coordinator: CoordinatorProcess) -> None:
    from common.requests import Sampling
    from spotinfer.client import Client, ClientConfig

    sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with Client(ClientConfig(targets=(coordinator.address,))) as client:
        singles = [client.generate(p, sampling).token_ids for p in BATCH_PROMPTS]
        outputs = client.generate_batch(BATCH_PROMPTS, sampling, request_id_prefix="pybatch")
    assert [o.request_id for o in outputs] == [f"pybatch-{i}" for i in range(len(BATCH_PROMPTS))]
    assert [o.token_ids for o in outputs] == singles
