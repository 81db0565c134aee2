"""The connector's write-behind: KV block copies go to Redis on a thread, never on the step.

The engine step only copies a block out of the paged cache into the buffer it will be sent
from (``kv_layout.copy_block``: room for the header, then the KV) and queues it; this thread
seals each buffer in place (header, CRC) and sends batches, one pipelined round trip each,
so a block's bytes are copied once between the cache and the socket. Nothing here ever
blocks the step: a full queue or an unreachable Redis drops the block (counted, logged once
per outage); the block's tokens will simply be recomputed if that request is resumed.

A paused request's flush (its token list, unsaved full blocks and partial tail) is queued
as *required*: it may pass the queue bound, because it is the last chance to save that state.
Batches hold at most KV_WRITE_BATCH_BLOCKS blocks, so the queue order (the flush planner's)
decides which requests are complete first; a batch writes its token commits before its
blocks, and a request's tail after its full blocks, so a stored tail means the blocks before
it were sent.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from context_daemon.store import (
    BlockWrite,
    KVFormat,
    RedisStore,
    StoreError,
    StoreUnavailable,
    TokenCommit,
)
from context_daemon.store.block_codec import EncodedBlock, header_bytes, seal_block
from worker.constants import KV_WRITE_BATCH_BLOCKS
from worker.kv_layout import block_buffer

log = logging.getLogger(__name__)

_STOP = None


@dataclass(frozen=True)
class PendingBlock:
    """A block copied out of the cache, waiting to be written; ``num_tokens`` below the block
    size makes it the request's partial tail. ``data`` is the ``kv_layout.copy_block`` buffer:
    the store's header bytes, still free, then the block's KV."""

    request_id: str
    block_index: int
    prefix_hash: bytes
    data: torch.Tensor
    num_tokens: int = 0  # 0: a full block


_Item = PendingBlock | TokenCommit


class KVBlockWriter:
    """One daemon thread that drains a bounded queue into ``store.put_blocks``."""

    def __init__(self, store: RedisStore, kv_format: KVFormat, max_queued_blocks: int) -> None:
        self._store = store
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
        self._unavailable = False
        self._thread = threading.Thread(target=self._run, name="spot-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, block: PendingBlock, required: bool = False) -> None:
        """Queue a block; an optional one is dropped (counted) when the queue is full. Never
        waits."""
        if not required and self._queue.qsize() >= self._max_queued_blocks:
            self._count_dropped(1, "the write queue is full")
            return
        self._queue.put_nowait(block)

    def submit_tokens(self, commit: TokenCommit) -> None:
        """Queue a token commit (idempotent in the store, so it may overlap earlier ones)."""
        self._queue.put_nowait(commit)

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
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch: list[_Item] = [first]
            blocks = int(isinstance(first, PendingBlock))
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
        block_tokens = self._kv_format.block_tokens
        commits = [item for item in batch if isinstance(item, TokenCommit)]
        encoded: list[tuple[PendingBlock, EncodedBlock]] = [
            (
                pending,
                seal_block(
                    block_buffer(pending.data),
                    self._kv_format,
                    pending.prefix_hash,
                    pending.num_tokens or block_tokens,
                ),
            )
            for pending in batch
            if isinstance(pending, PendingBlock)
        ]
        writes = [
            BlockWrite(pending.request_id, pending.block_index, block) for pending, block in encoded
        ]
        try:
            if commits:
                for outcome in self._store.commit_step(commits):
                    if outcome.conflict is not None:
                        log.warning(
                            "flush commit of %s refused: %s", outcome.request_id, outcome.conflict
                        )
            if writes:
                self._store.put_blocks(writes)
        except StoreUnavailable as exc:
            self._count_dropped(len(writes), f"Redis is unavailable ({exc})", outage=True)
            return
        except StoreError as exc:
            self._count_dropped(len(writes), f"Redis refused the write ({exc})")
            return
        with self._lock:
            self._written += len(writes)
            self._written_bytes += sum(len(block.data) - self._header_bytes for _, block in encoded)
            recovered = self._unavailable
            self._unavailable = False
            self._settled.notify_all()
        if recovered:
            log.warning("KV persistence resumed: Redis answers again")

    def _count_dropped(self, count: int, why: str, outage: bool = False) -> None:
        with self._lock:
            self._dropped += count
            first_of_outage = outage and not self._unavailable
            if outage:
                self._unavailable = True
            self._settled.notify_all()
        if first_of_outage or not outage:
            log.warning("dropped %d KV block write(s): %s", count, why)
