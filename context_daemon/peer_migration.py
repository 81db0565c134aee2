"""A noticed node's daemon moves its paused requests' KV straight to their targets' daemons.

    Flush(deadline, peer_targets: request -> target daemon)
      worker: Preempt ─▶ pauses, hands the pause's writes over (PAUSED from every rank)
      here:   the mirror holds every block of the request (block_mirror.py)
              ─▶ seal each in the store's form ─▶ PushBlocks to the target's daemon
                 (peer_push.py: several streams) ─▶ staged there for its worker
              ─▶ FlushReport(complete) as soon as the target staged all of it

Redis stays the durable copy: the same blocks are written there as always, and a request
this path cannot move whole (a block missing here, the target out of room or gone) gets no
report from here; the worker's own report (the store's state) decides for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from common.channels import PLAINTEXT, TransportConfig
from common.messages import FlushReport
from context_daemon.block_mirror import BlockMirror, MirroredBlock
from context_daemon.constants import DEFAULT_PEER_STREAMS
from context_daemon.peer_push import PeerBlock, PeerPusher
from store import keys
from store.block_codec import seal_block
from store.mac_keyring import MacKeyring

log = logging.getLogger(__name__)

PAUSE_POLL_SECONDS = 0.01


@dataclass(frozen=True)
class PeerMove:
    """One request's move: its blocks in the store's form, for its target."""

    request_id: str
    target: str
    blocks: list[PeerBlock]
    full_blocks: int
    tail_tokens: int
    block_tokens: int

    @property
    def context_tokens(self) -> int:
        """The tokens whose KV moves (every token but the last, which the target computes)."""
        return self.full_blocks * self.block_tokens + self.tail_tokens


def sealed(request_id: str, block: MirroredBlock, keyring: MacKeyring) -> PeerBlock:
    """A mirrored block in the form the store keeps (header, MAC, CRC), under its key: what
    the target verifies and stages. Full blocks and tails alike are named by content."""
    data = bytearray(block.data)
    num_tokens = block.num_tokens or block.kv_format.block_tokens
    encoded = seal_block(memoryview(data), block.kv_format, block.prefix_hash, num_tokens, keyring)
    key = keys.block_key(block.prefix_hash, block.kv_format.shard)
    return PeerBlock(request_id, key, encoded.data)


class PeerMigrator:
    """``ranks``: how many of the worker's processes hand over (each says PAUSED)."""

    def __init__(
        self,
        mirror: BlockMirror,
        ranks: Callable[[], int],
        keyring: MacKeyring,
        transport: TransportConfig = PLAINTEXT,
        streams: int = DEFAULT_PEER_STREAMS,
    ) -> None:
        self._mirror = mirror
        self._ranks = ranks
        self._keyring = keyring
        self._transport = transport
        self._streams = streams

    async def migrate(
        self, targets: Mapping[str, str], deadline_unix: float, worker_id: str
    ) -> AsyncIterator[FlushReport]:
        """One complete report per request whose whole KV the target staged in time."""
        if not targets:
            return
        moves = await asyncio.gather(
            *(self._move_of(rid, target, deadline_unix) for rid, target in targets.items())
        )
        by_target: dict[str, list[PeerMove]] = {}
        for move in moves:
            if move is not None:
                by_target.setdefault(move.target, []).append(move)
        pushes = [self._push(target, group, deadline_unix) for target, group in by_target.items()]
        for finished in asyncio.as_completed(pushes):
            for move in await finished:
                self._mirror.drop(move.request_id)
                yield FlushReport(
                    request_id=move.request_id,
                    complete=True,
                    committed_tokens=0,
                    persisted_blocks=move.full_blocks,
                    tail_persisted=True,
                    context_tokens=move.context_tokens,
                    worker_id=worker_id,
                )

    async def _move_of(self, request_id: str, target: str, deadline_unix: float) -> PeerMove | None:
        """Waits for the request's pause to be handed over by every rank, then takes its
        blocks from the mirror (None: the pause did not come in time, or a block is missing)."""
        while (pause := self._mirror.pause_of(request_id, max(1, self._ranks()))) is None:
            if time.time() >= deadline_unix:
                log.warning("request %s: its pause never reached this daemon", request_id)
                return None
            await asyncio.sleep(PAUSE_POLL_SECONDS)
        mirrored = self._mirror.blocks(request_id)
        if mirrored is None:
            log.warning(
                "request %s: not all of its KV is held here; it moves through the store",
                request_id,
            )
            return None
        blocks = [sealed(request_id, block, self._keyring) for block in mirrored]
        block_tokens = mirrored[0].kv_format.block_tokens if mirrored else 0
        return PeerMove(request_id, target, blocks, pause[0], pause[1], block_tokens)

    async def _push(
        self, target: str, moves: list[PeerMove], deadline_unix: float
    ) -> list[PeerMove]:
        """The moves whose every block the target staged."""
        blocks = [block for move in moves for block in move.blocks]
        timeout = max(0.1, deadline_unix - time.time())
        started = time.monotonic()
        async with PeerPusher(target, self._transport, self._streams) as pusher:
            outcome = await pusher.push(blocks, timeout)
        done = [move for move in moves if not outcome.failed.get(move.request_id)]
        log.info(
            "pushed %d request(s) to %s: %d blocks, %.1f MB in %.0f ms%s",
            len(done),
            target,
            outcome.staged_blocks,
            outcome.staged_bytes / 1e6,
            1000 * (time.monotonic() - started),
            f"; failed: {'; '.join(outcome.errors)}" if outcome.errors else "",
        )
        return done


async def merged(
    from_worker: AsyncIterator[FlushReport], from_peer: AsyncIterator[FlushReport]
) -> AsyncIterator[FlushReport]:
    """The worker's flush reports (the store's state) and the peer moves' (the target's
    staging), as they come; once a request's report is complete, no other report of it
    follows (the coordinator acts on the first complete one)."""
    queue: asyncio.Queue[FlushReport | None] = asyncio.Queue()

    async def pump(reports: AsyncIterator[FlushReport]) -> None:
        try:
            async for report in reports:
                await queue.put(report)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(from_worker)), asyncio.create_task(pump(from_peer))]
    complete: set[str] = set()
    running = len(tasks)
    try:
        while running:
            report = await queue.get()
            if report is None:
                running -= 1
                continue
            if report.request_id in complete:
                continue
            if report.complete:
                complete.add(report.request_id)
            yield report
        for task in tasks:
            task.result()  # a pump's error surfaces here
    finally:
        for task in tasks:
            task.cancel()
