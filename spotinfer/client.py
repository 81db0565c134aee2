"""The Python client of the public `Inference` service, with stream resume.

A broken stream (the connection dropped, the coordinator restarted, a replica went away) is
picked up again with `Attach(request_id, from_index)`, so the caller sees every output
token exactly once, in order:

    Generate ──▶ 0 1 2 3 ✗ (UNAVAILABLE)
    Attach(from_index=4) ─────▶ 4 5 6 … FINISH

A request that had no token out yet and that the coordinator it reaches does not know (it
was still queued when its coordinator went away) is submitted again under the same id.

A call refused for now (RESOURCE_EXHAUSTED: a full queue, no worker within the coordinator's
capacity wait, a key over its rate) is made again once the server's ``retry-after-ms`` hint
has passed, with jitter, up to ``busy_attempts`` times; reconnects wait with exponential
backoff and jitter (see backoff.py).

Tokens that arrive twice (a replay that overlaps) are dropped by index here as well, so
the guarantee holds even against a server that repeats itself.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc

from common.channels import PLAINTEXT, TransportConfig, sync_channel
from common.requests import RequestOutput, Sampling, SlaClass, TokenChunk
from protos.convert import chunk_from_proto, sampling_to_proto, sla_to_proto
from protos.spotinfer.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from spotinfer.backoff import Backoff, retry_hint_seconds

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)
DEFAULT_RECONNECT_ATTEMPTS = 20
DEFAULT_BUSY_ATTEMPTS = 8
DEFAULT_BACKOFF_BASE_SECONDS = 0.25
DEFAULT_BACKOFF_MAX_SECONDS = 5.0
DEFAULT_BATCH_PARALLEL = 16  # a batch call's streams at once


@dataclass(frozen=True)
class ClientConfig:
    targets: tuple[str, ...]  # coordinator replicas; a reconnect tries the next one
    timeout_seconds: float = 600.0
    reconnect_attempts: int = DEFAULT_RECONNECT_ATTEMPTS
    ca_file: str = ""  # the cluster CA (TLS); empty: plaintext
    api_key: str = ""  # sent as authorization: Bearer <key>
    # A call refused for now (RESOURCE_EXHAUSTED) is made again this often, after the hint.
    busy_attempts: int = DEFAULT_BUSY_ATTEMPTS
    # Waits between tries: the first up to this long without a hint, doubling each try...
    backoff_base_seconds: float = DEFAULT_BACKOFF_BASE_SECONDS
    # ...up to this; a hint is always waited in full, this bounds only the jitter on it.
    backoff_max_seconds: float = DEFAULT_BACKOFF_MAX_SECONDS

    @property
    def transport(self) -> TransportConfig:
        return TransportConfig(ca_file=self.ca_file) if self.ca_file else PLAINTEXT

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("at least one target HOST:PORT is needed")
        if self.reconnect_attempts < 0:
            raise ValueError("reconnect_attempts must not be negative")
        if self.busy_attempts < 0:
            raise ValueError("busy_attempts must not be negative")
        Backoff(self.backoff_base_seconds, self.backoff_max_seconds)  # checks the bounds

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_base_seconds, self.backoff_max_seconds)


class Client:
    def __init__(
        self,
        config: ClientConfig,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._target_index = 0
        self._channel = self._open(config.targets[0])

    def _open(self, target: str) -> grpc.Channel:
        config = self._config
        return sync_channel(target, transport=config.transport, api_key=config.api_key)

    @classmethod
    def connect(cls, *targets: str) -> Client:
        return cls(ClientConfig(targets=tuple(targets)))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _stub(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self._channel)

    def _next_target(self) -> None:
        self._channel.close()
        self._target_index = (self._target_index + 1) % len(self._config.targets)
        self._channel = self._open(self._config.targets[self._target_index])

    def stream(
        self,
        prompt: str | Sequence[int],
        sampling: Sampling,
        sla_class: SlaClass = SlaClass.INTERACTIVE,
        request_id: str | None = None,
    ) -> Iterator[TokenChunk]:
        """Yields the output chunk by chunk; resumes by itself after a broken stream."""
        request_id = request_id or f"cli-{uuid.uuid4().hex}"
        message = common_pb2.GenerateRequest(
            request_id=request_id,
            sampling=sampling_to_proto(sampling),
            sla_class=sla_to_proto(sla_class),
        )
        if isinstance(prompt, str):
            message.prompt = prompt
        else:
            message.prompt_token_ids.extend(prompt)
        delivered = 0
        attempts = refusals = 0
        attaching = False
        responses = self._stub.Generate(message, timeout=self._config.timeout_seconds)
        while True:
            try:
                for response in responses:
                    fresh, delivered = _without_seen_tokens(chunk_from_proto(response), delivered)
                    if fresh is not None:
                        yield fresh
                        if fresh.finished:
                            return
                return
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    if refusals >= self._config.busy_attempts:
                        raise
                    refusals += 1
                    self._back_off(refusals, retry_hint_seconds(exc))
                    responses = (
                        self._attach(request_id, delivered)
                        if attaching
                        else self._stub.Generate(message, timeout=self._config.timeout_seconds)
                    )
                    continue
                # Unknown to the coordinator and not a token out yet: it never reached a
                # worker before its coordinator went away. Submitted again under its id (a
                # coordinator that does know it attaches instead of starting it twice).
                submit_again = code == grpc.StatusCode.NOT_FOUND and attaching and not delivered
                retryable = code in RETRYABLE or submit_again
                if not retryable or attempts >= self._config.reconnect_attempts:
                    raise
                hint = retry_hint_seconds(exc)
            attempts += 1
            self._back_off(attempts, hint)
            if submit_again:
                attaching = False
                responses = self._stub.Generate(message, timeout=self._config.timeout_seconds)
                continue
            if len(self._config.targets) > 1:
                self._next_target()
            attaching = True
            responses = self._attach(request_id, delivered)

    def _attach(self, request_id: str, from_index: int) -> Iterator[common_pb2.GenerateResponse]:
        return self._stub.Attach(  # type: ignore[no-any-return]
            inference_pb2.AttachRequest(request_id=request_id, from_index=from_index),
            timeout=self._config.timeout_seconds,
        )

    def _back_off(self, attempt: int, hint_seconds: float | None) -> None:
        """Waits before try ``attempt`` + 1: the server's retry hint with jitter, if it gave
        one, else exponential backoff with jitter."""
        backoff = self._config.backoff
        self._sleep(backoff.delay_seconds(attempt, hint_seconds, self._rng))

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling: Sampling,
        sla_class: SlaClass = SlaClass.INTERACTIVE,
        request_id: str | None = None,
    ) -> RequestOutput:
        """The whole output; raises grpc.RpcError for a request the server refused."""
        output: RequestOutput | None = None
        for chunk in self.stream(prompt, sampling, sla_class, request_id):
            output = output or RequestOutput(chunk.request_id)
            output.add(chunk)
        if output is None:
            raise RuntimeError("the server closed the stream without any output")
        return output

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: Sampling,
        sla_class: SlaClass = SlaClass.INTERACTIVE,
        request_id_prefix: str | None = None,
        max_parallel: int = DEFAULT_BATCH_PARALLEL,
    ) -> list[RequestOutput]:
        """A request batch: output i answers ``prompts[i]``. Each prompt is its own request
        (id ``<prefix>-<i>``), run side by side on a connection of its own (at most
        ``max_parallel`` at once) and resumed by itself like `generate`, so each runs exactly
        once. The first refusal is raised once the others are done."""
        if max_parallel < 1:
            raise ValueError("max_parallel must be at least 1")
        prefix = request_id_prefix or f"cli-{uuid.uuid4().hex}"

        def one(index: int) -> RequestOutput:
            with Client(self._config, self._sleep) as client:
                return client.generate(prompts[index], sampling, sla_class, f"{prefix}-{index}")

        with ThreadPoolExecutor(max(1, min(max_parallel, len(prompts)))) as pool:
            futures = [pool.submit(one, i) for i in range(len(prompts))]
            wait(futures)
        return [future.result() for future in futures]

    def cancel(self, request_id: str) -> bool:
        reply = self._stub.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=30)
        return bool(reply.cancelled)


def _without_seen_tokens(chunk: TokenChunk, delivered: int) -> tuple[TokenChunk | None, int]:
    """Drops the tokens of `chunk` the caller already has; keeps events and finish."""
    skip = max(0, delivered - chunk.index)
    if chunk.token_ids and chunk.index > delivered:
        raise RuntimeError(
            f"request {chunk.request_id}: the server skipped tokens {delivered}..{chunk.index - 1}"
        )
    token_ids = chunk.token_ids[skip:]
    if not token_ids and chunk.event is None and not chunk.finished:
        return None, delivered
    trimmed = TokenChunk(
        request_id=chunk.request_id,
        index=max(chunk.index, delivered) if chunk.token_ids else delivered,
        token_ids=token_ids,
        text=chunk.text if skip == 0 else "",
        logprobs=chunk.logprobs[skip:],
        finish_reason=chunk.finish_reason,
        event=chunk.event,
        worker_id=chunk.worker_id,
    )
    return trimmed, delivered + len(token_ids)
