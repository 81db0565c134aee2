"""One vLLM engine (`AsyncLLM`) behind the worker: admission, token streams, abort, drain.

vLLM does the continuous batching; this class adds what a cluster needs around it: our own
request ids, validation against the engine's real limits, output indices, a draining state,
and the numbers the coordinator routes by.

    gRPC Generate ──▶ Engine.generate ──▶ AsyncLLM.generate (DELTA outputs, one per step)
                              │                    │
                              ◀── TokenChunk(index, token_ids, text, finish_reason)
                              └──▶ TokenCommitter (Redis, off the stream's path)

With a store, every request carries our id to the spot KV connector (which persists its KV
blocks) and its tokens go to the committer; `resume` continues a request another worker
started, from the store. `preempt` is the termination notice: stop admitting, pause every
request at an iteration boundary (a vLLM abort at the end of the step in flight, whose
token still reaches the stream; the abort makes the connector flush the request), and
report each one once its state is complete in the store::

    preempt(deadline) ─▶ draining ─▶ abort all (paused) ─▶ streams end with a NOTICE event
                                          │                 committer: tokens, then PAUSED
                                          ▼
                          connector: tokens, unsaved full blocks, tail ─▶ Redis
    poll the store (headers only) ─▶ FlushState per request as it completes; the rest at
    the deadline, not complete
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from context_daemon.store import RedisStore, RequestRecord, RequestStatus, StoreUnavailable
from spotinfer.requests import (
    Event,
    EventKind,
    FinishReason,
    GenerationRequest,
    Sampling,
    TokenChunk,
)
from spotinfer.validation import Limits, check_prompt_tokens, check_sampling
from worker.boundary_abort import abort_at_step_boundary
from worker.config import WorkerConfig, engine_environment
from worker.constants import (
    DEFAULT_PREEMPT_GRACE_SECONDS,
    FLUSH_POLL_SECONDS,
    KV_PARAM_FIRST_INDEX,
    KV_PARAM_REQUEST_ID,
    KV_PARAM_RESUME,
    KV_PARAM_WARM,
    PAUSED_DETAIL,
    PERSIST_RETRY_SECONDS,
    STAGING_STALE_SECONDS,
    STREAM_END_WAIT_SECONDS,
    WARM_REQUEST_SUFFIX,
    WARM_TIMEOUT_SECONDS,
)
from worker.engine_stats import EngineSnapshot, EngineStats
from worker.errors import (
    CannotResume,
    DuplicateRequest,
    EngineNotReady,
    RequestNotFound,
    WorkerDraining,
)
from worker.flush_state import FlushState, read_flush_states
from worker.kv_staging import StagingArea, default_staging_root
from worker.metrics import WorkerMetrics
from worker.model_fingerprint import model_fingerprint
from worker.prefetch import PrefetchOutcome, prefetch_stage
from worker.resume_point import ResumePoint, read_resume_point, sampling_to_record
from worker.token_committer import TokenCommitter

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


@dataclass(frozen=True)
class EngineShape:
    """What the loaded engine really got (after vLLM sized it)."""

    model: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    kv_blocks_total: int
    kv_block_tokens: int
    kv_cache_bytes: int


@dataclass
class _Running:
    """One in-flight request as this worker streams it (owned by the event loop)."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    streamed_tokens: int = 0  # output tokens in the store's indexing (resumes start at n)
    paused: bool = False  # set by preempt: its abort is a pause, not a cancel


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    ready: bool
    draining: bool
    engine: EngineSnapshot
    shape: EngineShape | None
    requests_total: int
    degraded: bool  # persistence is configured but Redis does not answer


