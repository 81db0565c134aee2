"""Bad input gets a clear status, and the worker serves the next request as if nothing happened."""

from __future__ import annotations

import grpc
import pytest

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess

MAX_MODEL_LEN = 1024  # tests/worker/conftest.py


def _sampling(**fields: object) -> common_pb2.SamplingParams:
    params: dict[str, object] = {"max_tokens": 4}
    params.update(fields)
    return common_pb2.SamplingParams(**params)  # type: ignore[arg-type]


BAD_REQUESTS = {
    "both prompt forms": common_pb2.GenerateRequest(
        prompt="hello", prompt_token_ids=[5, 6], sampling=_sampling()
    ),
    "neither prompt form": common_pb2.GenerateRequest(sampling=_sampling()),
    "prompt longer than max_model_len": common_pb2.GenerateRequest(
        prompt_token_ids=[7] * (MAX_MODEL_LEN + 10), sampling=_sampling()
    ),
    "prompt filling the whole context": common_pb2.GenerateRequest(
        prompt_token_ids=[7] * MAX_MODEL_LEN, sampling=_sampling()
    ),
    "max_tokens 0": common_pb2.GenerateRequest(prompt="hello", sampling=_sampling(max_tokens=0)),
    "max_tokens over the limit": common_pb2.GenerateRequest(
        prompt="hello", sampling=_sampling(max_tokens=MAX_MODEL_LEN + 1)
    ),
    "prompt + max_tokens over the context": common_pb2.GenerateRequest(
        prompt_token_ids=[7] * 1000, sampling=_sampling(max_tokens=100)
    ),
    "temperature < 0": common_pb2.GenerateRequest(
        prompt="hello", sampling=_sampling(temperature=-0.5)
    ),
    "temperature NaN": common_pb2.GenerateRequest(
        prompt="hello", sampling=_sampling(temperature=float("nan"))
    ),
    "top_p > 1": common_pb2.GenerateRequest(prompt="hello", sampling=_sampling(top_p=1.5)),
    "top_p < 0": common_pb2.GenerateRequest(prompt="hello", sampling=_sampling(top_p=-0.1)),
    "top_k negative": common_pb2.GenerateRequest(prompt="hello", sampling=_sampling(top_k=-3)),
    "top_k over the vocabulary": common_pb2.GenerateRequest(
        prompt="hello", sampling=_sampling(top_k=10**6)
    ),
    "token id outside the vocabulary": common_pb2.GenerateRequest(
        prompt_token_ids=[5, 10**6], sampling=_sampling()
    ),
    "request id with whitespace": common_pb2.GenerateRequest(
        request_id="a b", prompt="hello", sampling=_sampling()
    ),
    "empty stop string": common_pb2.GenerateRequest(prompt="hello", sampling=_sampling(stop=[""])),
}


def _serves_next_request(worker: WorkerProcess) -> None:
    responses = list(
        worker.stub.Generate(
            common_pb2.GenerateRequest(
                prompt="The library", sampling=_sampling(max_tokens=3, ignore_eos=True)
            ),
            timeout=60,
        )
    )
    assert sum(len(r.token_ids) for r in responses) == 3
    assert worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10).ready


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(worker: WorkerProcess, case: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(worker.stub.Generate(BAD_REQUESTS[case], timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert caught.value.details(), "the status must say what is wrong"
    _serves_next_request(worker)


def test_empty_text_prompt_is_invalid(worker: WorkerProcess) -> None:
    # "" is the proto default, so it reads as "no prompt"; one that tokenizes to nothing
    # would be caught after tokenization — both are INVALID_ARGUMENT.
    with pytest.raises(grpc.RpcError) as caught:
        list(
            worker.stub.Generate(
                common_pb2.GenerateRequest(prompt="", sampling=_sampling()), timeout=30
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _serves_next_request(worker)


def test_unknown_request_id_is_not_found(worker: WorkerProcess) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        worker.stub.Abort(worker_pb2.AbortRequest(request_id="never-seen"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    _serves_next_request(worker)


def test_oversized_message_is_refused(worker: WorkerProcess) -> None:
    huge = common_pb2.GenerateRequest(prompt="x" * (5 * 1024 * 1024), sampling=_sampling())
    with pytest.raises(grpc.RpcError) as caught:
        list(worker.stub.Generate(huge, timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _serves_next_request(worker)


def test_duplicate_running_request_id_is_already_exists(worker: WorkerProcess) -> None:
    request = common_pb2.GenerateRequest(
        request_id="twice",
        prompt="The morning",
        sampling=_sampling(max_tokens=600, ignore_eos=True),
    )
    first = worker.stub.Generate(request, timeout=120)
    next(first)
    with pytest.raises(grpc.RpcError) as caught:
        list(worker.stub.Generate(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    worker.stub.Abort(worker_pb2.AbortRequest(request_id="twice"), timeout=10)
    list(first)
    _serves_next_request(worker)
