"""What the daemon keeps of the KV its worker handed over, to move a request to a peer.

Every block the worker hands over (persister.py) is written to Redis and its ring slot given
back; a copy stays here, per request, so that on a notice the daemon can push a request's
whole KV to the target's daemon without reading anything back from Redis (which may be the
thing that is failing, or simply the slower path). A pause's PAUSED note says how many full
blocks and tail tokens the request's KV makes: once every rank said so and every one of those
blocks is here, the request can move peer to peer.

Bounded by bytes: the least recently touched requests go first (a request that ended is never
touched again). Thread-safe: every connection's reader thread adds, the event loop reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from store import KVFormat


@dataclass(frozen=True)
class MirroredBlock:
    kv_format: KVFormat  # its rank's: the shard suffix and the layout it is sealed with
    block_index: int
    prefix_hash: bytes
    num_tokens: int  # 0: a full block
    data: bytes  # the hand-over buffer: header room, then the KV


@dataclass
class _Request:
    blocks: dict[tuple[str, int], MirroredBlock] = field(default_factory=dict)
    paused: dict[str, tuple[int, int]] = field(default_factory=dict)  # shard -> (full, tail)
    nbytes: int = 0


class BlockMirror:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must not be negative")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._bytes = 0
        self.evicted_requests = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def add(self, request_id: str, block: MirroredBlock) -> None:
        """Keeps a copy of a handed-over block (a later one of the same place replaces it: a
        tail a later pause wrote again)."""
        if not self.max_bytes or len(block.data) > self.max_bytes:
            return
        with self._lock:
            request = self._requests.setdefault(request_id, _Request())
            self._requests.move_to_end(request_id)
            place = (block.kv_format.shard, block.block_index)
            old = request.blocks.get(place)
            if old is not None:
                request.nbytes -= len(old.data)
                self._bytes -= len(old.data)
            request.blocks[place] = block
            request.nbytes += len(block.data)
            self._bytes += len(block.data)
            self._evict(keep=request_id)

    def paused(self, request_id: str, shard: str, full_blocks: int, tail_tokens: int) -> None:
        with self._lock:
            request = self._requests.setdefault(request_id, _Request())
            request.paused[shard] = (full_blocks, tail_tokens)

    def pause_of(self, request_id: str, shards: int) -> tuple[int, int] | None:
        """(full blocks, tail tokens) once ``shards`` ranks said the pause is handed over."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or len(request.paused) < shards:
                return None
            return next(iter(request.paused.values()))

    def blocks(self, request_id: str) -> list[MirroredBlock] | None:
        """Every block of the paused request's KV, each rank's, in order; None when one is
        missing here (evicted, or dropped on a full ring): it moves through Redis then."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or not request.paused:
                return None
            out: list[MirroredBlock] = []
            for shard, (full_blocks, tail_tokens) in sorted(request.paused.items()):
                for index in range(full_blocks + (1 if tail_tokens else 0)):
                    block = request.blocks.get((shard, index))
                    if block is None:
                        return None
                    if index == full_blocks and block.num_tokens != tail_tokens:
                        return None  # the tail of an earlier pause
                    out.append(block)
            return out

    def drop(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._bytes -= request.nbytes

    def _evict(self, keep: str) -> None:
        while self._bytes > self.max_bytes and len(self._requests) > 1:
            oldest = next(iter(self._requests))
            if oldest == keep:
                self._requests.move_to_end(oldest)
                oldest = next(iter(self._requests))
            self._bytes -= self._requests.pop(oldest).nbytes
            self.evicted_requests += 1
