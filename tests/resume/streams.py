"""Reading a worker's token stream on a thread, as a client would, while the test acts."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc

from protos.spotinfer.v1 import common_pb2, worker_pb2
from spotinfer.local.worker_process import WorkerProcess

STREAM_TIMEOUT_SECONDS = 300.0


def greedy_request(
    request_id: str, prompt_token_ids: Sequence[int], max_tokens: int
) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def assemble(responses: Sequence[common_pb2.GenerateResponse], start_index: int = 0) -> list[int]:
    """Token ids of a stream, checking that indices run on without gap from ``start_index``."""
    tokens: list[int] = []
    for response in responses:
        if response.token_ids:
            assert response.index == start_index + len(tokens), "indices must be contiguous"
            tokens.extend(response.token_ids)
    return tokens


def resume_stream(
    worker: WorkerProcess, request_id: str, from_index: int
) -> tuple[common_pb2.Event, list[int]]:
    """Worker.Resume to its end: the recovery event it must send (once, before any new
    token), and the tokens (contiguous from ``from_index``)."""
    responses = list(
        worker.stub.Resume(
            worker_pb2.ResumeRequest(request_id=request_id, from_index=from_index),
            timeout=STREAM_TIMEOUT_SECONDS,
        )
    )
    return recovery_event(responses, from_index), assemble(responses, start_index=from_index)


def recovery_event(
    responses: Sequence[common_pb2.GenerateResponse], from_index: int
) -> common_pb2.Event:
    """The one event of a Resume stream, checked in place: only committed tokens (the ones
    the client lacked) may come before it, the new ones after it, then the finish."""
    events = [i for i, r in enumerate(responses) if r.HasField("event")]
    assert len(events) == 1, "Resume must report the recovery once"
    (at,) = events
    event = responses[at]
    assert event.index == from_index + sum(len(r.token_ids) for r in responses[:at])
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return event.event


def generate(worker: WorkerProcess, request: common_pb2.GenerateRequest) -> list[int]:
    responses = list(worker.stub.Generate(request, timeout=STREAM_TIMEOUT_SECONDS))
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return assemble(responses)


class StreamReader:
    """Consumes a server stream on a daemon thread; the test reads what has arrived so far."""

    def __init__(self, stream: Iterator[common_pb2.GenerateResponse]) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._responses: list[common_pb2.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._stream:
                with self._lock:
                    self._responses.append(response)
        except grpc.RpcError as error:
            self.error = error

    @property
    def responses(self) -> list[common_pb2.GenerateResponse]:
        with self._lock:
            return list(self._responses)

    def tokens(self) -> list[int]:
        return assemble(self.responses)

    def join(self, timeout: float = STREAM_TIMEOUT_SECONDS) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()
