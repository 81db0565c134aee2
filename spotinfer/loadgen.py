"""Load generator: timed arrivals of streaming requests, with every token's arrival time kept.

Works against anything that serves `Generate(GenerateRequest) -> stream GenerateResponse`:
the coordinator's `Inference` service or a worker's `Worker` service.

    arrivals (Poisson / bursty / uniform)      per request
    ──┬────┬─┬──────┬───▶ time                 sent_at ─ first token ─ token ─ ... ─ last
      r0   r1 r2    r3                                  TTFT      TPOT (mean gap)
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from protos.spotinfer.v1 import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2_grpc

REATTACH_ATTEMPTS = 40  # broken streams picked up again, per request
REATTACH_BACKOFF_SECONDS = 0.5


class Sampling(str, enum.Enum):
    GREEDY = "greedy"  # temperature 0: one right answer per request
    SEEDED = "seeded"  # temperature 1, a seed per request: still one right answer


# A seeded load's request i samples with this seed (a fixed offset keeps it off small seeds
# a test may use by hand).
SEED_BASE = 100_000


class Arrival(str, enum.Enum):
    POISSON = "poisson"  # exponential gaps at the mean rate
    BURSTY = "bursty"  # groups of `burst_size` at once, groups at the mean rate / burst_size
    UNIFORM = "uniform"  # evenly spaced


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int
    rate_per_second: float  # mean arrivals per second; 0: all at once
    arrival: Arrival = Arrival.POISSON
    burst_size: int = 8
    prompt_tokens: tuple[int, int] = (32, 256)  # inclusive range, sampled uniformly
    output_tokens: tuple[int, int] = (32, 128)
    batch_fraction: float = 0.0  # share of requests sent as SLA_CLASS_BATCH
    vocab_low: int = 16  # prompt ids are drawn from [vocab_low, vocab_high)
    vocab_high: int = 256
    seed: int = 0
    sampling: Sampling = Sampling.GREEDY

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if self.rate_per_second < 0:
            raise ValueError("rate_per_second must not be negative")
        if self.burst_size < 1:
            raise ValueError("burst_size must be at least 1")
        for name in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {low, high}")
        if not 0 <= self.batch_fraction <= 1:
            raise ValueError("batch_fraction must be in [0, 1]")
        if not 0 <= self.vocab_low < self.vocab_high:
            raise ValueError("vocab range must be 0 <= low < high")


@dataclass(frozen=True)
class PlannedRequest:
    request_id: str
    send_offset_seconds: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sla_class: int
    temperature: float = 0.0
    sampling_seed: int | None = None  # None: vLLM's own randomness (or greedy)


@dataclass(frozen=True)
class TraceEvent:
    """An event a stream carried (MIGRATED, RECOVERED, ...), when the client saw it."""

    time: float
    kind: str  # EventKind name without the prefix, lower case: "migrated", "recovered", ...
    from_worker: str = ""
    to_worker: str = ""
    recomputed_tokens: int = 0
    loaded_tokens: int = 0
    detail: str = ""


@dataclass
class RequestTrace:
    request_id: str
    sla_class: int
    prompt_tokens: int
    max_tokens: int
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one entry per token
    token_ids: list[int] = field(default_factory=list)
    token_workers: list[str] = field(default_factory=list)  # which worker produced each token
    finish_reason: int = 0
    error_code: str = ""
    error_detail: str = ""  # the status message that came with error_code
    events: list[TraceEvent] = field(default_factory=list)
    duplicates: int = 0
    gaps: int = 0
    reattached: int = 0  # times the stream broke and was picked up with Attach
    resubmitted: int = 0  # times Generate was sent again: no coordinator knew the request
    engine_queued_at: float | None = None  # the engine's own clock (EngineTiming), first engine
    engine_scheduled_at: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error_code and self.finish_reason not in (
            common_pb2.FINISH_REASON_CANCELLED,
            common_pb2.FINISH_REASON_ERROR,
        )

    @property
    def ttft_seconds(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def tpot_seconds(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_seconds(self) -> float | None:
        return self.token_times[-1] - self.sent_at if self.token_times else None

    @property
    def recomputed_tokens(self) -> int:
        return sum(e.recomputed_tokens for e in self.events)

    @property
    def max_gap_seconds(self) -> float:
        """The longest pause between consecutive tokens (a migration shows up here)."""
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
        return max(gaps, default=0.0)


def plan_requests(spec: LoadSpec, prefix: str = "load") -> list[PlannedRequest]:
    """Deterministic for a given spec (seeded)."""
    rng = random.Random(spec.seed)
    offsets = _arrival_offsets(spec, rng)
    planned = []
    for i, offset in enumerate(offsets):
        prompt_len = rng.randint(*spec.prompt_tokens)
        planned.append(
            PlannedRequest(
                request_id=f"{prefix}-{spec.seed}-{i}",
                send_offset_seconds=offset,
                prompt_token_ids=tuple(
                    rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(prompt_len)
                ),
                max_tokens=rng.randint(*spec.output_tokens),
                sla_class=(
                    common_pb2.SLA_CLASS_BATCH
                    if rng.random() < spec.batch_fraction
                    else common_pb2.SLA_CLASS_INTERACTIVE
                ),
                temperature=1.0 if spec.sampling is Sampling.SEEDED else 0.0,
                sampling_seed=_sampling_seed(spec, i),
            )
        )
    return planned


def _sampling_seed(spec: LoadSpec, i: int) -> int | None:
    if spec.sampling is Sampling.SEEDED:
        return SEED_BASE + spec.seed * 10_000 + i
    return None


def _arrival_offsets(spec: LoadSpec, rng: random.Random) -> list[float]:
    n = spec.num_requests
    if spec.rate_per_second == 0:
        return [0.0] * n
    if spec.arrival == Arrival.UNIFORM:
        return [i / spec.rate_per_second for i in range(n)]
    if spec.arrival == Arrival.POISSON:
        offsets, now = [], 0.0
        for _ in range(n):
            offsets.append(now)
            now += rng.expovariate(spec.rate_per_second)
        return offsets
    group_rate = spec.rate_per_second / spec.burst_size
    offsets, now = [], 0.0
    while len(offsets) < n:
        offsets.extend([now] * min(spec.burst_size, n - len(offsets)))
        now += rng.expovariate(group_rate)
    return offsets


StubFactory = Callable[[grpc.aio.Channel], object]


def stub_for(service: str) -> StubFactory:
    """`inference` (the coordinator) or `worker` (a worker directly)."""
    if service == "inference":
        return inference_pb2_grpc.InferenceStub
    if service == "worker":
        return worker_pb2_grpc.WorkerStub
    raise ValueError(f"unknown service {service!r}: use 'inference' or 'worker'")


async def run_load(
    target: str,
    planned: Sequence[PlannedRequest],
    service: str = "inference",
    timeout_seconds: float = 600.0,
    ignore_eos: bool = True,
    on_done: Callable[[RequestTrace], None] | None = None,
    on_start: Callable[[RequestTrace], None] | None = None,
    transport: TransportConfig = PLAINTEXT,
    api_key: str = "",
) -> list[RequestTrace]:
    """Sends every planned request at its offset, streams it, and keeps per-token times.
    ``transport`` and ``api_key``: what the target asks of a client (TLS, a key)."""
    async with async_channel(target, transport=transport, api_key=api_key) as channel:
        stub = stub_for(service)(channel)
        start = time.perf_counter()

        async def one(request: PlannedRequest) -> RequestTrace:
            delay = start + request.send_offset_seconds - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            trace = await _stream_one(stub, request, timeout_seconds, ignore_eos, on_start)
            if on_done is not None:
                on_done(trace)
            return trace

        return list(await asyncio.gather(*(one(r) for r in planned)))


class NextCall(str, enum.Enum):
    """What a client of the public service does after its call failed."""

    ATTACH = "attach"  # pick the stream up again where it was
    GENERATE = "generate"  # send the request again, under the same id
    GIVE_UP = "give_up"


def next_call(code: grpc.StatusCode, was_attach: bool, tokens_received: int) -> NextCall:
    """The client's retry rule, as `spotinfer.client` applies it, plus one case:

    UNAVAILABLE (the stream broke, the coordinator is restarting, or no worker could take
    the request yet) ─▶ Attach from the next index. Attach answering NOT_FOUND before any
    token ─▶ Generate again: no coordinator nor worker knows the request (it was refused,
    or its coordinator died before it reached a worker), and its id makes a second
    Generate safe — a coordinator that has it attaches instead of starting it twice.
    """
    if code == grpc.StatusCode.UNAVAILABLE:
        return NextCall.ATTACH
    if code == grpc.StatusCode.NOT_FOUND and was_attach and tokens_received == 0:
        return NextCall.GENERATE
    return NextCall.GIVE_UP


async def _stream_one(
    stub: object,
    request: PlannedRequest,
    timeout_seconds: float,
    ignore_eos: bool,
    on_start: Callable[[RequestTrace], None] | None = None,
) -> RequestTrace:
    trace = RequestTrace(
        request_id=request.request_id,
        sla_class=request.sla_class,
        prompt_tokens=len(request.prompt_token_ids),
        max_tokens=request.max_tokens,
    )
    message = common_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=common_pb2.SamplingParams(
            max_tokens=request.max_tokens,
            ignore_eos=ignore_eos,
            temperature=request.temperature,
            seed=request.sampling_seed,
        ),
        sla_class=request.sla_class,  # type: ignore[arg-type]
    )
    trace.sent_at = time.perf_counter()
    if on_start is not None:
        on_start(trace)  # lets a drill watch the stream while it runs
    stream = stub.Generate(message, timeout=timeout_seconds)  # type: ignore[attr-defined]
    was_attach = False
    retries = 0
    while True:
        try:
            async for response in stream:
                _record(trace, response, time.perf_counter())
            return trace
        except grpc.aio.AioRpcError as exc:
            # A worker has no Attach: only a client of the public service retries.
            action = (
                next_call(exc.code(), was_attach, len(trace.token_ids))
                if isinstance(stub, inference_pb2_grpc.InferenceStub)
                else NextCall.GIVE_UP
            )
            if action == NextCall.GIVE_UP or retries >= REATTACH_ATTEMPTS:
                trace.error_code = exc.code().name
                trace.error_detail = exc.details() or ""
                return trace
        retries += 1
        await asyncio.sleep(REATTACH_BACKOFF_SECONDS)
        was_attach = action == NextCall.ATTACH
        if was_attach:
            trace.reattached += 1
            stream = stub.Attach(  # type: ignore[attr-defined]
                inference_pb2.AttachRequest(
                    request_id=request.request_id, from_index=len(trace.token_ids)
                ),
                timeout=timeout_seconds,
            )
        else:
            trace.resubmitted += 1
            stream = stub.Generate(message, timeout=timeout_seconds)  # type: ignore[attr-defined]


def _record(trace: RequestTrace, response: common_pb2.GenerateResponse, now: float) -> None:
    """Counts duplicates and gaps instead of trusting the server (exactly-once check)."""
    if response.HasField("event"):
        event = response.event
        trace.events.append(
            TraceEvent(
                time=now,
                kind=common_pb2.EventKind.Name(event.kind).removeprefix("EVENT_KIND_").lower(),
                from_worker=event.from_worker,
                to_worker=event.to_worker,
                recomputed_tokens=event.recomputed_tokens,
                loaded_tokens=event.loaded_tokens,
                detail=event.detail,
            )
        )
    if response.HasField("engine_timing") and trace.engine_scheduled_at is None:
        trace.engine_queued_at = response.engine_timing.queued_at
        trace.engine_scheduled_at = response.engine_timing.scheduled_at
    expected = len(trace.token_ids)
    for offset, token in enumerate(response.token_ids):
        index = response.index + offset
        if index < expected:
            trace.duplicates += 1
            continue
        if index > expected:
            trace.gaps += index - expected
        trace.token_ids.append(token)
        trace.token_times.append(now)
        trace.token_workers.append(response.worker_id)
        expected = len(trace.token_ids)
    if response.finish_reason:
        trace.finish_reason = response.finish_reason


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    completed: int
    errors: dict[str, int]
    wall_seconds: float
    output_tokens: int
    tokens_per_second: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    e2e_ms_p50: float
    e2e_ms_p99: float
    duplicates: int
    gaps: int


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def summarize(traces: Sequence[RequestTrace]) -> LoadSummary:
    ok = [t for t in traces if t.ok]
    errors: dict[str, int] = {}
    for t in traces:
        if not t.ok:
            key = t.error_code or common_pb2.FinishReason.Name(t.finish_reason)  # type: ignore[arg-type]
            errors[key] = errors.get(key, 0) + 1
    first_sent = min((t.sent_at for t in traces), default=0.0)
    last_token = max((t.token_times[-1] for t in traces if t.token_times), default=first_sent)
    wall = max(last_token - first_sent, 1e-9)
    tokens = sum(len(t.token_ids) for t in ok)
    ttft = [t.ttft_seconds * 1000 for t in ok if t.ttft_seconds is not None]
    tpot = [t.tpot_seconds * 1000 for t in ok if t.tpot_seconds is not None]
    e2e = [t.e2e_seconds * 1000 for t in ok if t.e2e_seconds is not None]
    return LoadSummary(
        requests=len(traces),
        completed=len(ok),
        errors=errors,
        wall_seconds=wall,
        output_tokens=tokens,
        tokens_per_second=tokens / wall,
        ttft_ms_p50=percentile(ttft, 0.5),
        ttft_ms_p99=percentile(ttft, 0.99),
        tpot_ms_p50=percentile(tpot, 0.5),
        tpot_ms_p99=percentile(tpot, 0.99),
        e2e_ms_p50=percentile(e2e, 0.5),
        e2e_ms_p99=percentile(e2e, 0.99),
        duplicates=sum(t.duplicates for t in traces),
        gaps=sum(t.gaps for t in traces),
    )


def goodput(traces: Sequence[RequestTrace], ttft_ms: float, tpot_ms: float) -> float:
    """Requests per second that completed within both latency targets."""
    good = [
        t
        for t in traces
        if t.ok
        and t.ttft_seconds is not None
        and t.ttft_seconds * 1000 <= ttft_ms
        and (t.tpot_seconds is None or t.tpot_seconds * 1000 <= tpot_ms)
    ]
    summary = summarize(traces)
    return len(good) / summary.wall_seconds if traces else 0.0
