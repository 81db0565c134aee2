"""What the big coordinator tests share: a client's stream as it was seen (counted, not
trusted), many streams read at once, and an uninterrupted reference from vLLM offline."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos.spotinfer.v1 import common_pb2, inference_pb2_grpc
from tests.coordinator.conftest import greedy
from tests.support.offline_runs import run_offline_reference

WAIT_SECONDS = 600
STREAM_TIMEOUT_SECONDS = 900


@dataclass
class StreamTrace:
    """What one client saw, counted rather than trusted (exactly-once check)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    token_workers: list[str] = field(default_factory=list)
    events: list[common_pb2.Event] = field(default_factory=list)
    duplicates: int = 0
    gaps: int = 0
    finish_reason: int = 0
    error: grpc.RpcError | None = None

    def record(self, response: common_pb2.GenerateResponse) -> None:
        if response.HasField("event"):
            self.events.append(response.event)
        for offset, token in enumerate(response.token_ids):
            index = response.index + offset
            if index < len(self.token_ids):
                self.duplicates += 1
                continue
            self.gaps += index - len(self.token_ids)
            self.token_ids.append(token)
            self.token_workers.append(response.worker_id)
        if response.finish_reason:
            self.finish_reason = response.finish_reason

    def events_of(self, kind: int) -> list[common_pb2.Event]:
        return [e for e in self.events if e.kind == kind]


def read_streams(
    inference: inference_pb2_grpc.InferenceStub,
    traces: list[StreamTrace],
    prompts: list[list[int]],
    max_tokens: int,
) -> list[threading.Thread]:
    """One thread per stream, started, each filling its trace."""

    def read(trace: StreamTrace, prompt: list[int]) -> None:
        try:
            for response in inference.Generate(
                greedy(prompt, max_tokens, trace.request_id), timeout=STREAM_TIMEOUT_SECONDS
            ):
                trace.record(response)
        except grpc.RpcError as error:
            trace.error = error

    threads = [
        threading.Thread(target=read, args=(trace, prompt), daemon=True)
        for trace, prompt in zip(traces, prompts, strict=True)
    ]
    for thread in threads:
        thread.start()
    return threads


def join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(STREAM_TIMEOUT_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a stream never ended"


def offline_reference(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    max_model_len: int,
    tmp_path: Path,
) -> list[list[int]]:
    """vLLM's offline LLM.generate, in its own process and without Redis: an uninterrupted
    run that cannot have been fed by blocks a drill persisted."""
    requests = [
        {"prompt_token_ids": p, "max_tokens": max_tokens, "ignore_eos": True} for p in prompts
    ]
    result: list[list[int]] = run_offline_reference(
        model, requests, tmp_path, max_model_len, WAIT_SECONDS
    )
    return result