class Engine:
    """Owns one `AsyncLLM`. Not thread-safe: call from the event loop that serves gRPC.

    ``store``: where tokens and KV blocks persist (None: nowhere, and no resume).
    ``metrics``: fed every engine step and every token commit (None: no metrics).
    """

    def __init__(
        self,
        config: WorkerConfig,
        store: RedisStore | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config
        self._store = store
        self._metrics = metrics
        self._committer: TokenCommitter | None = None
        self._fingerprint = ""
        self._llm: Any = None
        self._shape: EngineShape | None = None
        self._limits: Limits | None = None
        self._stats = EngineStats(observer=metrics)
        self._draining = False
        self._in_flight: dict[str, _Running] = {}
        self._requests_total = 0
        self._start_error: BaseException | None = None
        self._staging: StagingArea | None = None
        if store is not None and config.staging_mib:
            root = Path(config.staging_dir) if config.staging_dir else None
            self._staging = StagingArea(
                root or default_staging_root(config.worker_id),
                config.staging_mib * 2**20,
                STAGING_STALE_SECONDS,
            )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Loads the model; blocking parts run in a thread so health checks still answer."""
        try:
            self._llm = await asyncio.to_thread(self._build)
        except BaseException as exc:
            self._start_error = exc
            raise
        self._shape = self._read_shape()
        self._limits = Limits(
            max_model_len=self._shape.max_model_len,
            max_tokens_limit=min(self.config.effective_max_tokens_limit, self._shape.max_model_len),
            vocab_size=self._shape.vocab_size,
        )
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_num_seqs %d",
            self._shape.model,
            self._shape.kv_blocks_total,
            self._shape.kv_block_tokens,
            self._shape.max_num_seqs,
        )
        if self._store is not None:
            self._committer = TokenCommitter(
                self._store,
                self.config.worker_id,
                PERSIST_RETRY_SECONDS,
                on_commit=self._metrics.observe_commit if self._metrics is not None else None,
            )
            self._committer.start()

    def _build(self) -> Any:
        for key, value in engine_environment().items():
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._fingerprint = model_fingerprint(self.config.model, self.config.dtype)
        kv_cache_bytes, max_num_seqs = self.planned_kv_and_seqs()
        if kv_cache_bytes:
            # vLLM-CPU's legacy variable would override an explicit size.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=self.config.dtype,  # type: ignore[arg-type]  # checked in WorkerConfig
            max_model_len=self.config.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens or None,
            kv_cache_memory_bytes=kv_cache_bytes or None,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            tensor_parallel_size=self.config.tensor_parallel_size,
            enforce_eager=self.config.enforce_eager,
            # A migration target warms the staged blocks into vLLM's prefix cache (see
            # prefetch); each request's own salt keeps others from sharing them unless
            # cross-request prefix caching is asked for.
            enable_prefix_caching=self.config.enable_prefix_caching or self._staging is not None,
            seed=self.config.seed,
            disable_log_stats=False,
            # The real batch of each step (prefills + decodes) for the batch-size histogram.
            enable_logging_iteration_details=True,
            kv_transfer_config=self._kv_transfer_config(),
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.logger_factory()])

    def _kv_transfer_config(self) -> Any:
        """The spot connector, when there is a store to persist to."""
        if self._store is None:
            return None
        from vllm.config import KVTransferConfig

        from worker.spot_connector import connector_config

        staging_dir = str(self._staging.root) if self._staging is not None else ""
        return KVTransferConfig(
            **connector_config(
                self.config.store,
                self._fingerprint,
                self.config.kv_persist_policy,
                staging_dir,
            )
        )

    def planned_kv_and_seqs(self) -> tuple[int, int]:
        """KV bytes and max_num_seqs: explicit values, or the memory planner's when
        `memory_gib` is set (max_num_seqs is then capped so peak concurrency fits)."""
        kv_cache_bytes = self.config.kv_cache_bytes
        max_num_seqs = self.config.max_num_seqs
        if self.config.memory_gib and not kv_cache_bytes:
            from worker.memory_planner import plan_for_worker

            kv_cache_bytes, fitting_seqs = plan_for_worker(
                self.config.model,
                int(self.config.memory_gib * 2**30),
                self.config.max_model_len,
                dtype=self.config.dtype,  # type: ignore[arg-type]  # checked in WorkerConfig
                tensor_parallel_size=self.config.tensor_parallel_size,
                block_tokens=_platform_block_tokens(),
            )
            max_num_seqs = min(max_num_seqs, fitting_seqs)
        return kv_cache_bytes, max_num_seqs

    def _read_shape(self) -> EngineShape:
        vllm_config = self._llm.vllm_config
        cache = vllm_config.cache_config
        blocks = int(cache.num_gpu_blocks or 0)
        return EngineShape(
            model=self.config.model,
            max_model_len=int(vllm_config.model_config.max_model_len),
            max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
            vocab_size=int(vllm_config.model_config.get_vocab_size()),
            kv_blocks_total=blocks,
            kv_block_tokens=int(cache.block_size),
            kv_cache_bytes=int(cache.kv_cache_memory_bytes or 0),
        )

    @property
    def ready(self) -> bool:
        return self._shape is not None and not self._draining

    @property
    def shape(self) -> EngineShape:
        if self._shape is None:
            raise EngineNotReady("the engine is still loading the model")
        return self._shape

    @property
    def limits(self) -> Limits:
        if self._limits is None:
            raise EngineNotReady("the engine is still loading the model")
        return self._limits

    async def close_persistence(self, timeout_seconds: float) -> None:
        """Send what the committer still holds (bounded by ``timeout_seconds``)."""
        if self._committer is not None:
            await self._committer.close(timeout_seconds)

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._staging is not None:
            self._staging.close()

    # -- requests ----------------------------------------------------------------------

    def tokenize(self, text: str) -> tuple[int, ...]:
        if self._llm is None:
            raise EngineNotReady("the engine is still loading the model")
        return tuple(self._llm.tokenizer.encode(text))

    def validate(self, request: GenerationRequest) -> None:
        """Raises InvalidRequest with a readable message; see `spotinfer.validation`."""
        check_prompt_tokens(request.prompt_token_ids, self.limits)
        check_sampling(request.sampling, len(request.prompt_token_ids), self.limits)
        if request.sampling.top_k > self.limits.vocab_size:
            from worker.errors import InvalidRequest

            raise InvalidRequest(
                f"top_k {request.sampling.top_k} is over the vocabulary size "
                f"{self.limits.vocab_size}"
            )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        """Streams the output. The caller going away stops the request in vLLM; with a store
        it stays paused and resumable (Worker.Resume), as after a notice."""
        self._check_admission(request.request_id)
        self.validate(request)
        kv_params: dict[str, Any] = {}
        if self._committer is not None:
            kv_params = {KV_PARAM_REQUEST_ID: request.request_id}
            self._committer.admit(
                RequestRecord(
                    request_id=request.request_id,
                    model_fingerprint=self._fingerprint,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=sampling_to_record(request.sampling),
                    kv_block_tokens=self.shape.kv_block_tokens,
                    status=RequestStatus.RUNNING,
                    owner_worker_id=self.config.worker_id,
                )
            )
        async with contextlib.aclosing(self._stream(request, 0, kv_params)) as steps:
            async for chunk, _ in steps:
                yield chunk

    async def resume(self, request_id: str, from_index: int) -> AsyncGenerator[TokenChunk, None]:
        """Continues a request from the store, streaming every token from ``from_index`` on:
        first the committed ones the client lacks (at once, from the store), then, once the
        engine has taken the request, a MIGRATED or RECOVERED event (how many prefill tokens
        were loaded and how many recomputed) and the new tokens, indices continuing. Raises
        RecordNotFound or CannotResume."""
        self._check_admission(request_id)
        if self._store is None or self._committer is None:
            raise CannotResume("this worker runs without a store (--redis-url); it cannot resume")
        point = await asyncio.to_thread(
            read_resume_point, self._store, request_id, self._fingerprint
        )
        sampling = dataclasses.replace(point.sampling, max_tokens=point.remaining_tokens)
        request = GenerationRequest(request_id, point.engine_prompt, sampling)
        if point.remaining_tokens == 0:
            # The old worker produced every token but died before it could say so.
            self._committer.admit(point.record, point.committed_token_ids)
            self._committer.finish(request_id, RequestStatus.FINISHED)
            yield self._recovered_chunk(point, from_index, len(point.engine_prompt), 0)
            yield TokenChunk(
                request_id,
                min(from_index, point.next_index),
                token_ids=point.committed_token_ids[from_index:],
                finish_reason=FinishReason.LENGTH,
                worker_id=self.config.worker_id,
            )
            return
        self.validate(request)
        self._committer.admit(point.record, point.committed_token_ids)
        staged = self._staging.blocks_of(request_id) if self._staging is not None else 0
        kv_params = {
            KV_PARAM_REQUEST_ID: request_id,
            KV_PARAM_RESUME: True,
            KV_PARAM_FIRST_INDEX: point.next_index,
        }
        if from_index < point.next_index:
            # Committed, but the client never saw them: the pause dropped the token of the
            # step in flight (vLLM takes an abort before that step's output), the client's
            # stream lagged, or the old worker died between the commit and the send. They
            # need no engine, so they go out now, a step before the first new token. Text
            # is left out (the coordinator decodes them).
            yield TokenChunk(
                request_id,
                from_index,
                token_ids=point.committed_token_ids[from_index:],
                worker_id=self.config.worker_id,
            )
        event_index = max(from_index, point.next_index)
        first = True
        async with contextlib.aclosing(self._stream(request, point.next_index, kv_params)) as steps:
            async for chunk, cached_tokens in steps:
                if first:
                    first = False
                    if self._staging is not None:  # loaded by now: the copies can go
                        self._staging.drop(request_id)
                    yield self._recovered_chunk(
                        point, event_index, len(point.engine_prompt), cached_tokens or 0, staged
                    )
                trimmed = _from_index(chunk, from_index)
                if trimmed is not None:
                    yield trimmed

    def _recovered_chunk(
        self,
        point: ResumePoint,
        index: int,
        prompt_tokens: int,
        cached_tokens: int,
        staged_blocks: int = 0,
    ) -> TokenChunk:
        # vLLM computes the last prompt token in any case (its output is the next token);
        # everything else it did not load counts as recomputed, unless nothing is computed
        # (every token was committed) or no worker had computed any of it (it was paused
        # while still queued: this prefill is its first).
        recomputed = max(0, prompt_tokens - cached_tokens - 1) if prompt_tokens else 0
        if point.never_computed or not point.remaining_tokens:
            recomputed = 0
        # A request paused on a notice migrated; any other was recovered after a loss.
        kind = (
            EventKind.MIGRATED
            if point.record.status is RequestStatus.PAUSED
            else EventKind.RECOVERED
        )
        detail = (
            f"resumed at index {point.next_index}: {cached_tokens} of {prompt_tokens} "
            f"context tokens loaded, {recomputed} recomputed"
        )
        if staged_blocks:
            detail += f"; {staged_blocks} blocks prefetched before the pause"

        log.info("request %s %s", point.record.request_id, detail)
        return TokenChunk(
            request_id=point.record.request_id,
            index=index,
            event=Event(
                kind=kind,
                from_worker=point.record.owner_worker_id,
                to_worker=self.config.worker_id,
                recomputed_tokens=recomputed,
                loaded_tokens=cached_tokens,
                detail=detail,
            ),
            worker_id=self.config.worker_id,
        )

    def _check_admission(self, request_id: str) -> None:
        if self._draining:
            raise WorkerDraining("the worker is draining and admits no new requests")
        if self._llm is None:
            raise EngineNotReady("the engine is still loading the model")
        if request_id in self._in_flight:
            raise DuplicateRequest(f"request {request_id!r} is already running on this worker")

    async def _stream(
        self, request: GenerationRequest, start_index: int, kv_params: dict[str, Any]
    ) -> AsyncGenerator[tuple[TokenChunk, int | None], None]:
        """Runs one request in vLLM; yields each step's chunk (indices from ``start_index``)
        with vLLM's count of prompt tokens it did not compute (prefix cache or connector)."""
        request_id = request.request_id
        if request_id in self._in_flight:
            raise DuplicateRequest(f"request {request_id!r} is already running on this worker")
        running = _Running(streamed_tokens=start_index)
        self._in_flight[request_id] = running
        self._requests_total += 1
        index = start_index
        finish = FinishReason.CANCELLED  # unless vLLM says otherwise
        try:
            outputs = self._llm.generate(
                self._prompt(request_id, request.prompt_token_ids),
                self._sampling_params(request, kv_params),
                request_id=request_id,
            )
            async for output in outputs:
                completion = output.outputs[0]
                chunk_finish = _FINISH_REASONS.get(
                    completion.finish_reason or "", FinishReason.NONE
                )
                if output.finished and chunk_finish == FinishReason.NONE:
                    chunk_finish = FinishReason.STOP
                paused_here = chunk_finish == FinishReason.CANCELLED and running.paused
                if paused_here:
                    # A pause is not an end: its last tokens go out, the NOTICE follows.
                    chunk_finish = FinishReason.NONE
                    finish = FinishReason.CANCELLED
                chunk = TokenChunk(
                    request_id=request_id,
                    index=index,
                    token_ids=tuple(completion.token_ids),
                    text=completion.text,
                    finish_reason=chunk_finish,
                    worker_id=self.config.worker_id,
                )
                index += len(chunk.token_ids)
                running.streamed_tokens = index
                if self._committer is not None:
                    self._committer.add(request_id, chunk.token_ids)
                if chunk.finished:
                    finish = chunk_finish
                if chunk.token_ids or not paused_here:
                    yield chunk, output.num_cached_tokens
                if chunk.finished or paused_here:
                    break
            if finish == FinishReason.CANCELLED and running.paused:
                # Not an end: the client's relay resumes it on another worker.
                yield self._paused_chunk(request_id, index), None
            elif finish == FinishReason.CANCELLED:
                # vLLM ends an aborted request's stream without a final output.
                yield (
                    TokenChunk(
                        request_id=request_id,
                        index=index,
                        finish_reason=FinishReason.CANCELLED,
                        worker_id=self.config.worker_id,
                    ),
                    None,
                )
        except (asyncio.CancelledError, GeneratorExit):
            if self._committer is not None and finish == FinishReason.CANCELLED:
                # The caller went away (its coordinator died or restarts), not the client,
                # who cancels with Abort: with a store the request stays resumable — paused
                # and persisted as on a notice — so a coordinator can resume it on Attach.
                running.paused = True
                asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
            raise
        finally:
            if self._committer is not None:
                if running.paused and finish == FinishReason.CANCELLED:
                    self._committer.pause(request_id)
                else:
                    self._committer.finish(request_id, _STORE_STATUS[finish])
            del self._in_flight[request_id]
            running.done.set()

    def _prompt(self, request_id: str, token_ids: Sequence[int]) -> dict[str, Any]:
        """vLLM's prompt. Unless prefix caching across requests is on, the request's id salts
        its block hashes: only the request itself (a warm-up before its resume) hits them."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if not self.config.enable_prefix_caching:
            prompt["cache_salt"] = request_id
        return prompt

    def _paused_chunk(self, request_id: str, index: int) -> TokenChunk:
        return TokenChunk(
            request_id=request_id,
            index=index,
            event=Event(
                kind=EventKind.NOTICE, from_worker=self.config.worker_id, detail=PAUSED_DETAIL
            ),
            worker_id=self.config.worker_id,
        )

    def _sampling_params(self, request: GenerationRequest, kv_params: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = request.sampling
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            # vLLM suffixes its request ids; the connector finds ours here.
            extra_args={"kv_transfer_params": kv_params} if kv_params else None,
        )

    async def _abort_quietly(self, request_id: str) -> None:
        """Stops a request whose caller vanished (vLLM may have stopped it already)."""
        try:
            await self._llm.abort(request_id)
        except Exception as exc:  # the engine may be shutting down: nothing left to stop
            log.debug("abort of %s after its caller left: %s", request_id, exc)

    async def abort(self, request_id: str) -> None:
        if request_id not in self._in_flight:
            raise RequestNotFound(request_id)
        await self._llm.abort(request_id)

    async def prefetch(self, request_id: str) -> PrefetchOutcome:
        """A migration stage on this worker as its target: stage the request's persisted full
        blocks (see prefetch.py). Raises CannotResume, RecordNotFound, WorkerDraining,
        StagingFull or StoreUnavailable."""
        if self._store is None or self._staging is None:
            raise CannotResume(
                "this worker has no store or no staging memory (--redis-url, --staging-mib)"
            )
        if self._draining:
            raise WorkerDraining("the worker is draining and takes no migrations")
        if self._llm is None:
            raise EngineNotReady("the engine is still loading the model")
        outcome = await asyncio.to_thread(
            prefetch_stage,
            self._store,
            self._staging,
            request_id,
            self._fingerprint,
            self.shape.kv_block_tokens,
        )
        if outcome.new_blocks:
            await self._warm(request_id, outcome.staged_prefix)
        return outcome

    async def _warm(self, request_id: str, staged_prefix: tuple[int, ...]) -> None:
        """Loads the staged blocks into vLLM's cache ahead of the resume: a one-token request
        over the staged tokens (plus the next one, which vLLM computes itself) whose prefill
        the connector serves from staging. Once it ends, vLLM keeps the blocks in its prefix
        cache, so the resume after the pause finds them there and loads only the rest.
        Best effort: if the blocks are evicted first, or the warm-up fails, the resume loads
        them from staging as before."""
        if not staged_prefix:
            return
        warm_id = request_id + WARM_REQUEST_SUFFIX
        warm = GenerationRequest(
            warm_id, staged_prefix, Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
        )
        # vLLM needs one prompt token to compute: the first of the next block will do, as
        # any token would (its KV is not kept); the block hashes only cover full blocks.
        prompt = (*staged_prefix, staged_prefix[-1])
        params = self._sampling_params(
            warm, {KV_PARAM_REQUEST_ID: request_id, KV_PARAM_RESUME: True, KV_PARAM_WARM: True}
        )

        async def run() -> None:
            async for _ in self._llm.generate(
                self._prompt(request_id, prompt), params, request_id=warm_id
            ):
                pass

        try:
            await asyncio.wait_for(run(), WARM_TIMEOUT_SECONDS)
        except Exception as exc:  # the resume loads the staged blocks itself
            log.warning("warm-up of %s's staged blocks failed: %r", request_id, exc)
            await self._abort_quietly(warm_id)

    def drop_prefetch(self, request_id: str) -> int:
        """Frees what was staged for ``request_id`` (an aborted handshake)."""
        return self._staging.drop(request_id) if self._staging is not None else 0

    async def drain(self, grace_seconds: float) -> int:
        """Stops admitting; waits up to `grace_seconds` for in-flight requests, then aborts
        the rest (their streams end CANCELLED). Returns how many had to be aborted."""
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        remaining = list(self._in_flight)
        for request_id in remaining:
            await self._llm.abort(request_id)
        for request_id in remaining:
            running = self._in_flight.get(request_id)
            if running is not None:
                await running.done.wait()
        return len(remaining)

    async def preempt(self, deadline_unix: float) -> AsyncIterator[FlushState]:
        """A termination notice: stop admitting, pause every in-flight request and persist it
        (see the module docstring). Yields one FlushState per paused request: as soon as it
        is complete in the store, or, for those still incomplete at ``deadline_unix`` (0: the
        default grace from now), at the deadline with ``complete`` False. An idle worker
        yields nothing."""
        self._draining = True
        if not deadline_unix:
            deadline_unix = time.time() + DEFAULT_PREEMPT_GRACE_SECONDS
        paused = dict(self._in_flight)
        if not paused:
            return
        for running in paused.values():
            running.paused = True
        log.warning(
            "termination notice: pausing %d request(s), %.1f s to the deadline",
            len(paused),
            deadline_unix - time.time(),
        )
        # One abort: vLLM finishes them all in one scheduler pass, so the connector orders all
        # of their writes together. It waits for the end of the step in flight, whose tokens
        # reach the streams; the plain abort after it ends the streams.
        await abort_at_step_boundary(self._llm, list(paused))
        await self._llm.abort(list(paused))
        await asyncio.wait(
            [asyncio.ensure_future(running.done.wait()) for running in paused.values()],
            timeout=STREAM_END_WAIT_SECONDS,
        )
        if self._store is None:  # nowhere to flush to: nothing can be complete
            for request_id in paused:
                yield FlushState(request_id, 0, 0, 0, False, False)
            return
        async for state in self._await_flushed(paused, deadline_unix):
            yield state

    async def _await_flushed(
        self, paused: dict[str, _Running], deadline_unix: float
    ) -> AsyncIterator[FlushState]:
        pending = dict(paused)
        while pending:
            states = await asyncio.to_thread(self._read_flush_states, pending)
            if time.time() > deadline_unix:
                for state in states:  # too late: whatever landed, it did not land in time
                    yield dataclasses.replace(state, complete=False)
                return
            for state in states:
                if state.complete:
                    del pending[state.request_id]
                    yield state
            if pending:
                await asyncio.sleep(FLUSH_POLL_SECONDS)

    def _read_flush_states(self, pending: dict[str, _Running]) -> list[FlushState]:
        assert self._store is not None, "preempt reads states only with a store"
        try:
            return read_flush_states(
                self._store,
                {request_id: running.streamed_tokens for request_id, running in pending.items()},
                self._fingerprint,
                self.shape.kv_block_tokens,
                with_kv=self.config.kv_persist_policy != "off",
            )
        except StoreUnavailable:
            return [FlushState(request_id, 0, 0, 0, False, False) for request_id in pending]

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            worker_id=self.config.worker_id,
            ready=self.ready,
            draining=self._draining,
            engine=self._stats.snapshot(),
            shape=self._shape,
            requests_total=self._requests_total,
            degraded=self._committer is not None and self._committer.degraded,
        )


def _platform_block_tokens() -> int:
    """vLLM's KV block size: 128 tokens on CPU, 16 on GPU."""
    from vllm.platforms import current_platform

    return 128 if current_platform.is_cpu() else 16


def _from_index(chunk: TokenChunk, from_index: int) -> TokenChunk | None:
    """The part of ``chunk`` at or after ``from_index`` (the client already has the rest).

    A chunk cut in two loses its text: the text of the kept tokens alone is not known here.
    """
    end = chunk.index + len(chunk.token_ids)
    if chunk.index >= from_index:
        return chunk
    if end <= from_index and not chunk.finished:
        return None
    keep = chunk.token_ids[max(0, from_index - chunk.index) :]
    return dataclasses.replace(
        chunk, index=max(chunk.index, min(from_index, end)), token_ids=keep, text=""
    )
