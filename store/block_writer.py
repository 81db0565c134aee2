"""The KV write-behind: block copies go to Redis on a thread, never on the engine step.

The engine step only copies a block out of the paged cache into the buffer it will be sent
from (``KVCopier.gather``: room for the header, then the KV) and queues it; this thread
seals each buffer in place (header, CRC) and sends batches, one pipelined round trip each,
so a block's bytes are copied once between the cache and the socket. Nothing here ever
blocks the step: a full queue or an unreachable Redis drops the block (counted, logged once
per outage); the block's tokens will simply be recomputed if that request is resumed.

A paused request's flush (its token list, unsaved full blocks and partial tail) is queued
as *required*: it may pass the queue bound, because it is the last chance to save that state.
Batches hold at most KV_WRITE_BATCH_BLOCKS blocks, so the queue order (the flush planner's)
decides which requests are complete first; a batch writes its token commits before its
blocks, and a request's tail after its full blocks, so a stored tail means the blocks before
it were sent. A paused request with no KV to save gets a mark instead, written last in its
batch (after its tokens).

The worker's token committer creates a request's record off the stream's path, so on a busy
machine a request can run, and even be paused, before its record exists; the store refuses
what names a request it has no record of. So a full block whose link was refused is linked
again with the request's next writes, and a flush's refused writes (tokens, tail, mark,
links) are tried again every FLUSH_RETRY_INTERVAL_SECONDS for FLUSH_RETRY_SECONDS.

The same writer runs in two places. In the worker (each rank) when it persists itself; and in
its context daemon, behind the hand-off (context_daemon/persister.py), where the blocks sit in
the worker's shared ring. There, ``hold_on_outage`` keeps a batch that met an unreachable
Redis and tries it again rather than dropping it (the ring bounds what can wait), and
``on_round`` hears which blocks are done with (written or dropped) so their slots can be
reused.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from common.cpu_affinity import unpin_current_thread
from store.block_codec import EncodedBlock, KVFormat, header_bytes, seal_block
from store.block_refs import BlockWrite
from store.constants import (
    FLUSH_RETRY_INTERVAL_SECONDS,
    FLUSH_RETRY_SECONDS,
    KV_WRITE_BATCH_BLOCKS,
    UNLINKED_BLOCKS_KEEP_SECONDS,
)
from store.errors import ConflictReason, StoreError, StoreUnavailable
from store.redis_store import CommitOutcome, RedisStore, TokenCommit

log = logging.getLogger(__name__)

_STOP = None


@dataclass(frozen=True)
class PendingBlock:
    """A block copied out of the cache, waiting to be written; ``num_tokens`` below the block
    size makes it the request's partial tail. ``data`` is the ``KVCopier.gather`` buffer:
    the store's header bytes, still free, then the block's KV."""

    request_id: str
    block_index: int
    prefix_hash: bytes
    data: torch.Tensor
    num_tokens: int = 0  # 0: a full block
    required: bool = False  # part of a pause's flush


@dataclass(frozen=True)
class NoKVMark:
    """A paused request of which the worker held no KV: its record is marked so (see
    RedisStore.mark_paused_without_kv)."""

    request_id: str


@dataclass(frozen=True)
class FinalCommit:
    """The whole token list of a request that reached its max_tokens: best effort, since
    its record is usually deleted as it finishes; it matters when a pause cut the worker's
    stream short of those last tokens (the engine had finished the request, so no flush
    follows)."""

    commit: TokenCommit

    @property
    def request_id(self) -> str:
        return self.commit.request_id


_Item = PendingBlock | TokenCommit | NoKVMark | FinalCommit


@dataclass
class _Refused:
    """A flush's writes refused because the request's record did not exist yet."""

    until: float  # monotonic: given up after this
    commits: list[TokenCommit] = field(default_factory=list)
    tails: list[BlockWrite] = field(default_factory=list)
    mark: bool = False


class KVBlockWriter:
    """One daemon thread that drains a bounded queue into ``store.put_blocks``."""

    def __init__(
        self,
        store: RedisStore,
        kv_format: KVFormat,
        max_queued_blocks: int,
        hold_on_outage: bool = False,
        on_round: Callable[[list[PendingBlock]], None] | None = None,
    ) -> None:
        self._store = store
        self._hold_on_outage = hold_on_outage
        self._on_round = on_round
        self._held: list[_Item] = []  # a batch that met an outage, tried again (hold_on_outage)
        self._retry_at = 0.0
        self._kv_format = kv_format
        # Unbounded as a queue; the bound applies to optional saves only (see submit).
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._max_queued_blocks = max_queued_blocks
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._header_bytes = header_bytes(kv_format)
        self._written = 0
        self._written_bytes = 0
        self._dropped = 0
        self._rounds = 0
        self._unavailable = False
        # Owned by the writer thread: links to make once the record exists (request id ->
        # last refusal, block index -> hash), and flushes to try again (request id ->).
        self._unlinked: dict[str, tuple[float, dict[int, bytes]]] = {}
        self._refused: dict[str, _Refused] = {}
        self._last_retry = 0.0
        self._thread = threading.Thread(target=self._run, name="spot-kv-writer", daemon=True)
        self._thread.start()

    def buffer(self, nbytes: int, required: bool = False) -> torch.Tensor | None:
        """A buffer for the next block's copy (``KVCopier.gather(out=...)``); None, counted as
        dropped, for an optional block that the full queue would drop anyway."""
        if not required and self._queue.qsize() >= self._max_queued_blocks:
            self._count_dropped(1, "the write queue is full")
            return None
        return torch.empty(nbytes, dtype=torch.uint8)

    @property
    def pending_blocks(self) -> int:
        """Blocks queued or waiting for Redis to answer again (an estimate off the thread)."""
        with self._lock:
            held = sum(isinstance(item, PendingBlock) for item in self._held)
        return self._queue.qsize() + held

    def submit(self, block: PendingBlock, required: bool = False) -> None:
        """Queue a block; an optional one is dropped (counted) when the queue is full. Never
        waits."""
        if not required and self._queue.qsize() >= self._max_queued_blocks:
            self._count_dropped(1, "the write queue is full")
            return
        self._queue.put_nowait(dataclasses.replace(block, required=True) if required else block)

    def submit_paused(self, request_id: str, full_blocks: int, tail_tokens: int) -> None:
        """A pause's writes are all submitted: nothing to do here (a daemon behind the
        hand-off uses it to move the request to a peer)."""

    def submit_no_kv(self, request_id: str) -> None:
        """Queue the mark of a paused request that had no KV to save (after its tokens)."""
        self._queue.put_nowait(NoKVMark(request_id))

    def submit_tokens(self, commit: TokenCommit, final: bool = False) -> None:
        """Queue a token commit (idempotent in the store, so it may overlap earlier ones).
        ``final``: a finished request's, never tried again (see FinalCommit)."""
        self._queue.put_nowait(FinalCommit(commit) if final else commit)

    @property
    def written_blocks(self) -> int:
        with self._lock:
            return self._written

    @property
    def written_bytes(self) -> int:
        """KV payload bytes of the written blocks (what Redis confirmed, headers left out)."""
        with self._lock:
            return self._written_bytes

    @property
    def dropped_blocks(self) -> int:
        with self._lock:
            return self._dropped

    @property
    def rounds(self) -> int:
        """Write rounds sent to Redis so far (first tries and retries, whatever they met)."""
        with self._lock:
            return self._rounds

    def wait_rounds(self, rounds: int, timeout_seconds: float) -> bool:
        """Wait until ``rounds`` write rounds in all are over; False on timeout. What a round
        was refused is known once it is over (a retry of it is a later round)."""
        with self._settled:
            return self._settled.wait_for(lambda: self._rounds >= rounds, timeout_seconds)

    def wait_settled(self, blocks: int, timeout_seconds: float) -> bool:
        """Wait until ``blocks`` blocks in all were written or dropped; False on timeout."""
        with self._settled:
            return self._settled.wait_for(
                lambda: self._written + self._dropped >= blocks, timeout_seconds
            )

    def close(self, timeout_seconds: float) -> None:
        """Stop after the queued blocks are sent (or dropped); wait at most ``timeout_seconds``."""
        self._queue.put_nowait(_STOP)
        self._thread.join(timeout_seconds)

    def _run(self) -> None:
        unpin_current_thread()  # off the rank's compute core (common/cpu_affinity.py)
        while True:
            if self._held:
                time.sleep(max(0.0, self._retry_at - time.monotonic()))
            try:
                first = self._queue.get(
                    timeout=FLUSH_RETRY_INTERVAL_SECONDS if self._refused or self._held else None
                )
            except queue.Empty:
                self._write(self._take_held())
                continue
            if first is _STOP:
                self._write(self._take_held())
                return
            batch: list[_Item] = [*self._take_held(), first]
            blocks = sum(isinstance(item, PendingBlock) for item in batch)
            stop = False
            while blocks < KV_WRITE_BATCH_BLOCKS:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
                blocks += isinstance(item, PendingBlock)
            self._write(batch)
            if stop:
                return

    def _write(self, batch: list[_Item]) -> None:
        now = time.monotonic()
        retried = self._due_retries(now)
        block_tokens = self._kv_format.block_tokens
        commits = [item for item in batch if isinstance(item, TokenCommit)]
        commits += [commit for refused in retried.values() for commit in refused.commits]
        finals = [item.commit for item in batch if isinstance(item, FinalCommit)]
        marks = [item.request_id for item in batch if isinstance(item, NoKVMark)]
        marks += [request_id for request_id, refused in retried.items() if refused.mark]
        pending = [item for item in batch if isinstance(item, PendingBlock)]
        encoded: list[tuple[PendingBlock, EncodedBlock]] = [
            (
                block,
                seal_block(
                    block.data.numpy().data.cast("B"),
                    self._kv_format,
                    block.prefix_hash,
                    block.num_tokens or block_tokens,
                    self._store.keyring,
                ),
            )
            for block in pending
        ]
        new_writes = [
            BlockWrite(block.request_id, block.block_index, sealed, self._kv_format.shard)
            for block, sealed in encoded
        ]
        writes = new_writes + [tail for refused in retried.values() for tail in refused.tails]
        touched = {item.request_id for item in batch} | set(retried)
        relinks = {
            request_id: sorted(self._unlinked[request_id][1].items())
            for request_id in touched
            if request_id in self._unlinked
        }
        if not (commits or finals or relinks or writes or marks):
            return
        flushing = (
            {commit.request_id for commit in commits}
            | {write.request_id for write in writes if not write.block.is_full}
            | set(marks)
            | {block.request_id for block in pending if block.required}
        )
        try:
            outcomes = self._store.commit_step(commits + finals) if commits or finals else []
            linked = self._store.link_blocks(relinks) if relinks else {}
            stored = self._store.put_blocks(writes) if writes else []
            marked = self._store.mark_paused_without_kv(marks) if marks else []
        except StoreUnavailable as exc:
            if self._hold_on_outage:
                self._hold(batch, retried, now, exc)
                return
            self._count_dropped(len(new_writes), f"Redis is unavailable ({exc})", outage=True)
            self._count_round()
            self._done(pending)
            return
        except StoreError as exc:
            self._count_dropped(len(new_writes), f"Redis refused the write ({exc})")
            self._count_round()
            self._done(pending)
            return
        self._settle_refusals(
            now,
            retried,
            flushing,
            zip(commits, outcomes[: len(commits)], strict=True),
            linked,
            zip(writes, stored, strict=True),
            zip(marks, marked, strict=True),
        )
        with self._lock:
            self._written += len(new_writes)
            self._written_bytes += sum(len(block.data) - self._header_bytes for _, block in encoded)
            recovered = self._unavailable
            self._unavailable = False
            self._rounds += 1
            self._settled.notify_all()
        if recovered:
            log.warning("KV persistence resumed: Redis answers again")
        self._done(pending)

    def _take_held(self) -> list[_Item]:
        with self._lock:
            held, self._held = self._held, []
        return held

    def _hold(
        self, batch: list[_Item], retried: dict[str, _Refused], now: float, exc: Exception
    ) -> None:
        """Keep a batch that met an outage, to try again (its refusals too)."""
        with self._lock:
            self._held = batch
            first_of_outage = not self._unavailable
            self._unavailable = True
            self._rounds += 1
            self._settled.notify_all()
        self._retry_at = now + FLUSH_RETRY_INTERVAL_SECONDS
        self._keep_refused(retried, now)
        if first_of_outage:
            log.warning("Redis is unavailable (%s): holding KV writes until it answers", exc)

    def _done(self, blocks: list[PendingBlock]) -> None:
        if self._on_round is not None and blocks:
            self._on_round(blocks)

    def _settle_refusals(
        self,
        now: float,
        retried: dict[str, _Refused],
        flushing: set[str],
        committed: Iterable[tuple[TokenCommit, CommitOutcome]],
        linked: dict[str, bool],
        stored: Iterable[tuple[BlockWrite, bool]],
        marked: Iterable[tuple[str, bool]],
    ) -> None:
        """Keeps what the store refused for want of a record: full blocks to link again,
        a flush's commits, tails and mark to try again (see the module docstring)."""
        refused: dict[str, _Refused] = {}

        def refusal(request_id: str) -> _Refused:
            until = retried[request_id].until if request_id in retried else None
            return refused.setdefault(request_id, _Refused(until or now + FLUSH_RETRY_SECONDS))

        for commit, outcome in committed:
            if outcome.conflict is None:
                continue
            if outcome.conflict.reason is ConflictReason.UNKNOWN_REQUEST:
                refusal(commit.request_id).commits.append(commit)
            else:
                log.warning("flush commit of %s refused: %s", outcome.request_id, outcome.conflict)
        for request_id, ok in linked.items():
            if ok:
                del self._unlinked[request_id]
        for write, ok in stored:
            if ok:
                continue
            if write.block.is_full:
                _, unlinked = self._unlinked.setdefault(write.request_id, (now, {}))
                unlinked[write.block_index] = write.block.prefix_hash
                self._unlinked[write.request_id] = (now, unlinked)
            else:
                # Its own copy: the buffer it was sealed in is given back after this round.
                assert isinstance(write.block, EncodedBlock)
                detached = dataclasses.replace(
                    write.block, data=memoryview(bytes(write.block.data))
                )
                refusal(write.request_id).tails.append(dataclasses.replace(write, block=detached))
        for request_id, ok in marked:
            if not ok:
                refusal(request_id).mark = True
        for request_id in flushing & set(self._unlinked):
            refusal(request_id)  # its flush is complete only with those links
        self._keep_refused(refused, now)
        self._forget_unlinked(now)

    def _due_retries(self, now: float) -> dict[str, _Refused]:
        """The refused flushes to try again in this batch (all of them, at most once an
        interval)."""
        if not self._refused or now - self._last_retry < FLUSH_RETRY_INTERVAL_SECONDS:
            return {}
        self._last_retry = now
        retried, self._refused = self._refused, {}
        return retried

    def _keep_refused(self, refused: dict[str, _Refused], now: float) -> None:
        for request_id, entry in refused.items():
            if now >= entry.until:
                log.info(
                    "flush of %s given up: no record of it in the store for %.0f s (it ended)",
                    request_id,
                    FLUSH_RETRY_SECONDS,
                )
                continue
            kept = self._refused.get(request_id)
            if kept is None:
                self._refused[request_id] = entry
            else:
                kept.commits += entry.commits
                kept.tails += entry.tails
                kept.mark = kept.mark or entry.mark

    def _forget_unlinked(self, now: float) -> None:
        """Links of requests refused for long: their records are gone, not late."""
        for request_id, (since, _) in list(self._unlinked.items()):
            if now - since > UNLINKED_BLOCKS_KEEP_SECONDS and request_id not in self._refused:
                del self._unlinked[request_id]

    def _count_round(self) -> None:
        with self._lock:
            self._rounds += 1
            self._settled.notify_all()

    def _count_dropped(self, count: int, why: str, outage: bool = False) -> None:
        with self._lock:
            self._dropped += count
            first_of_outage = outage and not self._unavailable
            if outage:
                self._unavailable = True
            self._settled.notify_all()
        if first_of_outage or not outage:
            log.warning("dropped %d KV block write(s): %s", count, why)
