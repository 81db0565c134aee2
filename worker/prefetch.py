"""One stage of a live migration on its target: stage what the store holds of a request.

The source keeps decoding while this runs; every block it fills is persisted (policy eager)
and picked up by the next stage. Full blocks never change once written (their key is the
hash of every token up to their end), so a staged block stays right whatever the source
does next; the partial tail does, and is left for the pause::

    record + committed tokens ─▶ context ─▶ chain hashes of its full blocks
    not staged yet ─▶ GETEX (one round trip) ─▶ StagingArea.stage ─▶ PrefetchOutcome

The engine then warms what a stage added into vLLM's prefix cache (Engine.prefetch), so the
resume after the pause finds those blocks in the cache and loads only the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import PrefetchResult
from store import RedisStore, block_hashes
from worker.kv_staging import StagingArea, staged_name
from worker.resume_point import read_stored_point


@dataclass(frozen=True)
class PrefetchOutcome(PrefetchResult):
    """What the worker answers its coordinator, and what it keeps for the resume."""

    staged_prefix: tuple[int, ...] = ()
    """The tokens whose KV the staged blocks hold (the leading full blocks of the context)."""
    tenant: str = ""
    """The request's tenant: the warm-up runs under its salt."""


def prefetch_stage(
    store: RedisStore,
    staging: StagingArea,
    request_id: str,
    model_fingerprint: str,
    block_tokens: int,
    shards: tuple[str, ...] = ("",),
) -> PrefetchOutcome:
    """Stages the full blocks of ``request_id`` the store holds and staging does not (blocking:
    call on a thread); a sharded worker's (``shards``: every rank's key suffix) each rank's
    shard of them, a block counting once all its shards are staged. Raises RecordNotFound,
    CannotResume, StagingFull, StoreUnavailable."""
    point = read_stored_point(store, request_id, model_fingerprint)
    context = list(point.engine_prompt)
    if point.record.status.is_terminal:
        staging.drop(request_id)
        return PrefetchOutcome(0, 0, 0, len(context), finished=True)
    # The KV of every token but the last is needed; its full blocks are final.
    hashes = block_hashes(
        model_fingerprint,
        context[: max(0, len(context) - 1)],
        block_tokens,
        point.record.tenant,
    )
    # A block staged before (by this request's earlier stages, or by another request with the
    # same prefix) is only referenced again.
    wanted = [
        h for h in hashes if not all([staging.share(request_id, staged_name(h, s)) for s in shards])
    ]
    new_blocks = 0
    if wanted:
        values = [store.get_block_values(wanted, shard) for shard in shards]
        for position, prefix_hash in enumerate(wanted):
            shard_values = [of_shard[position] for of_shard in values]
            if any(data is None for data in shard_values):
                break  # not persisted (yet): later blocks could not be used either
            for shard, data in zip(shards, shard_values, strict=True):
                assert data is not None
                staging.stage(request_id, staged_name(prefix_hash, shard), data)
            new_blocks += 1
    # Every block's shards are staged together (and dropped together with the request).
    staged_blocks = staging.blocks_of(request_id) // len(shards)
    return PrefetchOutcome(
        staged_blocks=staged_blocks,
        new_blocks=new_blocks,
        staged_bytes=staging.bytes_of(request_id),
        context_tokens=len(context),
        finished=False,
        staged_prefix=tuple(context[: staged_blocks * block_tokens]),
        tenant=point.record.tenant,
    )
