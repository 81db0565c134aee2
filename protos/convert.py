"""Conversions between `spotinfer.v1` messages and the dataclasses of `common` (the only
place they are written).

Only the edges of each process (its `server.py`, and the clients of other processes) call
these: inside, code never sees a proto message.
"""

from __future__ import annotations

from common.messages import (
    ClassCapView,
    FlushReport,
    KvPersistence,
    NoticeEvent,
    PoolLabels,
    PrefetchResult,
    Registration,
    WorkerCapacity,
)
from common.requests import (
    EngineTiming,
    Event,
    EventKind,
    FinishReason,
    GenerationRequest,
    Sampling,
    SlaClass,
    TokenChunk,
    TokenLogprobs,
    TopLogprob,
)
from protos.spotinfer.v1 import common_pb2, control_pb2, daemon_pb2, worker_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> Sampling:
    """Proto3 cannot tell an unset float from 0: a top_p of 0 on the wire means 1."""
    return Sampling(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def sampling_to_proto(sampling: Sampling) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )
    if sampling.seed is not None:
        msg.seed = sampling.seed
    if sampling.logprobs is not None:
        msg.logprobs = sampling.logprobs
    return msg


def sla_from_proto(value: int) -> SlaClass:
    return SlaClass.BATCH if value == common_pb2.SLA_CLASS_BATCH else SlaClass.INTERACTIVE


def sla_to_proto(sla: SlaClass) -> common_pb2.SlaClass.ValueType:
    return common_pb2.SLA_CLASS_BATCH if sla == SlaClass.BATCH else common_pb2.SLA_CLASS_INTERACTIVE


def request_to_proto(request: GenerationRequest) -> common_pb2.GenerateRequest:
    """A request whose prompt is token ids (text prompts are tokenized at the edge)."""
    msg = common_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_proto(request.sampling),
        sla_class=sla_to_proto(request.sla_class),
        tenant=request.tenant,
    )
    if request.priority is not None:
        msg.priority = request.priority
    return msg


def priority_from_proto(msg: common_pb2.GenerateRequest) -> int | None:
    """The request's own priority, None when it names none (checked by the receiver)."""
    return msg.priority if msg.HasField("priority") else None


def event_to_proto(event: Event) -> common_pb2.Event:
    return common_pb2.Event(
        kind=int(event.kind),  # type: ignore[arg-type]
        from_worker=event.from_worker,
        to_worker=event.to_worker,
        recomputed_tokens=event.recomputed_tokens,
        loaded_tokens=event.loaded_tokens,
        detail=event.detail,
    )


def event_from_proto(msg: common_pb2.Event) -> Event:
    return Event(
        kind=EventKind(msg.kind),
        from_worker=msg.from_worker,
        to_worker=msg.to_worker,
        recomputed_tokens=msg.recomputed_tokens,
        loaded_tokens=msg.loaded_tokens,
        detail=msg.detail,
    )


def chunk_to_proto(chunk: TokenChunk) -> common_pb2.GenerateResponse:
    msg = common_pb2.GenerateResponse(
        request_id=chunk.request_id,
        index=chunk.index,
        token_ids=list(chunk.token_ids),
        text=chunk.text,
        finish_reason=int(chunk.finish_reason),  # type: ignore[arg-type]
        worker_id=chunk.worker_id,
        logprobs=[logprobs_to_proto(position) for position in chunk.logprobs],
    )
    if chunk.event is not None:
        msg.event.CopyFrom(event_to_proto(chunk.event))
    if chunk.engine_timing is not None:
        msg.engine_timing.queued_at = chunk.engine_timing.queued_at
        msg.engine_timing.scheduled_at = chunk.engine_timing.scheduled_at
    return msg


def chunk_from_proto(msg: common_pb2.GenerateResponse) -> TokenChunk:
    return TokenChunk(
        request_id=msg.request_id,
        index=msg.index,
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=FinishReason(msg.finish_reason),
        event=event_from_proto(msg.event) if msg.HasField("event") else None,
        worker_id=msg.worker_id,
        engine_timing=(
            EngineTiming(msg.engine_timing.queued_at, msg.engine_timing.scheduled_at)
            if msg.HasField("engine_timing")
            else None
        ),
        logprobs=tuple(logprobs_from_proto(position) for position in msg.logprobs),
    )


def logprobs_to_proto(position: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprob=position.logprob,
        top=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in position.top],
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        logprob=msg.logprob, top=tuple(TopLogprob(t.token_id, t.logprob) for t in msg.top)
    )


def flush_report_to_proto(report: FlushReport) -> daemon_pb2.FlushProgress:
    return daemon_pb2.FlushProgress(
        request_id=report.request_id,
        complete=report.complete,
        committed_tokens=report.committed_tokens,
        persisted_blocks=report.persisted_blocks,
        tail_persisted=report.tail_persisted,
        context_tokens=report.context_tokens,
        worker_id=report.worker_id,
    )


def flush_report_from_proto(msg: daemon_pb2.FlushProgress) -> FlushReport:
    return FlushReport(
        request_id=msg.request_id,
        complete=msg.complete,
        committed_tokens=msg.committed_tokens,
        persisted_blocks=msg.persisted_blocks,
        tail_persisted=msg.tail_persisted,
        context_tokens=msg.context_tokens,
        worker_id=msg.worker_id,
    )


def notice_event_to_proto(event: NoticeEvent) -> daemon_pb2.NoticeEvent:
    msg = daemon_pb2.NoticeEvent(
        source=event.source,
        action=event.action,
        deadline_unix=event.deadline_unix,
        received_unix=event.received_unix,
        daemon_id=event.daemon_id,
    )
    if event.flush is not None:
        msg.flush.CopyFrom(flush_report_to_proto(event.flush))
    return msg


