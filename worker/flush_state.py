"""How far a paused request's state has reached the store: what a preempt flush reports.

A request is *complete* when a standby can continue it with no recompute::

    record status paused, committed tokens >= what this worker streamed
    context = prompt + committed tokens; KV is needed for context[:-1]
    full blocks 0 .. (len-1)//B - 1   linked to the request, hashes = the chain over context
    tail (len-1) % B tokens           stored under the request's key, header naming exactly
                                      those tokens (by count and chain hash)

Only headers and links are read (no payloads): cheap enough to poll during a grace period.
The standby still verifies every byte when it loads the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from context_daemon.store import (
    RedisStore,
    RequestNotFound,
    RequestStatus,
    block_hashes,
    tail_hash,
)


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


def read_flush_state(
    store: RedisStore,
    request_id: str,
    model_fingerprint: str,
    block_tokens: int,
    streamed_tokens: int,
    with_kv: bool,
) -> FlushState:
    """Where ``request_id`` stands (blocking: call on a thread). ``streamed_tokens``: output
    tokens this worker streamed (the store must hold at least those). ``with_kv``: False when
    this worker persists no KV (policy off); complete then means tokens only."""
    try:
        record = store.get_request(request_id)
        committed = store.committed_tokens(request_id)
    except RequestNotFound:
        return FlushState(request_id, 0, 0, 0, False, False)
    context = list(record.prompt_token_ids) + committed
    kv_tokens = max(0, len(context) - 1)
    full_blocks = kv_tokens // block_tokens
    expected = block_hashes(model_fingerprint, context[: full_blocks * block_tokens], block_tokens)
    linked = 0
    for stored, wanted in zip(record.persisted_block_hashes, expected, strict=False):
        if stored != wanted:
            break
        linked += 1
    tail_ok = True
    if kv_tokens % block_tokens:
        summary = store.tail_summary(request_id)
        wanted_tail = tail_hash(model_fingerprint, context[:kv_tokens], block_tokens)
        tail_ok = (
            summary is not None
            and summary.num_tokens == kv_tokens % block_tokens
            and summary.prefix_hash == wanted_tail
        )
    tokens_ok = record.status is RequestStatus.PAUSED and len(committed) >= streamed_tokens
    kv_ok = linked == full_blocks and tail_ok
    return FlushState(
        request_id=request_id,
        committed_tokens=len(committed),
        context_tokens=len(context),
        persisted_blocks=linked,
        tail_persisted=tail_ok,
        complete=tokens_ok and (kv_ok or not with_kv),
    )
