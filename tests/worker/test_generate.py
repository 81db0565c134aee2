"""A real worker process serves real tokens: the same as vLLM's offline engine, with
contiguous indices, under concurrency."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess
from tests.support.offline_runs import run_offline_reference

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
MAX_TOKENS = 24


def _stream(
    worker: WorkerProcess, request: common_pb2.GenerateRequest
) -> list[common_pb2.GenerateResponse]:
    return list(worker.stub.Generate(request, timeout=120))


def _assemble(responses: list[common_pb2.GenerateResponse]) -> list[int]:
    tokens: list[int] = []
    for response in responses:
        assert response.index == len(tokens), "indices must be contiguous from 0"
        tokens.extend(response.token_ids)
    return tokens


def _offline_reference(model: Path, prompts: list[list[int]], tmp_path: Path) -> list[list[int]]:
    requests = [
        {"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in prompts
    ]
    result: list[list[int]] = run_offline_reference(model, requests, tmp_path)
    return result


def test_concurrent_greedy_streams_equal_offline_generate(
    worker: WorkerProcess, tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    requests = [
        common_pb2.GenerateRequest(
            request_id=f"concurrent-{i}",
            prompt=PROMPTS[i] if i % 2 else "",
            prompt_token_ids=[] if i % 2 else prompt_ids[i],
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        for i in range(len(PROMPTS))
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: _stream(worker, r), requests))

    reference = _offline_reference(tiny_model, prompt_ids, tmp_path)
    for i, responses in enumerate(streams):
        assert _assemble(responses) == reference[i], f"request {i} differs from LLM.generate"
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert all(r.request_id == f"concurrent-{i}" for r in responses)


def test_text_streams_as_it_decodes(worker: WorkerProcess, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    responses = _stream(
        worker,
        common_pb2.GenerateRequest(
            prompt="The library opens",
            sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True),
        ),
    )
    tokens = _assemble(responses)
    assert len(tokens) == 12
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens, skip_special_tokens=True)
    assert responses[0].request_id, "the worker assigns an id when the client sends none"


def test_seeded_sampling_repeats(worker: WorkerProcess) -> None:
    def sample() -> list[int]:
        return _assemble(
            _stream(
                worker,
                common_pb2.GenerateRequest(
                    prompt="Dinner is ready",
                    sampling=common_pb2.SamplingParams(
                        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True
                    ),
                ),
            )
        )

    assert sample() == sample()


def test_stats_report_the_engine(worker: WorkerProcess) -> None:
    stats = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    assert stats.ready and not stats.draining
    assert stats.kv_block_tokens == 128
    assert stats.kv_blocks_total > 0
    assert stats.kv_blocks_used + stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.max_model_len == 1024
    assert stats.generated_tokens_total > 0, "earlier tests generated tokens on this worker"
    assert stats.requests_total > 0


def test_abort_ends_the_stream_cancelled(worker: WorkerProcess) -> None:
    stream = worker.stub.Generate(
        common_pb2.GenerateRequest(
            request_id="to-abort",
            prompt="The morning train",
            sampling=common_pb2.SamplingParams(max_tokens=900, ignore_eos=True),
        ),
        timeout=120,
    )
    first = next(stream)
    assert first.index == 0
    worker.stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=10)
    rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert first.index + len(first.token_ids) + sum(len(r.token_ids) for r in rest) < 900


def test_health_serving(worker: WorkerProcess) -> None:
    assert worker.health() == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(worker: WorkerProcess) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert worker.channel is not None
    stub = reflection_pb2_grpc.ServerReflectionStub(worker.channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"spotinfer.v1.Worker", "grpc.health.v1.Health"} <= names


def test_unknown_abort_is_not_found(worker: WorkerProcess) -> None:
    try:
        worker.stub.Abort(worker_pb2.AbortRequest(request_id="no-such-request"), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-request" in (exc.details() or "")
    else:
        raise AssertionError("Abort of an unknown id must fail")