def notice_event_from_proto(msg: daemon_pb2.NoticeEvent) -> NoticeEvent:
    return NoticeEvent(
        source=msg.source,
        action=msg.action,
        deadline_unix=msg.deadline_unix,
        received_unix=msg.received_unix,
        daemon_id=msg.daemon_id,
        flush=flush_report_from_proto(msg.flush) if msg.HasField("flush") else None,
    )


def worker_stats_to_proto(stats: WorkerCapacity) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        worker_id=stats.worker_id,
        ready=stats.ready,
        draining=stats.draining,
        degraded=stats.degraded,
        running_seqs=stats.running_seqs,
        waiting_seqs=stats.waiting_seqs,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_free=stats.kv_blocks_free,
        kv_block_tokens=stats.kv_block_tokens,
        tokens_per_second=stats.tokens_per_second,
        max_num_seqs=stats.max_num_seqs,
        max_model_len=stats.max_model_len,
        model=stats.model,
        generated_tokens_total=stats.generated_tokens_total,
        requests_total=stats.requests_total,
        stopping_deadline_unix=stats.stopping_deadline_unix,
        kv_persistence=kv_persistence_to_proto(stats.kv_persistence),
    )


def worker_stats_from_proto(msg: worker_pb2.WorkerStats) -> WorkerCapacity:
    return WorkerCapacity(
        worker_id=msg.worker_id,
        ready=msg.ready,
        draining=msg.draining,
        degraded=msg.degraded,
        running_seqs=msg.running_seqs,
        waiting_seqs=msg.waiting_seqs,
        kv_blocks_total=msg.kv_blocks_total,
        kv_blocks_free=msg.kv_blocks_free,
        kv_block_tokens=msg.kv_block_tokens,
        max_num_seqs=msg.max_num_seqs,
        max_model_len=msg.max_model_len,
        model=msg.model,
        tokens_per_second=msg.tokens_per_second,
        generated_tokens_total=msg.generated_tokens_total,
        requests_total=msg.requests_total,
        stopping_deadline_unix=msg.stopping_deadline_unix,
        kv_persistence=kv_persistence_from_proto(msg.kv_persistence),
    )


def kv_persistence_to_proto(persistence: KvPersistence) -> worker_pb2.KvPersistence:
    return worker_pb2.KvPersistence(
        policy=persistence.policy,
        rate_cap_bytes_per_second=persistence.rate_cap_bytes_per_second,
    )


def kv_persistence_from_proto(msg: worker_pb2.KvPersistence) -> KvPersistence:
    return KvPersistence(policy=msg.policy, rate_cap_bytes_per_second=msg.rate_cap_bytes_per_second)


def prefetch_result_to_proto(result: PrefetchResult) -> worker_pb2.PrefetchResponse:
    return worker_pb2.PrefetchResponse(
        staged_blocks=result.staged_blocks,
        new_blocks=result.new_blocks,
        staged_bytes=result.staged_bytes,
        context_tokens=result.context_tokens,
        finished=result.finished,
    )


def prefetch_result_from_proto(msg: worker_pb2.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(
        staged_blocks=msg.staged_blocks,
        new_blocks=msg.new_blocks,
        staged_bytes=msg.staged_bytes,
        context_tokens=msg.context_tokens,
        finished=msg.finished,
    )


def pool_to_proto(pool: PoolLabels) -> control_pb2.PoolLabels:
    return control_pb2.PoolLabels(
        cloud=pool.cloud, zone=pool.zone, instance_type=pool.instance_type, spot=pool.spot
    )


def pool_from_proto(msg: control_pb2.PoolLabels) -> PoolLabels:
    return PoolLabels(
        cloud=msg.cloud, zone=msg.zone, instance_type=msg.instance_type, spot=msg.spot
    )


def registration_to_proto(registration: Registration) -> control_pb2.RegisterWorkerRequest:
    msg = control_pb2.RegisterWorkerRequest(
        worker_id=registration.worker_id,
        address=registration.address,
        role=control_pb2.WORKER_ROLE_STANDBY
        if registration.standby
        else control_pb2.WORKER_ROLE_ACTIVE,
        daemon_address=registration.daemon_address,
        lease_ttl_seconds=registration.lease_ttl_seconds,
        pool=pool_to_proto(registration.pool),
        model_fingerprint=registration.model_fingerprint,
        model=registration.model,
    )
    if registration.capacity is not None:
        msg.capacity.CopyFrom(worker_stats_to_proto(registration.capacity))
    return msg


def registration_from_proto(msg: control_pb2.RegisterWorkerRequest) -> Registration:
    """A role left UNSPECIFIED is ACTIVE (what a launcher of an older release sends)."""
    return Registration(
        address=msg.address,
        standby=msg.role == control_pb2.WORKER_ROLE_STANDBY,
        worker_id=msg.worker_id,
        daemon_address=msg.daemon_address,
        lease_ttl_seconds=msg.lease_ttl_seconds,
        pool=pool_from_proto(msg.pool),
        capacity=worker_stats_from_proto(msg.capacity) if msg.HasField("capacity") else None,
        model_fingerprint=msg.model_fingerprint,
        model=msg.model,
    )


def class_cap_to_proto(view: ClassCapView) -> control_pb2.ClassCap:
    return control_pb2.ClassCap(
        sla_class=sla_to_proto(SlaClass(view.sla_class)),
        cap=view.cap,
        decision=view.decision,
        reason=view.reason,
        ttft_p99_seconds=view.ttft_p99_seconds,
        tpot_seconds=view.tpot_seconds,
        samples=view.samples,
    )
