"""The connector's scheduler side, its saving half: which blocks of each request it names for
the worker role to copy and write, step by step, and what a paused request still has to
write. The loading half (resumes) is spot_connector_scheduler.py.

A request's blocks are saved in order, so what is stored is always a prefix (a resume can use
no more than that): ``saved_blocks`` counts it. Each step, under

    eager   every block that is full once the step's tokens are computed;
    hybrid  as many of those (and of the ones held back before) as the rate cap grants
            (persist_rate_cap.py);
    lazy    none;

and at a pause (an abort), whatever full blocks are not saved yet and the partial tail, all
of them required: a notice leaves nothing to recompute under any policy but off.

    request:  ■■■□□◧     ■ saved   □ full, not saved (lazy, or held back)   ◧ partial tail
    pause:       └┴┴┴── named by `flush`
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from store import TokenCommit, block_hashes, tail_hash
from worker.constants import FLUSH_ASSUMED_BYTES_PER_SECOND, FLUSH_ASSUMED_ROUND_TRIP_SECONDS
from worker.flush_planner import FlushKind, LinkEstimate, PendingWork, plan_flush
from worker.persist_rate_cap import PersistRateCap
from worker.spot_connector_metadata import BlockSave, SpotConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from store import KVFormat


@dataclass(frozen=True)
class Flush:
    """What an aborted request still has to write (named at request_finished)."""

    vllm_id: str
    commit: TokenCommit | None
    saves: list[BlockSave]
    without_kv: str = ""
    """Our id when the engine had computed none of the request's KV (it had not been
    scheduled yet): nothing to save, and the record is marked so the flush counts as
    complete without blocks or tail."""
    request_id: str = ""
    """Ours (vLLM's id carries a suffix): the pause is handed over under it."""
    full_blocks: int = 0
    """Full blocks the request's KV fills (all of them, saved before or now)."""
    tail_tokens: int = 0
    """Tokens of its partial last block (0: none)."""


class SavingRequest(Protocol):
    """What the saving half reads and keeps of a tracked request."""

    request: Request
    request_id: str  # ours; vLLM's id carries a suffix
    warm: bool  # a migration target's warm-up: never saves
    first_index: int
    tenant: str
    chain: list[bytes]  # hashes of blocks 0.. named so far
    saved_blocks: int  # blocks [0, saved_blocks) are stored (saved or loaded)
    full_seen: int  # full blocks counted so far as saved or held back by the rate cap


def add_flushes(meta: SpotConnectorMetadata, flushes: list[Flush], block_bytes: int) -> None:
    """Queue the flushes in the planner's order: every token list first, then the KV of the
    requests with the least of it (the most requests complete soonest). ``block_bytes``: one
    stored chunk's bytes, all layers."""
    by_id = {flush.vllm_id: flush for flush in flushes}
    plan = plan_flush(
        [
            PendingWork(
                flush.vllm_id,
                len(flush.commit.token_ids) if flush.commit else 0,
                len(flush.saves) * block_bytes,
            )
            for flush in flushes
        ],
        LinkEstimate(FLUSH_ASSUMED_BYTES_PER_SECOND, FLUSH_ASSUMED_ROUND_TRIP_SECONDS),
        seconds_left=float("inf"),
    )
    meta.commits.extend(flush.commit for flush in flushes if flush.commit is not None)
    for step in plan.steps:
        if step.kind is FlushKind.KV:
            meta.saves.extend(by_id[step.request_id].saves)
    meta.released.extend(flush.vllm_id for flush in flushes if flush.saves)
    meta.without_kv.extend(flush.without_kv for flush in flushes if flush.without_kv)
    meta.paused.extend(
        (flush.request_id, flush.full_blocks, flush.tail_tokens)
        for flush in flushes
        if flush.request_id
    )


class BlockSaves:
    """Names saves in chunks of ``kv_format.block_tokens`` tokens, each ``blocks_per_chunk``
    of vLLM's blocks of ``engine_block_tokens``; ``rate_cap``: hybrid's (None: eager, every
    full block at once). Not thread-safe: the scheduler's one thread calls it."""

    def __init__(
        self,
        kv_format: KVFormat,
        engine_block_tokens: int,
        rate_cap: PersistRateCap | None = None,
    ) -> None:
        self._kv_format = kv_format
        self._engine_block_tokens = engine_block_tokens
        self._blocks_per_chunk = kv_format.block_tokens // engine_block_tokens
        self._rate_cap = rate_cap
        self._deferred_blocks = 0

    def take_deferred(self) -> int:
        """Full blocks the rate cap held back in the step they filled, since the last call."""
        deferred, self._deferred_blocks = self._deferred_blocks, 0
        return deferred

    def slots(self, block_ids: list[int], chunk_index: int, num_tokens: int) -> tuple[int, ...]:
        """The cache slots of chunk ``chunk_index`` that hold its ``num_tokens`` tokens (those
        vLLM allocated: a chunk may run past the request's last allocated block)."""
        start = chunk_index * self._blocks_per_chunk
        count = -(-num_tokens // self._engine_block_tokens)
        return tuple(block_ids[start : start + count])

    def this_step(
        self, scheduler_output: SchedulerOutput, tracked: Mapping[str, SavingRequest]
    ) -> list[BlockSave]:
        """The saves of this step (the worker role copies them after the forward pass) of
        the scheduled requests among ``tracked`` (by vLLM's id)."""
        block_state = scheduler_output.kv_connector_block_state
        if block_state is None:
            return []
        due: list[tuple[SavingRequest, int, list[int]]] = []
        for vllm_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            saving = tracked.get(vllm_id)
            if saving is None or saving.warm:
                continue
            full_blocks = (saving.request.num_computed_tokens + scheduled) // (
                self._kv_format.block_tokens
            )
            if full_blocks <= saving.saved_blocks:
                continue
            ids = block_state.get_block_ids(vllm_id)
            if ids is None:
                continue
            full_blocks = self._storable_blocks(saving, full_blocks, ids[0])
            if full_blocks > saving.saved_blocks:
                due.append((saving, full_blocks, ids[0]))
        if self._rate_cap is None:
            upto = [full for _, full, _ in due]
        else:
            granted = self._rate_cap.grant([full - s.saved_blocks for s, full, _ in due])
            upto = [s.saved_blocks + n for (s, _, _), n in zip(due, granted, strict=True)]
        saves: list[BlockSave] = []
        for (saving, full_blocks, block_ids), end in zip(due, upto, strict=True):
            saves.extend(self._name_new_blocks(saving, end, block_ids))
            # A block held back the step it filled counts once, however long it waits.
            self._deferred_blocks += max(0, full_blocks - max(saving.full_seen, end))
            saving.full_seen = max(saving.full_seen, full_blocks)
        return saves

    def _storable_blocks(
        self, saving: SavingRequest, full_blocks: int, block_ids: list[int]
    ) -> int:
        """``full_blocks`` at most, as far as the request's token ids and its allocated cache
        blocks reach."""
        return min(
            full_blocks,
            len(saving.request.all_token_ids) // self._kv_format.block_tokens,
            len(block_ids) // self._blocks_per_chunk,
        )

    def _name_new_blocks(
        self, saving: SavingRequest, full_blocks: int, block_ids: list[int]
    ) -> list[BlockSave]:
        """Saves of blocks [saved_blocks, full_blocks), which are then counted as stored."""
        block_tokens = self._kv_format.block_tokens
        token_ids = saving.request.all_token_ids
        full_blocks = self._storable_blocks(saving, full_blocks, block_ids)
        if len(saving.chain) < full_blocks:
            saving.chain = block_hashes(
                self._kv_format.model_fingerprint,
                list(token_ids[: full_blocks * block_tokens]),
                block_tokens,
                saving.tenant,
            )
        saves = [
            BlockSave(
                saving.request_id,
                index,
                self.slots(block_ids, index, block_tokens),
                saving.chain[index],
            )
            for index in range(saving.saved_blocks, full_blocks)
        ]
        saving.saved_blocks = max(saving.saved_blocks, full_blocks)
        return saves

    def flush(self, saving: SavingRequest, block_ids: list[int]) -> Flush:
        """Everything of a paused request not in the store yet: its tokens (as the engine has
        them), the full blocks not saved so far and the partial tail."""
        request = saving.request
        block_tokens = self._kv_format.block_tokens
        token_ids = list(request.all_token_ids)
        # A step may be in flight at the abort (its token never reached the output); the KV
        # a standby needs is that of every token but the last, which it computes itself.
        computed = min(
            request.num_computed_tokens,
            len(token_ids) - 1,
            len(block_ids) * self._engine_block_tokens,
        )
        full_blocks = computed // block_tokens
        if len(saving.chain) < full_blocks:
            saving.chain = block_hashes(
                self._kv_format.model_fingerprint,
                token_ids[: full_blocks * block_tokens],
                block_tokens,
                saving.tenant,
            )
        saves = [
            BlockSave(
                saving.request_id,
                index,
                self.slots(block_ids, index, block_tokens),
                saving.chain[index],
                required=True,
            )
            for index in range(saving.saved_blocks, full_blocks)
        ]
        tail_tokens = computed - full_blocks * block_tokens
        if tail_tokens:
            prefix = tail_hash(
                self._kv_format.model_fingerprint,
                token_ids[:computed],
                block_tokens,
                saving.tenant,
            )
            assert prefix is not None
            saves.append(
                BlockSave(
                    saving.request_id,
                    full_blocks,
                    self.slots(block_ids, full_blocks, tail_tokens),
                    prefix,
                    num_tokens=tail_tokens,
                    required=True,
                )
            )
        saving.saved_blocks = full_blocks
        outputs = tuple(request.output_token_ids)
        commit = TokenCommit(saving.request_id, saving.first_index, outputs) if outputs else None
        return Flush(
            request.request_id,
            commit,
            saves,
            "" if computed else saving.request_id,
            saving.request_id,
            full_blocks,
            tail_tokens,
        )
