"""The daemon's write-behind: it persists what its worker hands over (store/handoff.py).

    worker rank ──unix socket + shared ring──▶ Connection ──▶ BlockWriter (hold on outage)
                ◀──────────── DONE (slots free, totals) ───────┘                 │
                                                                                 ▼ Redis

One `Connection` per worker process (each tensor-parallel rank has its own), each with the
store's block writer (store/block_writer.py) over the ring the worker mapped. The daemon owns
the write queue: a batch that meets an unreachable Redis is held and tried again, not dropped
(the worker's ring, full, is what bounds it); a worker that dies leaves behind every message
it sent, which is read to the end and written (`settle` waits for that: the coordinator calls
it before a lost worker's requests resume elsewhere).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable

import torch

from context_daemon.block_mirror import BlockMirror, MirroredBlock
from store import KVFormat, RedisStore, handoff
from store.block_writer import KVBlockWriter, PendingBlock
from store.handoff import BlockNote, Done, Hello, NoKVNote, PausedNote, TokensNote
from store.handoff_calls import CALLS_HELLO, serve_call

log = logging.getLogger(__name__)

# How long a connection whose worker went away keeps trying to write what it left (Redis may
# be down): an AWS notice's two minutes.
DRAIN_SECONDS = 120.0
SETTLE_POLL_SECONDS = 0.01
# The writer's own bound never drops a handed-over block: the ring bounds them.
QUEUE_MARGIN_BLOCKS = 1024


class Connection:
    """One worker process's hand-off: its ring, its writer, its messages in order."""

    def __init__(
        self,
        sock: socket.socket,
        store: RedisStore,
        on_end: Callable[[Connection], None],
        mirror: BlockMirror | None = None,
    ) -> None:
        self._sock = sock
        self._store = store
        self._on_end = on_end
        self._mirror = mirror
        self.kv_format: KVFormat | None = None
        self._send_lock = threading.Lock()
        self._writer: KVBlockWriter | None = None
        self._ring: torch.Tensor | None = None
        self._slot_bytes = 0
        self._slots = 0
        self._base = 0
        self.peer_gone = False
        self.ended = False
        self._thread = threading.Thread(target=self._run, name="spot-persister", daemon=True)
        self._thread.start()

    @property
    def pending_blocks(self) -> int:
        return self._writer.pending_blocks if self._writer is not None else 0

    @property
    def written_blocks(self) -> int:
        return self._writer.written_blocks if self._writer is not None else 0

    @property
    def written_bytes(self) -> int:
        return self._writer.written_bytes if self._writer is not None else 0

    def unread(self) -> bool:
        """Whether a message waits on the socket (the reader has not taken it yet)."""
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return False
        except OSError:
            return False

    def settled(self) -> bool:
        """Everything received is written (or dropped) and nothing more waits to be read."""
        if self.ended:
            return True
        if self.peer_gone:
            return False  # still writing what the worker left
        return self.pending_blocks == 0 and not self.unread()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=DRAIN_SECONDS)

    def _run(self) -> None:
        try:
            self._serve()
        except (OSError, handoff.HandoffError, ValueError) as exc:
            log.error("KV hand-off from the worker failed: %s", exc)
        finally:
            self.peer_gone = True
            if self._writer is not None:
                self._writer.close(DRAIN_SECONDS)
                if self._writer.pending_blocks:
                    log.error(
                        "%d handed-over KV block(s) not written: Redis did not answer for %.0f s",
                        self._writer.pending_blocks,
                        DRAIN_SECONDS,
                    )
            self._sock.close()
            self.ended = True
            self._on_end(self)

    def _serve(self) -> None:
        raw = handoff.receive_raw(self._sock)
        if raw is None:
            return
        if raw[0] == CALLS_HELLO:
            self._serve_calls()
            return
        hello, fd = handoff.parse(*raw)
        if not isinstance(hello, Hello) or fd is None:
            raise handoff.HandoffError("the hand-off must start with HELLO and the ring")
        try:
            ring = mmap.mmap(fd, hello.slots * hello.slot_bytes)
        finally:
            os.close(fd)
        self._ring = torch.frombuffer(ring, dtype=torch.uint8)
        self._base = self._ring.data_ptr()
        self._slot_bytes, self._slots = hello.slot_bytes, hello.slots
        self.kv_format = hello.kv_format
        self._writer = KVBlockWriter(
            self._store,
            hello.kv_format,
            hello.slots + QUEUE_MARGIN_BLOCKS,
            hold_on_outage=True,
            on_round=self._done,
        )
        log.info(
            "a worker hands KV over: %d slots of %d bytes (%s)",
            hello.slots,
            hello.slot_bytes,
            hello.kv_format.layout,
        )
        while (received := handoff.receive(self._sock)) is not None:
            note, fd = received
            if isinstance(note, BlockNote):
                self._block(note, fd)
                continue
            if fd is not None:
                os.close(fd)
            if isinstance(note, TokensNote):
                self._writer.submit_tokens(note.commit, note.final)
                if note.final and self._mirror is not None:
                    self._mirror.drop(note.commit.request_id)  # it ended
            elif isinstance(note, NoKVNote):
                self._writer.submit_no_kv(note.request_id)
            elif isinstance(note, PausedNote) and self._mirror is not None:
                self._mirror.paused(
                    note.request_id, hello.kv_format.shard, note.full_blocks, note.tail_tokens
                )

    def _serve_calls(self) -> None:
        """The worker's token committer: its store calls, carried out one by one in order."""
        log.info("the worker's token commits come through this daemon")
        while raw := handoff.receive_raw(self._sock):
            data, fds = raw
            for fd in fds:
                os.close(fd)
            reply = serve_call(data, self._store)
            with contextlib.suppress(OSError):  # a dead worker's last call is done all the same
                self._sock.sendall(reply)

    def _block(self, note: BlockNote, fd: int | None) -> None:
        assert self._writer is not None and self._ring is not None
        if note.slot >= 0:
            if fd is not None:
                os.close(fd)
            if note.slot >= self._slots or note.nbytes > self._slot_bytes:
                raise handoff.HandoffError(
                    f"slot {note.slot} ({note.nbytes} bytes) is not in the ring"
                )
            start = note.slot * self._slot_bytes
            data = self._ring[start : start + note.nbytes]
        else:
            if fd is None:
                raise handoff.HandoffError("a block outside the ring came without its memfd")
            try:
                data = torch.frombuffer(mmap.mmap(fd, note.nbytes), dtype=torch.uint8)
            finally:
                os.close(fd)
        if self._mirror is not None and self.kv_format is not None:
            self._mirror.add(
                note.request_id,
                MirroredBlock(
                    self.kv_format,
                    note.block_index,
                    note.prefix_hash,
                    note.num_tokens,
                    data.numpy().tobytes(),
                ),
            )
        self._writer.submit(
            PendingBlock(
                request_id=note.request_id,
                block_index=note.block_index,
                prefix_hash=note.prefix_hash,
                data=data,
                num_tokens=note.num_tokens,
            ),
            required=note.required,
        )

    def _done(self, blocks: list[PendingBlock]) -> None:
        """The writer is done with these: their slots go back to the worker."""
        freed = []
        for block in blocks:
            offset = block.data.data_ptr() - self._base
            if 0 <= offset < self._slots * self._slot_bytes:
                freed.append(offset // self._slot_bytes)
        writer = self._writer
        assert writer is not None
        totals = Done(
            tuple(freed),
            writer.written_blocks,
            writer.written_bytes,
            writer.dropped_blocks,
            writer.pending_blocks,
        )
        if self.peer_gone:
            return
        try:
            with self._send_lock:
                handoff.send(self._sock, totals)
        except OSError:
            pass  # the worker is gone; what it handed over is written all the same


class Persister:
    """Listens at ``socket_path`` for the node's worker processes; writes what they hand over."""

    def __init__(
        self, socket_path: str, store: RedisStore, mirror: BlockMirror | None = None
    ) -> None:
        self.socket_path = socket_path
        self._store = store
        self.mirror = mirror
        self._lock = threading.Lock()
        self._connections: list[Connection] = []
        self._ended_written = (0, 0)
        self._listener = handoff.listener(socket_path)
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="spot-handoff", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    @property
    def ranks(self) -> int:
        """Worker processes handing over now (each tensor-parallel rank is one)."""
        with self._lock:
            return sum(1 for c in self._connections if c.kv_format is not None and not c.peer_gone)

    @property
    def pending_blocks(self) -> int:
        with self._lock:
            return sum(c.pending_blocks for c in self._connections)

    @property
    def written_blocks(self) -> int:
        with self._lock:
            return self._ended_written[0] + sum(c.written_blocks for c in self._connections)

    @property
    def written_bytes(self) -> int:
        with self._lock:
            return self._ended_written[1] + sum(c.written_bytes for c in self._connections)

    def settle(self, timeout_seconds: float) -> bool:
        """Wait until everything handed over so far is written; False on timeout."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            with self._lock:
                connections = list(self._connections)
            if all(c.settled() for c in connections):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(SETTLE_POLL_SECONDS)

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()
        if not self.socket_path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if handoff.peer_uid(sock) != os.getuid():
                log.warning("refused a hand-off connection from another user's process")
                sock.close()
                continue
            with self._lock:
                self._connections.append(Connection(sock, self._store, self._ended, self.mirror))

    def _ended(self, connection: Connection) -> None:
        with self._lock:
            if connection in self._connections:
                self._connections.remove(connection)
                written, nbytes = self._ended_written
                self._ended_written = (
                    written + connection.written_blocks,
                    nbytes + connection.written_bytes,
                )
