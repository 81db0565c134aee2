"""Conversions between `spotinfer.v1` messages and the dataclasses of `common` (the only
place they are written).

Only the edges of each process (its `server.py`, and the clients of other processes) call
these: inside, code never sees a proto message.
"""

from __future__ import annotations

from common.messages import FlushReport
from common.requests import (
    Event,
    EventKind,
    FinishReason,
    GenerationRequest,
    Sampling,
    SlaClass,
    TokenChunk,
)
from protos.spotinfer.v1 import common_pb2, daemon_pb2


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
    return msg


def sla_from_proto(value: int) -> SlaClass:
    return SlaClass.BATCH if value == common_pb2.SLA_CLASS_BATCH else SlaClass.INTERACTIVE


def sla_to_proto(sla: SlaClass) -> common_pb2.SlaClass.ValueType:
    return common_pb2.SLA_CLASS_BATCH if sla == SlaClass.BATCH else common_pb2.SLA_CLASS_INTERACTIVE


def request_to_proto(request: GenerationRequest) -> common_pb2.GenerateRequest:
    """A request whose prompt is token ids (text prompts are tokenized at the edge)."""
    return common_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=sampling_to_proto(request.sampling),
        sla_class=sla_to_proto(request.sla_class),
    )


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
    )
    if chunk.event is not None:
        msg.event.CopyFrom(event_to_proto(chunk.event))
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
