"""The engine's token streams: admission, one vLLM request per stream (DELTA outputs, one per
step, turned into `TokenChunk`s with our output indices), tokens to the committer, abort.

A request the preemption part marks ``paused`` ends in vLLM as an abort, but its stream does
not end as cancelled: its last tokens go out, then a NOTICE event (the client's relay resumes
it elsewhere), and the committer marks it PAUSED, not CANCELLED.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.requests import (
    EngineTiming,
    Event,
    EventKind,
    FinishReason,
    GenerationRequest,
    SlaClass,
    TokenChunk,
    TokenLogprobs,
    TopLogprob,
    engine_priority,
)
from common.validation import check_priority, check_prompt_tokens, check_sampling
from store import RequestRecord, RequestStatus
from store.request_record import sampling_to_record
from worker.constants import (
    KV_PARAM_REQUEST_ID,
    KV_PARAM_TENANT,
    PAUSED_DETAIL,
    SEED_DRAWS_ARG,
)
from worker.engine_context import EngineContext
from worker.errors import (
    DuplicateRequest,
    EngineNotReady,
    InvalidRequest,
    RequestNotFound,
    WorkerDraining,
)

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
    "error": FinishReason.ERROR,
}

_STORE_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED,
    FinishReason.LENGTH: RequestStatus.FINISHED,
    FinishReason.CANCELLED: RequestStatus.CANCELLED,
    FinishReason.ERROR: RequestStatus.FAILED,
}


@dataclass
class RunningRequest:
    """One in-flight request as this worker streams it (owned by the event loop)."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    streamed_tokens: int = 0  # output tokens in the store's indexing (resumes start at n)
    paused: bool = False  # set by preempt: its abort is a pause, not a cancel
    aborted: bool = False  # set by Abort: the client cancelled it, an end and never a pause
    ended: bool = False  # vLLM gave its last output: whatever cuts the stream now, it is over
    task: asyncio.Task[Any] | None = None  # the task that runs the stream (its RPC's)


