"""The connector's writer when the node's context daemon persists for it (store/handoff.py).

    gather ──▶ slot of the ring (shared memory) ──BLOCK──▶ daemon: seal, write, DONE ──▶ slot free

`HandoffWriter` has the writer's interface (store/block_writer.py). While the daemon answers on
its socket, a block is copied out of the cache straight into a free slot of a ring both map,
and one small message hands it over; the daemon owns it from then on, so a crash of this
process loses nothing that was handed over. A full ring drops an optional block (counted, as
a full write queue does); a required one (a pause's flush) or an outsized one travels in a
memfd of its own.

Until the daemon answers (it may start after the worker), and again if it goes away, the
blocks go to a writer in this process instead, and the connection is tried again every
RECONNECT_SECONDS: persistence degrades to worker-owned, never stops.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
from collections import deque

import torch

from common.cpu_affinity import unpin_current_thread
from store import KVFormat, RedisStore, TokenCommit, handoff
from store.block_writer import KVBlockWriter, PendingBlock
from store.handoff import BlockNote, Done, Hello, NoKVNote, PausedNote, TokensNote
from worker.constants import KV_WRITE_QUEUE_BLOCKS

log = logging.getLogger(__name__)

RECONNECT_SECONDS = 1.0
CONNECT_TIMEOUT_SECONDS = 0.5
RING_BYTES = 256 * 1024 * 1024
MIN_SLOTS = 4


class _Link:
    """One connection to the daemon and the ring it maps."""

    def __init__(self, path: str, kv_format: KVFormat, slot_bytes: int, max_slots: int) -> None:
        self.slots = max(MIN_SLOTS, min(max_slots, RING_BYTES // slot_bytes))
        self.slot_bytes = slot_bytes
        self.sock = handoff.connect(path, CONNECT_TIMEOUT_SECONDS)
        fd = os.memfd_create("spotinfer-kv-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.slots * slot_bytes)
            self._map = mmap.mmap(fd, self.slots * slot_bytes)
            handoff.send(self.sock, Hello(kv_format, self.slots, slot_bytes), fd)
        except OSError:
            self.sock.close()
            raise
        finally:
            os.close(fd)
        self.ring = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self.ring.data_ptr()
        self.lock = threading.Lock()
        self.free: deque[int] = deque(range(self.slots))
        self.overflow: dict[int, int] = {}  # buffer address -> its memfd
        self.totals = Done((), 0, 0, 0, 0)
        self.alive = True
        self._reader = threading.Thread(target=self._read, name="spot-kv-handoff", daemon=True)
        self._reader.start()

    def slot_of(self, data: torch.Tensor) -> int | None:
        offset = data.data_ptr() - self.base
        if 0 <= offset < self.slots * self.slot_bytes:
            return offset // self.slot_bytes
        return None

    def buffer(self, nbytes: int, required: bool) -> torch.Tensor | None:
        if nbytes <= self.slot_bytes:
            with self.lock:
                slot = self.free.popleft() if self.free else None
            if slot is not None:
                start = slot * self.slot_bytes
                return self.ring[start : start + nbytes]
        if not required and nbytes <= self.slot_bytes:
            return None
        fd = os.memfd_create("spotinfer-kv-block", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        data = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        with self.lock:
            self.overflow[data.data_ptr()] = fd
        return data

    def owns(self, data: torch.Tensor) -> bool:
        with self.lock:
            return self.slot_of(data) is not None or data.data_ptr() in self.overflow

    def submit(self, block: PendingBlock, required: bool) -> None:
        slot = self.slot_of(block.data)
        fd = None
        if slot is None:
            with self.lock:
                fd = self.overflow.pop(block.data.data_ptr())
        note = BlockNote(
            slot=-1 if slot is None else slot,
            nbytes=block.data.numel(),
            request_id=block.request_id,
            block_index=block.block_index,
            prefix_hash=block.prefix_hash,
            num_tokens=block.num_tokens,
            required=required,
        )
        try:
            handoff.send(self.sock, note, fd)
        finally:
            if fd is not None:
                os.close(fd)

    def send(self, note: TokensNote | NoKVNote | PausedNote) -> None:
        handoff.send(self.sock, note)

    def close(self) -> None:
        self.alive = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(timeout=1.0)

    def _read(self) -> None:
        unpin_current_thread()
        try:
            while (received := handoff.receive(self.sock)) is not None:
                note, fd = received
                if fd is not None:
                    os.close(fd)
                if isinstance(note, Done):
                    with self.lock:
                        self.free.extend(note.freed)
                        self.totals = note
        except (OSError, handoff.HandoffError) as exc:
            if self.alive:
                log.warning("the context daemon's hand-off broke: %s", exc)
        self.alive = False


class HandoffWriter:
    """The writer (store/block_writer.py's interface) that hands blocks to the node's daemon."""

    def __init__(
        self,
        socket_path: str,
        store: RedisStore,
        kv_format: KVFormat,
        slot_bytes: int,
        max_slots: int,
    ) -> None:
        self._path = socket_path
        self._store = store
        self._kv_format = kv_format
        self._slot_bytes = slot_bytes
        self._max_slots = max_slots
        self._local: KVBlockWriter | None = None
        self._link: _Link | None = None
        self._gone = Done((), 0, 0, 0, 0)  # totals of links that ended
        self._dropped = 0
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._connect()

    @property
    def handed_over(self) -> bool:
        """Whether the daemon takes the blocks now."""
        return self._live() is not None

    def buffer(self, nbytes: int, required: bool = False) -> torch.Tensor | None:
        link = self._live()
        if link is None:
            return self._fallback().buffer(nbytes, required)
        data = link.buffer(nbytes, required)
        if data is None:
            with self._lock:
                self._dropped += 1
                first = self._dropped == 1 or self._dropped % 100 == 0
            if first:
                log.warning(
                    "dropped a KV block: the daemon's ring is full (%d so far)", self._dropped
                )
        return data

    def submit(self, block: PendingBlock, required: bool = False) -> None:
        link = self._link
        if link is not None and link.owns(block.data):
            try:
                link.submit(block, required)
                return
            except OSError as exc:
                self._lost(link, exc)
                with self._lock:
                    self._dropped += 1
                return
        self._fallback().submit(block, required)

    def submit_tokens(self, commit: TokenCommit, final: bool = False) -> None:
        if not self._send(TokensNote(commit, final)):
            self._fallback().submit_tokens(commit, final)

    def submit_no_kv(self, request_id: str) -> None:
        if not self._send(NoKVNote(request_id)):
            self._fallback().submit_no_kv(request_id)

    def submit_paused(self, request_id: str, full_blocks: int, tail_tokens: int) -> None:
        self._send(PausedNote(request_id, full_blocks, tail_tokens))

    @property
    def written_blocks(self) -> int:
        return self._total("written_blocks", "written_blocks")

    @property
    def written_bytes(self) -> int:
        return self._total("written_bytes", "written_bytes")

    @property
    def dropped_blocks(self) -> int:
        with self._lock:
            dropped = self._dropped
        return dropped + self._total("dropped_blocks", "dropped_blocks")

    def close(self, timeout_seconds: float) -> None:
        if self._link is not None:
            self._link.close()
        if self._local is not None:
            self._local.close(timeout_seconds)

    def _total(self, field: str, local_field: str) -> int:
        link = self._link
        total = getattr(self._gone, field)
        if link is not None:
            with link.lock:
                total += getattr(link.totals, field)
        if self._local is not None:
            total += getattr(self._local, local_field)
        return int(total)

    def _send(self, note: TokensNote | NoKVNote | PausedNote) -> bool:
        link = self._live()
        if link is None:
            return False
        try:
            link.send(note)
        except OSError as exc:
            self._lost(link, exc)
            return False
        return True

    def _live(self) -> _Link | None:
        link = self._link
        if link is not None and not link.alive:
            self._lost(link, None)
            link = None
        if link is None and time.monotonic() >= self._next_try:
            link = self._connect()
        return link

    def _connect(self) -> _Link | None:
        self._next_try = time.monotonic() + RECONNECT_SECONDS
        try:
            self._link = _Link(self._path, self._kv_format, self._slot_bytes, self._max_slots)
        except OSError as exc:
            if self._local is None:
                log.info(
                    "the context daemon does not take KV writes yet (%s at %s); "
                    "this process writes them until it does",
                    exc,
                    self._path,
                )
            return None
        log.info(
            "KV writes go to the context daemon (%s): a ring of %d slots of %d bytes",
            self._path,
            self._link.slots,
            self._slot_bytes,
        )
        return self._link

    def _lost(self, link: _Link, exc: OSError | None) -> None:
        if self._link is not link:
            return
        self._link = None
        with link.lock:
            totals = link.totals
        self._gone = Done(
            (),
            self._gone.written_blocks + totals.written_blocks,
            self._gone.written_bytes + totals.written_bytes,
            self._gone.dropped_blocks + totals.dropped_blocks,
            0,
        )
        link.close()
        log.warning(
            "the context daemon stopped taking KV writes%s; this process writes them",
            f" ({exc})" if exc else "",
        )

    def _fallback(self) -> KVBlockWriter:
        if self._local is None:
            self._local = KVBlockWriter(self._store, self._kv_format, KV_WRITE_QUEUE_BLOCKS)
        return self._local
