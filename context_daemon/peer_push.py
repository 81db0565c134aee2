"""The source's side of peer migration: push KV blocks straight to the target's daemon.

    blocks ──spread by bytes──▶ stream 0 ──channel 0 (its own TCP flow)──▶ ┐
                                stream 1 ──channel 1─────────────────────▶ ├ target daemon:
                                ...                                         │ PushBlocks,
                                stream N-1 ──channel N-1─────────────────▶ ┘ staged in memory

One TCP flow tops out well below what a VM's network carries (AWS: ~5 Gbps a flow), so a
source pushes over several streams at once, each on a channel of its own. A stream sends its
blocks in PushBlocks calls of about `PEER_CALL_BYTES` each, one after the other; a call stages
its blocks in the order it sends them. A call that fails (a refused block, the target out of
room or gone, the deadline) ends its stream: its blocks the target had staged count (its
trailing metadata says how many; a broken connection says nothing, and then none do), the
rest of the stream's blocks fail. Redis stays the durable copy: the caller reads the failed
ones from there. Proto messages stop here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from context_daemon.block_chunks import Block, split_block
from context_daemon.constants import (
    DEFAULT_PEER_STREAMS,
    MAX_PEER_CHUNK_BYTES,
    PEER_CALL_BYTES,
    PEER_CHUNK_BYTES,
    PUSH_ACCEPTED_METADATA,
    STAGED_BLOCKS_METADATA_KEY,
)
from protos.spotinfer.v1 import daemon_pb2, daemon_pb2_grpc

PeerBlock = Block
"""A block to push: its request, its store key (store.keys) and its stored bytes."""


@dataclass
class PushOutcome:
    """What one push achieved: per request, the keys the target staged and those it did not
    (read those from the store); why streams failed."""

    staged: dict[str, list[str]] = field(default_factory=dict)
    failed: dict[str, list[str]] = field(default_factory=dict)
    staged_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def staged_blocks(self) -> int:
        return sum(len(keys) for keys in self.staged.values())

    @property
    def complete(self) -> bool:
        return not self.failed

    def _add(self, blocks: Sequence[Block], staged: int) -> None:
        for position, block in enumerate(blocks):
            into = self.staged if position < staged else self.failed
            into.setdefault(block.request_id, []).append(block.key)
        self.staged_bytes += sum(len(block.data) for block in blocks[:staged])


def spread(blocks: Sequence[Block], streams: int) -> list[list[Block]]:
    """``blocks`` over ``streams`` lists, each block to the one with the fewest bytes so far
    (round robin for blocks of one size); the order within a stream is the given order."""
    lanes: list[list[Block]] = [[] for _ in range(streams)]
    loads = [0] * streams
    for block in blocks:
        lane = loads.index(min(loads))
        lanes[lane].append(block)
        loads[lane] += len(block.data)
    return [lane for lane in lanes if lane]


def calls(blocks: Sequence[Block], call_bytes: int) -> list[Sequence[Block]]:
    """``blocks`` in order, cut into runs of about ``call_bytes`` (at least one block each)."""
    runs: list[Sequence[Block]] = []
    start = size = 0
    for end, block in enumerate(blocks):
        if size and size + len(block.data) > call_bytes:
            runs.append(blocks[start:end])
            start, size = end, 0
        size += len(block.data)
    if start < len(blocks):
        runs.append(blocks[start:])
    return runs


def _messages(blocks: Sequence[Block], chunk_bytes: int) -> Iterator[daemon_pb2.KvBlockChunk]:
    for block in blocks:
        for chunk in split_block(block, chunk_bytes):
            yield daemon_pb2.KvBlockChunk(
                request_id=chunk.request_id,
                block_key=chunk.key,
                data=bytes(chunk.data),
                last=chunk.last,
                offset=chunk.offset,
                block_bytes=chunk.block_bytes,
            )


def _staged_before(error: grpc.aio.AioRpcError) -> int:
    """How many blocks the target says it staged before the call failed (0: it did not say)."""
    for key, value in error.trailing_metadata() or ():
        if key == STAGED_BLOCKS_METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() else 0
    return 0


class PeerPusher:
    """Pushes blocks to the daemon at ``address`` over ``streams`` channels (opened once,
    reused by every push; `close` them). ``transport``: the daemon's mutual TLS (a daemon
    certificate: the target takes pushes from daemons only). Make it on the event loop that
    pushes: gRPC's asyncio channels belong to one loop."""

    def __init__(
        self,
        address: str,
        transport: TransportConfig = PLAINTEXT,
        streams: int = DEFAULT_PEER_STREAMS,
        chunk_bytes: int = PEER_CHUNK_BYTES,
        call_bytes: int = PEER_CALL_BYTES,
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        if not 0 < chunk_bytes <= MAX_PEER_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_PEER_CHUNK_BYTES}")
        self.address = address
        self.streams = streams
        self._chunk_bytes = chunk_bytes
        self._call_bytes = call_bytes
        self._channels = [
            async_channel(address, transport=transport, own_connection=True) for _ in range(streams)
        ]
        self._stubs = [daemon_pb2_grpc.ContextDaemonStub(channel) for channel in self._channels]

    async def push(self, blocks: Sequence[PeerBlock], timeout_seconds: float) -> PushOutcome:
        """Pushes ``blocks`` within ``timeout_seconds``; never raises for what the target or
        the network did (see `PushOutcome`)."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_seconds
        lanes = spread(blocks, self.streams)
        results = await asyncio.gather(
            *(
                self._push_lane(stub, lane, deadline)
                for stub, lane in zip(self._stubs[: len(lanes)], lanes, strict=True)
            )
        )
        outcome = PushOutcome()
        for lane, (staged, error) in zip(lanes, results, strict=True):
            outcome._add(lane, staged)
            if error:
                outcome.errors.append(error)
        outcome.seconds = time.perf_counter() - start
        return outcome

    async def _push_lane(
        self, stub: daemon_pb2_grpc.ContextDaemonStub, blocks: Sequence[Block], deadline: float
    ) -> tuple[int, str]:
        """(leading blocks staged, "" or why the stream stopped there)."""
        staged = 0
        for call in calls(blocks, self._call_bytes):
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return staged, "DEADLINE_EXCEEDED: no time left to push"
            try:
                response = await self._push_call(stub, call, timeout)
            except grpc.aio.AioRpcError as error:
                staged += _staged_before(error)
                return staged, f"{error.code().name}: {error.details()}"
            if response.blocks != len(call):  # a target that answers OK stages every block
                return staged, f"the target staged {response.blocks} of {len(call)} blocks"
            staged += len(call)
        return staged, ""

    async def _push_call(
        self, stub: daemon_pb2_grpc.ContextDaemonStub, blocks: Sequence[Block], timeout: float
    ) -> daemon_pb2.PushBlocksResponse:
        """One PushBlocks call. Nothing is written before the target's headers: a call it
        refuses at once (authorization) ends there, and the target ends the others only
        after the last write. A write that meets a finished call would hide the target's
        status behind INTERNAL (gRPC's asyncio client, grpc/grpc#36066)."""
        call = stub.PushBlocks(timeout=timeout)
        if PUSH_ACCEPTED_METADATA in tuple(await call.initial_metadata()):
            try:
                for message in _messages(blocks, self._chunk_bytes):
                    await call.write(message)
                await call.done_writing()
            except Exception:  # noqa: BLE001 - the call ended (deadline, network); its status says why
                pass
        return await call  # a refused or failed call: raises with its status

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> PeerPusher:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
