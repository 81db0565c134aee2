"""The hand-off from a worker to its context daemon: what the daemon persists for it.

    worker (each rank)                               context daemon
    ring of block buffers (a memfd, shared) ───────▶ mapped once, at HELLO
    control channel (unix SOCK_SEQPACKET)   ──────▶ BLOCK / TOKENS / NO_KV / PAUSED, in order
                                            ◀────── DONE: slots free again, what was written

The worker copies a block out of its KV cache straight into a free slot of the ring and sends
one small message naming the slot; the daemon seals the slot in place and writes it to Redis
(store/block_codec.py), then gives the slot back. A block too big for a slot, or a required
one (a pause's flush) that finds the ring full, travels in a memfd of its own, passed with
its message. Messages are a kind byte and a JSON body; file descriptors go beside them
(SCM_RIGHTS).

Once a message is sent, it and its bytes are the daemon's: a worker process that dies the
next instant loses nothing of it (the socket keeps what was sent, the memfd lives while the
daemon maps it). Both ends are processes of one node; the socket's directory is the node's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from store.block_codec import KVFormat
from store.redis_store import TokenCommit

MAX_MESSAGE_BYTES = 1 << 20
MAX_FDS = 1


class HandoffError(Exception):
    """The other end broke the hand-off's protocol or went away."""


class Kind(enum.IntEnum):
    HELLO = 1  # worker → daemon: the ring (fd), its geometry, the KV format
    BLOCK = 2  # worker → daemon: a filled slot (or a memfd of its own)
    TOKENS = 3  # worker → daemon: a token commit (a flush's, or a finished request's)
    NO_KV = 4  # worker → daemon: a paused request had no KV to save
    DONE = 5  # daemon → worker: slots to reuse, the writer's totals
    PAUSED = 6  # worker → daemon: a paused request's writes are all handed over (this rank's)


@dataclass(frozen=True)
class Hello:
    kv_format: KVFormat
    slots: int
    slot_bytes: int


@dataclass(frozen=True)
class BlockNote:
    """A block handed over: in ``slot`` of the ring (``-1``: in the memfd sent with it)."""

    slot: int
    nbytes: int
    request_id: str
    block_index: int
    prefix_hash: bytes
    num_tokens: int  # 0: a full block
    required: bool


@dataclass(frozen=True)
class TokensNote:
    commit: TokenCommit
    final: bool


@dataclass(frozen=True)
class NoKVNote:
    request_id: str


@dataclass(frozen=True)
class PausedNote:
    """A paused request's writes are all handed over (by this rank): its KV is
    ``full_blocks`` full blocks and a tail of ``tail_tokens`` (0: none)."""

    request_id: str
    full_blocks: int = 0
    tail_tokens: int = 0


@dataclass(frozen=True)
class Done:
    freed: tuple[int, ...]
    written_blocks: int
    written_bytes: int
    dropped_blocks: int
    pending_blocks: int


Note = Hello | BlockNote | TokensNote | NoKVNote | Done | PausedNote


def address(path: str) -> str:
    """Where a socket named ``path`` lives: a file, or with a leading ``@`` a name in the
    abstract namespace of the network namespace (no file, no length limit of a path: each VM,
    or each network namespace standing in for one, has its own)."""
    return "\0" + path[1:] if path.startswith("@") else path


def connect(path: str, timeout_seconds: float) -> socket.socket:
    """A connected control channel to the daemon listening at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout_seconds)
    try:
        sock.connect(address(path))
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def listener(path: str) -> socket.socket:
    """The daemon's listening control socket at ``path`` (a stale one is replaced). A file
    is for this user alone; either kind, the daemon accepts only its own user's processes
    (`peer_uid`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if path.startswith("@"):
        sock.bind(address(path))
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock.bind(path)
        os.chmod(path, 0o600)
    sock.listen()
    return sock


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def send(sock: socket.socket, note: Note, fd: int | None = None) -> None:
    body = json.dumps(_encode(note), separators=(",", ":")).encode()
    data = bytes([_kind(note)]) + body
    if fd is None:
        sock.sendall(data)
    else:
        socket.send_fds(sock, [data], [fd])


def receive(sock: socket.socket) -> tuple[Note, int | None] | None:
    """The next note and the fd that came with it; None once the other end closed."""
    raw = receive_raw(sock)
    return None if raw is None else parse(*raw)


def receive_raw(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next message as it came, and its fds; None once the other end closed."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, MAX_FDS)
    except (ConnectionResetError, BrokenPipeError):
        return None
    if not data:
        for fd in fds:
            _close(fd)
        return None
    return data, fds


def parse(data: bytes, fds: list[int]) -> tuple[Note, int | None]:
    """A message as a note (raises HandoffError, closing its fds, when it is none)."""
    try:
        note = _decode(Kind(data[0]), json.loads(data[1:]))
    except (ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            _close(fd)
        raise HandoffError(f"malformed hand-off message: {exc}") from exc
    return note, (fds[0] if fds else None)


def _close(fd: int) -> None:
    os.close(fd)


def _kind(note: Note) -> int:
    kinds: dict[type, Kind] = {
        Hello: Kind.HELLO,
        BlockNote: Kind.BLOCK,
        TokensNote: Kind.TOKENS,
        NoKVNote: Kind.NO_KV,
        Done: Kind.DONE,
        PausedNote: Kind.PAUSED,
    }
    return int(kinds[type(note)])


def _encode(note: Note) -> dict[str, Any]:
    if isinstance(note, Hello):
        return {
            "kv_format": dataclasses.asdict(note.kv_format),
            "slots": note.slots,
            "slot_bytes": note.slot_bytes,
        }
    if isinstance(note, BlockNote):
        fields = dataclasses.asdict(note)
        fields["prefix_hash"] = note.prefix_hash.hex()
        return fields
    if isinstance(note, TokensNote):
        commit = note.commit
        return {
            "request_id": commit.request_id,
            "start_index": commit.start_index,
            "token_ids": list(commit.token_ids),
            "final": note.final,
        }
    if isinstance(note, NoKVNote):
        return {"request_id": note.request_id}
    if isinstance(note, PausedNote):
        return dataclasses.asdict(note)
    fields = dataclasses.asdict(note)
    fields["freed"] = list(note.freed)
    return fields


def _decode(kind: Kind, body: dict[str, Any]) -> Note:
    if kind is Kind.HELLO:
        return Hello(KVFormat(**body["kv_format"]), int(body["slots"]), int(body["slot_bytes"]))
    if kind is Kind.BLOCK:
        return BlockNote(
            slot=int(body["slot"]),
            nbytes=int(body["nbytes"]),
            request_id=str(body["request_id"]),
            block_index=int(body["block_index"]),
            prefix_hash=bytes.fromhex(body["prefix_hash"]),
            num_tokens=int(body["num_tokens"]),
            required=bool(body["required"]),
        )
    if kind is Kind.TOKENS:
        commit = TokenCommit(
            str(body["request_id"]),
            int(body["start_index"]),
            tuple(int(t) for t in body["token_ids"]),
        )
        return TokensNote(commit, bool(body["final"]))
    if kind is Kind.NO_KV:
        return NoKVNote(str(body["request_id"]))
    if kind is Kind.PAUSED:
        return PausedNote(
            str(body["request_id"]), int(body["full_blocks"]), int(body["tail_tokens"])
        )
    return Done(
        freed=tuple(int(s) for s in body["freed"]),
        written_blocks=int(body["written_blocks"]),
        written_bytes=int(body["written_bytes"]),
        dropped_blocks=int(body["dropped_blocks"]),
        pending_blocks=int(body["pending_blocks"]),
    )