class RequestStreams:
    """Every request running here, by our id; ``draining``: no new ones are admitted."""

    def __init__(self, context: EngineContext) -> None:
        self._ctx = context
        self.running: dict[str, RunningRequest] = {}
        self.requests_total = 0
        self.draining = False

    def stop_admitting(self) -> None:
        self.draining = True

    def check_admission(self, request_id: str) -> None:
        if self.draining:
            raise WorkerDraining("the worker is draining and admits no new requests")
        if self._ctx.llm is None:
            raise EngineNotReady("the engine is still loading the model")
        if request_id in self.running:
            raise DuplicateRequest(f"request {request_id!r} is already running on this worker")

    def validate(self, request: GenerationRequest) -> None:
        """Raises InvalidRequest with a readable message; see `common.validation`."""
        limits = self._ctx.require_limits()
        check_prompt_tokens(request.prompt_token_ids, limits)
        check_sampling(request.sampling, len(request.prompt_token_ids), limits)
        if request.sampling.top_k > limits.vocab_size:
            raise InvalidRequest(
                f"top_k {request.sampling.top_k} is over the vocabulary size {limits.vocab_size}"
            )
        if request.priority is not None:
            check_priority(request.priority)
            if not self.prioritized:
                raise InvalidRequest(
                    f"priority {request.priority}: this worker schedules first come first "
                    "served (--scheduling-policy fcfs) and cannot honour a priority"
                )

    @property
    def prioritized(self) -> bool:
        """The engine orders waiting requests by class and priority (vLLM's priority policy)."""
        return self._ctx.config.scheduling_policy == "priority"

    def engine_priority(self, request: GenerationRequest) -> int:
        """vLLM's priority for ``request``: its class, then its own priority; 0 under fcfs
        (vLLM's default, which that policy never reads)."""
        if not self.prioritized:
            return 0
        return engine_priority(request.sla_class, request.priority)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        """Streams the output. The caller going away stops the request in vLLM; with a store
        it stays paused and resumable (Worker.Resume), as after a notice."""
        self.check_admission(request.request_id)
        self.validate(request)
        kv_params: dict[str, Any] = {}
        committer = self._ctx.committer
        if committer is not None:
            kv_params = {KV_PARAM_REQUEST_ID: request.request_id}
            committer.admit(
                RequestRecord(
                    request_id=request.request_id,
                    model_fingerprint=self._ctx.fingerprint,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=sampling_to_record(request.sampling),
                    kv_block_tokens=self._ctx.require_shape().kv_chunk_tokens,
                    status=RequestStatus.RUNNING,
                    owner_worker_id=self._ctx.config.worker_id,
                    tenant=request.tenant,
                    sla_class=request.sla_class.name,
                    priority=request.priority,
                )
            )
        async with contextlib.aclosing(self.stream(request, 0, kv_params)) as steps:
            async for chunk, _ in steps:
                yield chunk

    async def stream(
        self, request: GenerationRequest, start_index: int, kv_params: dict[str, Any]
    ) -> AsyncGenerator[tuple[TokenChunk, int | None], None]:
        """Runs one request in vLLM; yields each step's chunk (indices from ``start_index``)
        with vLLM's count of prompt tokens it did not compute (prefix cache or connector)."""
        request_id = request.request_id
        if request_id in self.running:
            raise DuplicateRequest(f"request {request_id!r} is already running on this worker")
        running = RunningRequest(streamed_tokens=start_index, task=asyncio.current_task())
        self.running[request_id] = running
        self.requests_total += 1
        committer = self._ctx.committer
        index = start_index
        finish = FinishReason.CANCELLED  # unless vLLM says otherwise
        try:
            outputs = self._ctx.llm.generate(
                self.prompt(request_id, request.prompt_token_ids, request.tenant),
                self.sampling_params(request, kv_params, start_index),
                request_id=request_id,
                priority=self.engine_priority(request),
            )
            timed = False
            async for output in outputs:
                chunk, paused_here = self._step_chunk(request, output, index, running.paused)
                if not timed and chunk.token_ids:
                    timed = True
                    chunk = _with_engine_timing(chunk, output)
                if paused_here:
                    finish = FinishReason.CANCELLED
                index += len(chunk.token_ids)
                running.streamed_tokens = index
                if committer is not None:
                    committer.add(request_id, chunk.token_ids)
                if chunk.finished:
                    finish = chunk.finish_reason
                    running.ended = True
                if chunk.token_ids or not paused_here:
                    yield chunk, output.num_cached_tokens
                if chunk.finished or paused_here:
                    break
            last = (
                None
                if running.ended
                else self._last_chunk(request_id, index, finish, running.paused)
            )
            if last is not None:
                yield last, None
        except (asyncio.CancelledError, GeneratorExit):
            if committer is not None and not (running.ended or running.aborted):
                # The caller went away (its coordinator died or restarts), not the client,
                # who cancels with Abort: with a store the request stays resumable — paused
                # and persisted as on a notice — so a coordinator can resume it on Attach.
                # A request that ended (an Abort's final output, a finish) is not revived:
                # its caller closing the stream right after the end is no loss.
                running.paused = True
                asyncio.get_running_loop().create_task(self.abort_quietly(request_id))
            raise
        finally:
            if committer is not None:
                if running.paused and finish == FinishReason.CANCELLED:
                    committer.pause(request_id)
                else:
                    committer.finish(request_id, _STORE_STATUS[finish], finish.name)
            del self.running[request_id]
            running.done.set()

    def _step_chunk(
        self, request: GenerationRequest, output: Any, index: int, paused: bool
    ) -> tuple[TokenChunk, bool]:
        """One vLLM output as a chunk at ``index``, and whether it is the abort of a paused
        request: a pause is not an end, so its chunk does not finish (the NOTICE follows)."""
        completion = output.outputs[0]
        chunk_finish = _FINISH_REASONS.get(completion.finish_reason or "", FinishReason.NONE)
        if output.finished and chunk_finish == FinishReason.NONE:
            chunk_finish = FinishReason.STOP
        paused_here = chunk_finish == FinishReason.CANCELLED and paused
        if paused_here:
            chunk_finish = FinishReason.NONE
        token_ids = tuple(completion.token_ids)
        top_k = request.sampling.logprobs
        chunk = TokenChunk(
            request_id=request.request_id,
            index=index,
            token_ids=token_ids,
            text=completion.text,
            finish_reason=chunk_finish,
            worker_id=self._ctx.config.worker_id,
            logprobs=_token_logprobs(token_ids, completion.logprobs, top_k)
            if top_k is not None
            else (),
        )
        return chunk, paused_here

    def _last_chunk(
        self, request_id: str, index: int, finish: FinishReason, paused: bool
    ) -> TokenChunk | None:
        """What follows vLLM's last output of an aborted request, if anything."""
        if finish == FinishReason.CANCELLED and paused:
            # Not an end: the client's relay resumes it on another worker.
            return self.paused_chunk(request_id, index)
        if finish == FinishReason.CANCELLED:
            # vLLM ends an aborted request's stream without a final output.
            return TokenChunk(
                request_id=request_id,
                index=index,
                finish_reason=FinishReason.CANCELLED,
                worker_id=self._ctx.config.worker_id,
            )
        return None

    def prompt(self, request_id: str, token_ids: Sequence[int], tenant: str = "") -> dict[str, Any]:
        """vLLM's prompt. Unless prefix caching across requests is on, the request's id salts
        its block hashes: only the request itself (a warm-up before its resume) hits them.
        With it on, the tenant does: requests share cached KV within their tenant only (the
        default tenant stays unsalted)."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if not self._ctx.config.enable_prefix_caching:
            prompt["cache_salt"] = request_id
        elif tenant:
            prompt["cache_salt"] = f"tenant:{tenant}"
        return prompt

    def paused_chunk(self, request_id: str, index: int) -> TokenChunk:
        worker_id = self._ctx.config.worker_id
        return TokenChunk(
            request_id=request_id,
            index=index,
            event=Event(kind=EventKind.NOTICE, from_worker=worker_id, detail=PAUSED_DETAIL),
            worker_id=worker_id,
        )

    def sampling_params(
        self, request: GenerationRequest, kv_params: dict[str, Any], start_index: int = 0
    ) -> Any:
        """vLLM's parameters for ``request``, whose output continues at ``start_index``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = request.sampling
        extra_args: dict[str, Any] = {}
        if kv_params:  # the connector names the request's blocks by its tenant's chain
            # vLLM suffixes its request ids; the connector finds ours here.
            extra_args["kv_transfer_params"] = {**kv_params, KV_PARAM_TENANT: request.tenant}
        if sampling.seed is not None and start_index:
            # A seeded request resumed at output index n: its generator skips the n draws
            # its first n tokens took, so the sequence goes on as if never interrupted.
            extra_args[SEED_DRAWS_ARG] = start_index
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.logprobs,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args or None,
        )

    async def take_over(self, request_id: str, timeout_seconds: float) -> None:
        """A coordinator resumes a request that still runs here: the caller of this run is
        gone (a coordinator that died or restarted, whose connection this worker has not yet
        seen drop), since a live caller never asks to resume it. The old run is paused as on
        a notice (its tokens and tail persisted, its stream ended with a NOTICE) and, once
        everything of it is in the store, the resume may start. Raises DuplicateRequest if
        the old run does not end within ``timeout_seconds``."""
        running = self.running.get(request_id)
        if running is None:
            return
        log.warning("request %s is resumed while it runs here: pausing this run", request_id)
        running.paused = True
        if running.task is not None:
            # What gRPC does once it sees the caller gone: the stream pauses, as below.
            running.task.cancel()
        else:
            await self.abort_quietly(request_id)
        try:
            await asyncio.wait_for(running.done.wait(), timeout_seconds)
        except TimeoutError:
            raise DuplicateRequest(
                f"request {request_id!r} still runs on this worker and did not pause in "
                f"{timeout_seconds:g} s"
            ) from None
        committer = self._ctx.committer
        if committer is not None:
            await committer.settled(request_id, timeout_seconds)

    async def abort_quietly(self, request_id: str) -> None:
        """Stops a request whose caller vanished (vLLM may have stopped it already)."""
        try:
            await self._ctx.llm.abort(request_id)
        except Exception as exc:  # the engine may be shutting down: nothing left to stop
            log.debug("abort of %s after its caller left: %s", request_id, exc)

    async def abort(self, request_id: str) -> None:
        running = self.running.get(request_id)
        if running is None:
            raise RequestNotFound(request_id)
        running.aborted = True
        await self._ctx.llm.abort(request_id)


