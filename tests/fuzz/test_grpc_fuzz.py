"""Fuzzes every RPC of the coordinator's `Inference` and `Control` services: messages built
from the descriptors (every field kind, extreme values, unknown fields) and bytes that are no
message at all. Every input must get a clear status — OK or a typed error with a message,
never INTERNAL, UNKNOWN or a hang — and afterwards the coordinator is SERVING with nothing
in flight.

The fuzz cluster is this package's own (tests/fuzz/conftest.py). Control calls that change
the cluster never name its one real worker: Drain, InjectNotice and RegisterWorker get ids
that do not exist or addresses nothing listens on (`DEAD_ADDRESSES`, registered by the
fixture, so Drain and InjectNotice also reach a registered worker that does not answer). The real
worker keeps serving; the dead entries go LOST and stay out of routing.

Streams are read for at most `STREAM_MESSAGES_READ` messages; a request that started is then
cancelled, so the in-flight count can return to 0 quickly.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from common.validation import MAX_LOGPROBS
from protos.spotinfer.v1 import common_pb2, control_pb2, inference_pb2
from tests.fuzz.conftest import (
    DEAD_ADDRESSES,
    FINISHED_REQUEST_IDS,
    MAX_TOKENS_LIMIT,
    FuzzCluster,
)
from tests.fuzz.proto_strategies import message_bytes, wire_garbage

SERVICES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"],
    control_pb2.DESCRIPTOR.services_by_name["Control"],
)
METHODS = [method for service in SERVICES for method in service.methods]
CONTROL = SERVICES[1].full_name

# Examples per method, structured messages then raw bytes; a method missing here (a new
# RPC) gets the defaults. Sum: the figure `test_the_run_reached_its_count` asserts.
DEFAULT_EXAMPLES = (500, 200)
EXAMPLES = {
    "Generate": (2400, 900),
    "Attach": (1100, 400),
    "Cancel": (1000, 400),
    "ListWorkers": (300, 300),
    "ClusterStatus": (300, 300),
    "RegisterWorker": (800, 300),
    "Drain": (650, 300),
    "InjectNotice": (650, 300),
}
REQUIRED_CASES = 10_000
# FUZZ_SCALE=0.05 while developing; CI runs the full counts.
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))

CALL_TIMEOUT_SECONDS = 10.0
STREAM_MESSAGES_READ = 2
# Never a fuzzer's answer: the server failed, or it did not answer in time.
SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

_ids = st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True)
# Drawn half of the time instead of the generic values, to reach the valid paths.
OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "spotinfer.v1.GenerateRequest.prompt_token_ids": st.integers(0, 300),
    "spotinfer.v1.GenerateRequest.prompt": st.sampled_from(("", "hello", "a b c", "1 2 3 4")),
    "spotinfer.v1.GenerateRequest.sla_class": st.sampled_from(common_pb2.SlaClass.values()),
    "spotinfer.v1.GenerateRequest.request_id": _ids,
    "spotinfer.v1.SamplingParams.max_tokens": st.integers(0, MAX_TOKENS_LIMIT + 1),
    "spotinfer.v1.SamplingParams.temperature": st.floats(0, 2),
    "spotinfer.v1.SamplingParams.top_p": st.floats(0, 1),
    "spotinfer.v1.SamplingParams.top_k": st.integers(0, 50),
    "spotinfer.v1.SamplingParams.logprobs": st.integers(-1, MAX_LOGPROBS + 1),
    "spotinfer.v1.SamplingParams.stop": st.sampled_from(("\n", "b", "stop")),
    "spotinfer.v1.AttachRequest.request_id": st.sampled_from(FINISHED_REQUEST_IDS),
    "spotinfer.v1.AttachRequest.from_index": st.integers(0, 4),
    "spotinfer.v1.CancelRequest.request_id": st.one_of(st.sampled_from(FINISHED_REQUEST_IDS), _ids),
    "spotinfer.v1.RegisterWorkerRequest.address": st.sampled_from(DEAD_ADDRESSES),
    "spotinfer.v1.RegisterWorkerRequest.daemon_address": st.sampled_from(DEAD_ADDRESSES),
    "spotinfer.v1.DrainWorkerRequest.worker_id": st.sampled_from(DEAD_ADDRESSES),
    "spotinfer.v1.DrainWorkerRequest.grace_seconds": st.floats(0, 1),
    "spotinfer.v1.InjectNoticeRequest.worker_id": st.sampled_from(DEAD_ADDRESSES),
    "spotinfer.v1.InjectNoticeRequest.cloud": st.sampled_from(("aws", "gcp", "azure")),
}


def path_of(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def strings_in(message: Message) -> set[str]:
    """Every string value anywhere in ``message`` (nested and repeated fields included)."""
    found: set[str] = set()
    for field, value in message.ListFields():
        values = value if field.is_repeated else [value]
        for item in values:
            if isinstance(item, Message):
                found |= strings_in(item)
            elif isinstance(item, str):
                found.add(item)
    return found


def names_protected(payload: bytes, descriptor: Descriptor, protected: tuple[str, ...]) -> bool:
    try:
        message = GetMessageClass(descriptor).FromString(payload)
    except DecodeError:
        return False
    return bool(strings_in(message) & set(protected))


class Caller:
    """Calls one method with bytes as they are, and judges the answer."""

    def __init__(self, cluster: FuzzCluster, method: MethodDescriptor) -> None:
        self._cluster = cluster
        self._method = method
        response_type = GetMessageClass(method.output_type)
        make: Callable[..., Any] = (
            cluster.channel.unary_stream if method.server_streaming else cluster.channel.unary_unary
        )
        self._call = make(
            path_of(method),
            request_serializer=lambda raw: raw,
            response_deserializer=response_type.FromString,
        )
        self.outcomes: Counter[str] = Counter()
        """Answers by status name: shows the valid paths were reached, not only errors."""

    def __call__(self, payload: bytes) -> None:
        try:
            if self._method.server_streaming:
                self._read_stream(payload)
            else:
                self._call(payload, timeout=CALL_TIMEOUT_SECONDS)
            self.outcomes["OK"] += 1
        except grpc.RpcError as error:
            code, details = error.code(), error.details()  # type: ignore[attr-defined]
            self.outcomes[code.name] += 1
            assert code not in SERVER_FAULTS, (
                f"{path_of(self._method)} {payload!r}: {code} {details}"
            )
            assert details, f"{path_of(self._method)} {payload!r}: {code} with no message"

    def _read_stream(self, payload: bytes) -> None:
        call = self._call(payload, timeout=CALL_TIMEOUT_SECONDS)
        request_id = ""
        try:
            for read, response in enumerate(call, start=1):
                request_id = request_id or response.request_id
                if read >= STREAM_MESSAGES_READ or response.finish_reason:
                    break
        finally:
            call.cancel()
        if request_id and request_id not in FINISHED_REQUEST_IDS:
            # The stream was left early; the request would run on (it stays attachable).
            self._cluster.coordinator.inference.Cancel(
                inference_pb2.CancelRequest(request_id=request_id), timeout=CALL_TIMEOUT_SECONDS
            )


def fuzz(
    cluster: FuzzCluster, method: MethodDescriptor, inputs: st.SearchStrategy[bytes], count: int
) -> None:
    caller = Caller(cluster, method)
    guarded = method.containing_service.full_name == CONTROL
    sent = [0]

    @settings(
        max_examples=max(1, int(count * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(inputs)
    def one_case(payload: bytes) -> None:
        if guarded:
            assume(not names_protected(payload, method.input_type, cluster.protected))
        sent[0] += 1
        caller(payload)

    started = time.monotonic()
    one_case()
    cluster.count(method.name, sent[0])
    seconds = time.monotonic() - started
    print(f"{path_of(method)}: {sent[0]} cases in {seconds:.1f}s {dict(caller.outcomes)}")
    cluster.assert_settled()


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_messages_built_from_the_descriptors(fuzz_cluster: FuzzCluster, method: MethodDescriptor):
    structured, _ = EXAMPLES.get(method.name, DEFAULT_EXAMPLES)
    inputs = st.one_of(
        message_bytes(method.input_type, OVERRIDES),
        message_bytes(method.input_type, OVERRIDES, strict=True),
    )
    fuzz(fuzz_cluster, method, inputs, structured)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_bytes_that_are_no_message(fuzz_cluster: FuzzCluster, method: MethodDescriptor):
    _, raw = EXAMPLES.get(method.name, DEFAULT_EXAMPLES)
    fuzz(fuzz_cluster, method, wire_garbage(method.input_type), raw)


def test_the_run_reached_its_count(fuzz_cluster: FuzzCluster):
    """The figure the suite promises: runs after the fuzz tests above (file order)."""
    total = sum(fuzz_cluster.cases.values())
    print(f"gRPC fuzz cases: {total} {dict(sorted(fuzz_cluster.cases.items()))}")
    assert {m.name for m in METHODS} <= set(fuzz_cluster.cases), (
        "run the whole module: every RPC is fuzzed before the count is checked"
    )
    assert total >= REQUIRED_CASES * SCALE, f"{total} cases, fewer than {REQUIRED_CASES * SCALE}"
    fuzz_cluster.assert_settled()
    listed = fuzz_cluster.coordinator.control.ListWorkers(
        control_pb2.ListWorkersRequest(), timeout=5
    )
    real = [w for w in listed.workers if w.address == fuzz_cluster.worker.address]
    assert [w.state for w in real] == [control_pb2.WORKER_STATE_READY]
    assert [w.role for w in real] == [control_pb2.WORKER_ROLE_ACTIVE]


def test_a_request_still_runs_after_fuzzing(fuzz_cluster: FuzzCluster):
    request = common_pb2.GenerateRequest(
        prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS_LIMIT, ignore_eos=True),
    )
    responses = list(fuzz_cluster.coordinator.inference.Generate(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == MAX_TOKENS_LIMIT
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
