"""The connector's write-behind: KV block copies go to Redis on a thread, never on the step.

The engine step only copies a block out of the paged cache (microseconds) and queues it;
this thread encodes and sends whole batches, one pipelined round trip each. Nothing here
ever blocks the step: a full queue or an unreachable Redis drops the block (counted, logged
once per outage); the block's tokens will simply be recomputed if that request is resumed.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from context_daemon.store import (
    BlockWrite,
    KVBlock,
    KVFormat,
    RedisStore,
    StoreError,
    StoreUnavailable,
)
from worker.kv_layout import block_payload

log = logging.getLogger(__name__)

_STOP = None


@dataclass(frozen=True)
class PendingBlock:
    """A full block copied out of the cache, waiting to be written."""

    request_id: str
    block_index: int
    prefix_hash: bytes
    data: torch.Tensor


class KVBlockWriter:
    """One daemon thread that drains a bounded queue into ``store.put_blocks``."""

    def __init__(self, store: RedisStore, kv_format: KVFormat, max_queued_blocks: int) -> None:
        self._store = store
        self._kv_format = kv_format
        self._queue: queue.Queue[PendingBlock | None] = queue.Queue(max_queued_blocks)
        self._lock = threading.Lock()
        self._written = 0
        self._dropped = 0
        self._unavailable = False
        self._thread = threading.Thread(target=self._run, name="spot-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, block: PendingBlock) -> None:
        """Queue a block; drop it (counted) when the queue is full. Never waits."""
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            self._count_dropped(1, "the write queue is full")

    @property
    def written_blocks(self) -> int:
        with self._lock:
            return self._written

    @property
    def dropped_blocks(self) -> int:
        with self._lock:
            return self._dropped

    def close(self, timeout_seconds: float) -> None:
        """Stop after the queued blocks are sent (or dropped); wait at most ``timeout_seconds``."""
        try:
            self._queue.put(_STOP, timeout=timeout_seconds)
        except queue.Full:
            return
        self._thread.join(timeout_seconds)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            self._write(batch)
            if stop:
                return

    def _write(self, batch: list[PendingBlock]) -> None:
        block_tokens = self._kv_format.block_tokens
        writes = [
            BlockWrite(
                request_id=pending.request_id,
                block_index=pending.block_index,
                block=KVBlock(
                    kv_format=self._kv_format,
                    prefix_hash=pending.prefix_hash,
                    num_tokens=block_tokens,
                    payload=block_payload(pending.data),
                ),
            )
            for pending in batch
        ]
        try:
            self._store.put_blocks(writes)
        except StoreUnavailable as exc:
            self._count_dropped(len(batch), f"Redis is unavailable ({exc})", outage=True)
            return
        except StoreError as exc:
            self._count_dropped(len(batch), f"Redis refused the write ({exc})")
            return
        with self._lock:
            self._written += len(batch)
            recovered = self._unavailable
            self._unavailable = False
        if recovered:
            log.warning("KV persistence resumed: Redis answers again")

    def _count_dropped(self, count: int, why: str, outage: bool = False) -> None:
        with self._lock:
            self._dropped += count
            first_of_outage = outage and not self._unavailable
            if outage:
                self._unavailable = True
        if first_of_outage or not outage:
            log.warning("dropped %d KV block write(s): %s", count, why)
