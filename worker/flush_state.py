"""How far a paused request's state has reached the store: what a preempt flush reports.

A request is *complete* when a standby can continue it with no recompute::

    record status paused, committed tokens >= what this worker streamed
    context = prompt + committed tokens; KV is needed for context[:-1]
    full blocks 0 .. (len-1)//B - 1   linked to the request, hashes = the chain over context
    tail (len-1) % B tokens           stored under the request's key, header naming exactly
                                      those tokens (by count and chain hash)

and, for a sharded worker, the same full blocks and tail under every rank's keys
(store.keys.shard_suffix; each rank writes, and links, its own shard, so a link alone does
not say every shard is there) — unless the record says the pause found none of the request's KV computed on this worker
(it still waited in the engine's queue; the connector marks that after the request's
tokens), or every token is committed (the engine finished the request as the pause cut the
stream; the connector commits a finished request's whole list): no block or tail is owed
then, and the standby computes nothing this worker had.

Only headers and links are read (no payloads), every request in one round trip: cheap
enough to poll during a grace period. The standby still verifies every byte when it loads
the blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.messages import FlushReport
from store import RedisStore, RequestStatus, block_hashes, tail_hash
from store.block_codec import BlockSummary
from store.redis_store import RequestView


@dataclass(frozen=True)
class FlushState:
    """One paused request as the store holds it now."""

    request_id: str
    committed_tokens: int
    context_tokens: int
    persisted_blocks: int
    """Full blocks linked to the request and matching its tokens (leading run)."""
    tail_persisted: bool
    """The partial tail is stored for exactly the right tokens, or none is needed."""
    complete: bool

    def report(self, worker_id: str) -> FlushReport:
        """The message the worker streams to its daemon for this request."""
        return FlushReport(
            request_id=self.request_id,
            complete=self.complete,
            committed_tokens=self.committed_tokens,
            persisted_blocks=self.persisted_blocks,
            tail_persisted=self.tail_persisted,
            context_tokens=self.context_tokens,
            worker_id=worker_id,
        )


def read_flush_state(
    store: RedisStore,
    request_id: str,
    model_fingerprint: str,
    block_tokens: int,
    streamed_tokens: int,
    with_kv: bool,
    shards: Sequence[str] = (),
) -> FlushState:
    """Where ``request_id`` stands (blocking: call on a thread). ``streamed_tokens``: output
    tokens this worker streamed (the store must hold at least those). ``with_kv``: False when
    this worker persists no KV (policy off); complete then means tokens only. ``shards``:
    every rank's key suffix, for a sharded worker."""
    (state,) = read_flush_states(
        store, {request_id: streamed_tokens}, model_fingerprint, block_tokens, with_kv, shards
    )
    return state


def read_flush_states(
    store: RedisStore,
    streamed_tokens: Mapping[str, int],
    model_fingerprint: str,
    block_tokens: int,
    with_kv: bool,
    shards: Sequence[str] = (),
) -> list[FlushState]:
    """read_flush_state for many requests (request id -> tokens streamed): one round trip,
    two for a sharded worker."""
    views = store.request_views(list(streamed_tokens))
    states = [
        _flush_state(
            request_id, views[request_id], model_fingerprint, block_tokens, streamed, with_kv
        )
        for request_id, streamed in streamed_tokens.items()
    ]
    if not shards or not with_kv:
        return states
    owing: dict[str, tuple[list[bytes], int, bytes | None]] = {}
    for state in states:
        view = views[state.request_id]
        if state.complete and view is not None and _owes_kv(view, with_kv):
            owing[state.request_id] = _expected_blocks(view, model_fingerprint, block_tokens)
    if not owing:
        return states
    shard_views = store.shard_views(
        {request_id: hashes for request_id, (hashes, _, _) in owing.items()}, shards
    )
    return [
        _with_shards(state, owing[state.request_id], shard_views[state.request_id])
        if state.request_id in owing
        else state
        for state in states
    ]


def _expected_blocks(
    view: RequestView, model_fingerprint: str, block_tokens: int
) -> tuple[list[bytes], int, bytes | None]:
    """The chain hashes of the full blocks a standby needs, and the tail's tokens and hash
    (0, None: no tail needed)."""
    record = view.record
    context = list(record.prompt_token_ids) + view.committed_tokens
    kv_tokens = max(0, len(context) - 1)
    full_blocks = kv_tokens // block_tokens
    hashes = block_hashes(
        model_fingerprint, context[: full_blocks * block_tokens], block_tokens, record.tenant
    )
    tail_tokens = kv_tokens % block_tokens
    if not tail_tokens:
        return hashes, 0, None
    return (
        hashes,
        tail_tokens,
        tail_hash(model_fingerprint, context[:kv_tokens], block_tokens, record.tenant),
    )


def _with_shards(
    state: FlushState,
    expected: tuple[list[bytes], int, bytes | None],
    shard_views: list[tuple[int, BlockSummary | None]],
) -> FlushState:
    """``state`` (complete by the links and the plain tail) is complete only if every shard
    holds the blocks and the tail; else it counts what all shards hold."""
    hashes, tail_tokens, wanted_tail = expected
    blocks = min([state.persisted_blocks, *(run for run, _ in shard_views)])
    tail_ok = wanted_tail is None or all(
        summary is not None
        and summary.num_tokens == tail_tokens
        and summary.prefix_hash == wanted_tail
        for _, summary in shard_views
    )
    complete = blocks == len(hashes) and tail_ok
    return dataclasses.replace(
        state, persisted_blocks=blocks, tail_persisted=tail_ok, complete=complete
    )


def _owes_kv(view: RequestView, with_kv: bool) -> bool:
    """Whether a complete pause of this request must have stored KV (see _flush_state)."""
    max_tokens = int(view.record.sampling_params.get("max_tokens", 0))
    generated_all = bool(max_tokens) and len(view.committed_tokens) >= max_tokens
    return with_kv and not view.record.paused_without_kv and not generated_all


def _flush_state(
    request_id: str,
    view: RequestView | None,
    model_fingerprint: str,
    block_tokens: int,
    streamed_tokens: int,
    with_kv: bool,
) -> FlushState:
    if view is None:
        return FlushState(request_id, 0, 0, 0, False, False)
    record, committed = view.record, view.committed_tokens
    context = list(record.prompt_token_ids) + committed
    kv_tokens = max(0, len(context) - 1)
    full_blocks = kv_tokens // block_tokens
    expected = block_hashes(
        model_fingerprint, context[: full_blocks * block_tokens], block_tokens, record.tenant
    )
    linked = 0
    for stored, wanted in zip(record.persisted_block_hashes, expected, strict=False):
        if stored != wanted:
            break
        linked += 1
    tail_ok = True
    if kv_tokens % block_tokens:
        summary = view.tail
        wanted_tail = tail_hash(model_fingerprint, context[:kv_tokens], block_tokens, record.tenant)
        tail_ok = (
            summary is not None
            and summary.num_tokens == kv_tokens % block_tokens
            and summary.prefix_hash == wanted_tail
        )
    tokens_ok = record.status is RequestStatus.PAUSED and len(committed) >= streamed_tokens
    kv_ok = linked == full_blocks and tail_ok
    # Every token generated (the engine finished it as the pause cut the stream): a standby
    # has nothing to compute, so no KV is owed.
    kv_owed = _owes_kv(view, with_kv)
    return FlushState(
        request_id=request_id,
        committed_tokens=len(committed),
        context_tokens=len(context),
        persisted_blocks=linked,
        tail_persisted=tail_ok,
        complete=tokens_ok and (kv_ok or not kv_owed),
    )
