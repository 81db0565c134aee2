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
report each one once its state is complete in the store.

`Engine` is the facade the gRPC edge talks to; each role is a part of its own, all sharing
one `EngineContext`::

    engine_builder.py  EngineBuilder    the engine's arguments, memory plan, connector, shape
    streams.py         RequestStreams   admission, one stream per request, abort
    resumption.py      Resumption       resume from the store; prefetch and warm-up
    preemption.py      Preemption       drain; preempt: pause, then report each flush
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from common.requests import (
    GenerationRequest,
    TokenChunk,
)
from common.validation import Limits
from store import RedisStore, RequestStore
from worker.config import WorkerConfig
from worker.constants import (
    PERSIST_RETRY_SECONDS,
    STAGING_STALE_SECONDS,
)
from worker.daemon_store import DaemonCommitStore
from worker.engine_builder import EngineBuilder, EngineShape
from worker.engine_context import EngineContext
from worker.engine_stats import EngineSnapshot, EngineStats
from worker.errors import EngineNotReady
from worker.flush_state import FlushState
from worker.kv_staging import StagingArea, default_staging_root
from worker.metrics import WorkerMetrics
from worker.preemption import Preemption
from worker.prefetch import PrefetchOutcome
from worker.resumption import Resumption
from worker.streams import RequestStreams
from worker.token_committer import TokenCommitter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    ready: bool
    draining: bool
    engine: EngineSnapshot
    shape: EngineShape | None
    requests_total: int
    degraded: bool  # persistence is configured but Redis does not answer
    stopping_deadline_unix: float = 0.0  # > 0: being stopped; its requests move by then


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
        self._metrics = metrics
        self._stats = EngineStats(observer=metrics)
        self._start_error: BaseException | None = None
        staging: StagingArea | None = None
        if store is not None and config.staging_mib:
            root = Path(config.staging_dir) if config.staging_dir else None
            staging = StagingArea(
                root or default_staging_root(config.worker_id),
                config.staging_mib * 2**20,
                STAGING_STALE_SECONDS,
            )
        self._ctx = EngineContext(config, store, staging, stats=self._stats)
        self._builder = EngineBuilder(config, self._stats, store is not None, staging)
        self._streams = RequestStreams(self._ctx)
        self._resumption = Resumption(self._ctx, self._streams)
        self._preemption = Preemption(self._ctx, self._streams)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint, once started (see model_fingerprint.py)."""
        return self._ctx.fingerprint

    async def start(self) -> None:
        """Loads the model; blocking parts run in a thread so health checks still answer."""
        ctx = self._ctx
        try:
            ctx.llm, ctx.fingerprint = await asyncio.to_thread(self._builder.build)
        except BaseException as exc:
            self._start_error = exc
            raise
        await self._continue_seeds()
        shape = ctx.shape = self._builder.read_shape(ctx.llm)
        ctx.limits = Limits(
            max_model_len=shape.max_model_len,
            max_tokens_limit=min(self.config.effective_max_tokens_limit, shape.max_model_len),
            vocab_size=shape.vocab_size,
        )
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_num_seqs %d",
            shape.model,
            shape.kv_blocks_total,
            shape.kv_block_tokens,
            shape.max_num_seqs,
        )
        if ctx.store is not None:
            commit_store: RequestStore = ctx.store
            if self.config.kv_handoff_socket:
                commit_store = DaemonCommitStore(self.config.kv_handoff_socket, ctx.store)
            ctx.committer = TokenCommitter(
                commit_store,
                self.config.worker_id,
                PERSIST_RETRY_SECONDS,
                on_commit=self._metrics.observe_commit if self._metrics is not None else None,
            )
            ctx.committer.start()

    async def _continue_seeds(self) -> None:
        """Every rank's model runner advances a resumed seeded request's generator past the
        draws its earlier tokens took (worker/seed_continuation.py)."""
        try:
            answers = await self._ctx.llm.collective_rpc("spot_continue_seeds")
        except Exception as exc:  # another vLLM (--allow-other-vllm) may lack the hook
            log.warning("seeded requests restart their random sequence on a resume: %s", exc)
            return
        if not all(answers):
            log.warning("seeded requests restart their random sequence on a resume")

    def planned_kv_and_seqs(self) -> tuple[int, int]:
        """KV bytes and max_num_seqs: explicit values, or the memory planner's when
        `memory_gib` is set (max_num_seqs is then capped so peak concurrency fits)."""
        return self._builder.planned_kv_and_seqs()

    @property
    def ready(self) -> bool:
        return self._ctx.shape is not None and not self._streams.draining

    @property
    def shape(self) -> EngineShape:
        return self._ctx.require_shape()

    @property
    def limits(self) -> Limits:
        return self._ctx.require_limits()

    async def close_persistence(self, timeout_seconds: float) -> None:
        """Send what the committer still holds (bounded by ``timeout_seconds``)."""
        if self._ctx.committer is not None:
            await self._ctx.committer.close(timeout_seconds)

    def shutdown(self) -> None:
        if self._ctx.llm is not None:
            self._ctx.llm.shutdown()
            self._ctx.llm = None
        if self._ctx.staging is not None:
            self._ctx.staging.close()

    # -- requests ----------------------------------------------------------------------

    def tokenize(self, text: str) -> tuple[int, ...]:
        if self._ctx.llm is None:
            raise EngineNotReady("the engine is still loading the model")
        return tuple(self._ctx.llm.tokenizer.encode(text))

    def validate(self, request: GenerationRequest) -> None:
        """Raises InvalidRequest with a readable message; see `common.validation`."""
        self._streams.validate(request)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenChunk, None]:
        """Streams the output. The caller going away stops the request in vLLM; with a store
        it stays paused and resumable (Worker.Resume), as after a notice."""
        return self._streams.generate(request)

    def resume(
        self,
        request_id: str,
        from_index: int,
        delivered: tuple[int, ...] = (),
        request: GenerationRequest | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Continues a request from the store, streaming every token from ``from_index`` on,
        from prompt + ``delivered`` when the caller knows what its client has (see
        `Resumption.resume`; ``request``: the request itself, for a store that cannot be
        reached). Raises RecordNotFound, CannotResume or InvalidRequest."""
        return self._resumption.resume(request_id, from_index, delivered, request)

    async def abort(self, request_id: str) -> None:
        await self._streams.abort(request_id)

    async def prefetch(self, request_id: str) -> PrefetchOutcome:
        """A migration stage on this worker as its target: stage the request's persisted full
        blocks (see prefetch.py). Raises CannotResume, RecordNotFound, WorkerDraining,
        StagingFull or StoreUnavailable."""
        return await self._resumption.prefetch(request_id)

    def drop_prefetch(self, request_id: str) -> int:
        """Frees what was staged for ``request_id`` (an aborted handshake)."""
        return self._resumption.drop_prefetch(request_id)

    async def drain(self, grace_seconds: float) -> int:
        """Stops admitting; waits up to `grace_seconds` for in-flight requests, then aborts
        the rest (their streams end CANCELLED). Returns how many had to be aborted."""
        return await self._preemption.drain(grace_seconds)

    async def stop(self, grace_seconds: float) -> tuple[int, int]:
        """SIGTERM: with a store, the in-flight requests move as on a notice; without one,
        a drain. Returns (moved, cut); see `Preemption.stop`."""
        return await self._preemption.stop(grace_seconds)

    def preempt(self, deadline_unix: float) -> AsyncIterator[FlushState]:
        """A termination notice: stop admitting, pause every in-flight request and persist it.
        Yields one FlushState per paused request (see `Preemption.preempt`)."""
        return self._preemption.preempt(deadline_unix)

    @property
    def draining(self) -> bool:
        return self._streams.draining

    @property
    def in_flight(self) -> int:
        return len(self._streams.running)

    def status(self) -> WorkerStatus:
        committer = self._ctx.committer
        return WorkerStatus(
            worker_id=self.config.worker_id,
            ready=self.ready,
            draining=self._streams.draining,
            engine=self._stats.snapshot(),
            shape=self._ctx.shape,
            requests_total=self._streams.requests_total,
            degraded=committer is not None and committer.degraded,
            stopping_deadline_unix=self._preemption.stopping_deadline_unix,
        )
