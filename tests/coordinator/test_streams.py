"""Streams through the coordinator: exactly once, equal to the worker's own output, and
readable again with Attach; Cancel; a request_id that exists attaches instead of starting."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from protos.spotinfer.v1 import common_pb2, inference_pb2
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.worker_process import WorkerProcess
from tests.coordinator.conftest import TIMEOUT_SECONDS, assemble, greedy

PROMPTS = [
    "The morning train left the station",
    "A good kitchen is a quiet place.",
    "Computers store numbers as bits.",
    "The library opens at nine",
    "Memory is measured in bytes",
    "Children come after school to read",
    "The river ran fast after three days of rain",
    "When the onions turn golden",
]
CONCURRENT_REQUESTS = 24
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids(tiny_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return [list(tokenizer.encode(p)) for p in PROMPTS]


def _stream(stub_call: object, request: object) -> list[common_pb2.GenerateResponse]:
    return list(stub_call(request, timeout=TIMEOUT_SECONDS))  # type: ignore[operator]


def test_concurrent_streams_are_exactly_once_and_equal_the_workers_output(
    coordinator: CoordinatorProcess, workers: list[WorkerProcess], prompt_ids: list[list[int]]
) -> None:
    prompts = [prompt_ids[i % len(prompt_ids)] for i in range(CONCURRENT_REQUESTS)]
    # Different lengths, so streams end at different steps while others still run.
    lengths = [MAX_TOKENS + (i % 5) * 7 for i in range(CONCURRENT_REQUESTS)]
    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
        through = list(
            pool.map(
                lambda args: _stream(coordinator.inference.Generate, greedy(*args)),
                zip(prompts, lengths, strict=True),
            )
        )
        direct = list(
            pool.map(
                lambda args: _stream(workers[0].stub.Generate, greedy(*args)),
                zip(prompts, lengths, strict=True),
            )
        )
    for responses, reference, length in zip(through, direct, lengths, strict=True):
        tokens = assemble(responses)
        assert len(tokens) == length
        assert tokens == assemble(reference)
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert "".join(r.text for r in responses) == "".join(r.text for r in reference)
    served_by = {r.worker_id for responses in through for r in responses}
    assert served_by == {"w0", "w1"}, "both workers take part"


def test_text_prompt_is_tokenized_by_the_coordinator(
    coordinator: CoordinatorProcess, prompt_ids: list[list[int]]
) -> None:
    by_ids = assemble(_stream(coordinator.inference.Generate, greedy(prompt_ids[0], 12)))
    by_text = common_pb2.GenerateRequest(
        prompt=PROMPTS[0], sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True)
    )
    assert assemble(_stream(coordinator.inference.Generate, by_text)) == by_ids


def test_attach_mid_stream_and_after_the_end(
    coordinator: CoordinatorProcess, prompt_ids: list[list[int]]
) -> None:
    request_id = "attach-mid-stream"
    stream = coordinator.inference.Generate(
        greedy(prompt_ids[1], 160, request_id=request_id), timeout=TIMEOUT_SECONDS
    )
    head = list(itertools.islice(stream, 3))  # the request is running now
    stream.cancel()  # the client's connection drops; the request goes on
    seen = len(assemble(head))
    attached = _stream(
        coordinator.inference.Attach,
        inference_pb2.AttachRequest(request_id=request_id, from_index=seen),
    )
    assert attached[0].index == seen
    rest = [t for r in attached for t in r.token_ids]
    assert seen + len(rest) == 160
    assert attached[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    whole = assemble(
        _stream(coordinator.inference.Attach, inference_pb2.AttachRequest(request_id=request_id))
    )
    assert whole[seen:] == rest and whole[:seen] == assemble(head)
    near_end = _stream(
        coordinator.inference.Attach,
        inference_pb2.AttachRequest(request_id=request_id, from_index=157),
    )
    assert [t for r in near_end for t in r.token_ids] == whole[157:]
    at_end = _stream(
        coordinator.inference.Attach,
        inference_pb2.AttachRequest(request_id=request_id, from_index=160),
    )
    assert [t for r in at_end for t in r.token_ids] == []
    assert at_end[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    with pytest.raises(grpc.RpcError) as past_end:
        _stream(
            coordinator.inference.Attach,
            inference_pb2.AttachRequest(request_id=request_id, from_index=161),
        )
    assert past_end.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_generate_with_an_existing_request_id_attaches(
    coordinator: CoordinatorProcess, prompt_ids: list[list[int]]
) -> None:
    request = greedy(prompt_ids[2], 96, request_id="twice")
    first = coordinator.inference.Generate(request, timeout=TIMEOUT_SECONDS)
    head = list(itertools.islice(first, 2))
    # A second start of the same id on a worker would fail with ALREADY_EXISTS; this attaches.
    second = _stream(coordinator.inference.Generate, greedy(prompt_ids[3], 5, request_id="twice"))
    rest = list(first)
    assert assemble(second) == assemble(head + rest)
    assert len(assemble(second)) == 96


def test_cancel_stops_the_request_on_its_worker(
    coordinator: CoordinatorProcess, prompt_ids: list[list[int]]
) -> None:
    request_id = "to-cancel"
    stream = coordinator.inference.Generate(
        greedy(prompt_ids[4], 900, request_id=request_id), timeout=TIMEOUT_SECONDS
    )
    head = list(itertools.islice(stream, 2))
    answer = coordinator.inference.Cancel(
        inference_pb2.CancelRequest(request_id=request_id), timeout=30
    )
    assert answer.cancelled
    responses = head + list(stream)
    tokens = assemble(responses)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert len(tokens) < 900
    assert answer.generated_tokens <= len(tokens)
    again = coordinator.inference.Cancel(
        inference_pb2.CancelRequest(request_id=request_id), timeout=30
    )
    assert not again.cancelled


def test_unknown_request_id_is_not_found(coordinator: CoordinatorProcess) -> None:
    with pytest.raises(grpc.RpcError) as attach:
        _stream(coordinator.inference.Attach, inference_pb2.AttachRequest(request_id="nobody"))
    assert attach.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as cancel:
        coordinator.inference.Cancel(inference_pb2.CancelRequest(request_id="nobody"), timeout=10)
    assert cancel.value.code() == grpc.StatusCode.NOT_FOUND