def _with_engine_timing(chunk: TokenChunk, output: Any) -> TokenChunk:
    """``chunk`` with vLLM's own queued / scheduled timestamps of the request (its
    `RequestStateStats`, present while the engine logs stats), when it has them."""
    stats = getattr(output, "metrics", None)
    scheduled = float(getattr(stats, "scheduled_ts", 0.0) or 0.0)
    if not scheduled:
        return chunk
    queued = float(getattr(stats, "queued_ts", 0.0) or 0.0) or scheduled
    return dataclasses.replace(chunk, engine_timing=EngineTiming(queued, scheduled))


def _token_logprobs(
    token_ids: Sequence[int], positions: Sequence[Any] | None, top_k: int
) -> tuple[TokenLogprobs, ...]:
    """vLLM's logprobs of one step's tokens (per position, the sampled token's `Logprob` and
    the k best ones' by token id, ranked from 1) as one `TokenLogprobs` per token."""
    if positions is None or len(positions) != len(token_ids):
        return ()
    logprobs = []
    for token_id, position in zip(token_ids, positions, strict=True):
        ranked = sorted(
            (entry.rank, candidate, entry.logprob)
            for candidate, entry in position.items()
            if entry.rank is not None and entry.rank <= top_k
        )
        logprobs.append(
            TokenLogprobs(
                logprob=float(position[token_id].logprob),
                top=tuple(TopLogprob(int(t), float(lp)) for _, t, lp in ranked[:top_k]),
            )
        )
    return tuple(logprobs)


def sla_class_named(name: str) -> SlaClass:
    """A record's class name back to the class (an unknown name: INTERACTIVE)."""
    return SlaClass.__members__.get(name, SlaClass.INTERACTIVE)
