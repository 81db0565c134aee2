"""The target's side of a PushBlocks call: chunks in, verified blocks staged, a receipt out.

    chunk ─▶ ChunkAssembler ─▶ first chunk: staging.reserve(block bytes)
                             └▶ whole block ─▶ verify (a thread): form, CRC, MAC, key ─▶ stage

A block is staged only once every check passed: the CRC (DATA_LOSS when it fails: the bytes
changed on the way), the MAC under the cluster keyring (INVALID_ARGUMENT: not written by a
holder of the key), and its key: a full block must sit under the content address of the
prefix hash its header carries (store.keys.block_key), a partial one under its request's tail
key. The first refusal ends the call (once the source has sent the rest, which is dropped);
the blocks before it stay staged. What the target's
worker later loads it verifies again against the tokens it holds (store.decode_block).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from context_daemon.block_chunks import Block, BlockChunk, ChunkAssembler
from context_daemon.peer_errors import BadChunk, BlockCorrupted, BlockRefused, PeerError
from context_daemon.peer_staging import PeerStaging
from store import keys
from store.block_codec import verify_sealed
from store.errors import BlockRejected, RejectReason
from store.mac_keyring import MacKeyring

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushReceipt:
    """What one PushBlocks call staged (a block already staged counts: it is shared)."""

    blocks: int
    bytes: int


def verify_pushed(block: Block, keyring: MacKeyring) -> None:
    """Raises BlockCorrupted, BlockRefused or BadChunk unless ``block`` may be staged."""
    try:
        keys.validate_request_id(block.request_id)
    except ValueError as exc:
        raise BadChunk(str(exc)) from exc
    name = f"{block.key} of {block.request_id}"
    try:
        header = verify_sealed(name, block.data, keyring)
    except BlockRejected as rejected:
        error = BlockCorrupted if rejected.reason is RejectReason.CHECKSUM else BlockRefused
        raise error(str(rejected)) from rejected
    if not header.is_full and block.key == keys.request_tail_key(block.request_id):
        return
    # A full block goes under its own key; so may a tail (its hash names every token it holds).
    try:
        block_hash, _ = keys.block_key_parts(block.key)
    except ValueError as exc:
        what = "a full block" if header.is_full else "a partial block"
        raise BlockRefused(
            f"{name}: {what} goes under its own key or its request's tail key ({exc})"
        ) from exc
    if block_hash != header.prefix_hash:
        raise BlockRefused(
            f"{name}: the key names block {block_hash.hex()}, the header {header.prefix_hash.hex()}"
        )


class PeerReceiver:
    """Receives pushed blocks into ``staging``, verified under ``keyring``."""

    def __init__(self, staging: PeerStaging, keyring: MacKeyring) -> None:
        self._staging = staging
        self._keyring = keyring

    async def receive(self, chunks: AsyncIterator[BlockChunk]) -> PushReceipt:
        """Stages every block of one call. Raises a PeerError (its ``staged_blocks``: the
        blocks staged before it) at the first block that may not be staged.

        A block's checks run on a thread while the next block arrives; blocks are staged in
        the order they came, each once its checks passed."""
        staging = self._staging
        reserved = 0  # the bytes reserved for the block being received
        checking: deque[tuple[Block, int, asyncio.Future[None]]] = deque()
        blocks = staged_bytes = 0
        check_failed = False

        def admit(chunk: BlockChunk) -> None:
            nonlocal reserved
            staging.reserve(chunk.block_bytes, f"block {chunk.key} of {chunk.request_id}")
            reserved = chunk.block_bytes

        async def stage_oldest() -> None:
            nonlocal blocks, staged_bytes, check_failed
            block, block_reserved, checked = checking[0]
            try:
                await checked
            except PeerError:
                staging.count_refused()
                check_failed = True
                raise
            checking.popleft()
            staging.stage(block.request_id, block.key, block.data, block_reserved)
            blocks += 1
            staged_bytes += len(block.data)

        assembler = ChunkAssembler(staging.config.max_bytes, admit)
        try:
            async for chunk in chunks:
                block = assembler.add(chunk)
                if block is None:
                    continue
                check = asyncio.to_thread(verify_pushed, block, self._keyring)
                checking.append((block, reserved, asyncio.ensure_future(check)))
                reserved = 0
                if len(checking) > 1:
                    await stage_oldest()
            assembler.finish()
            while checking:
                await stage_oldest()
        except PeerError as refusal:
            error = refusal
            if not check_failed:  # the blocks before the refused one still count
                try:
                    while checking:
                        await stage_oldest()
                except PeerError as earlier:
                    error = earlier
            error.staged_blocks = blocks
            log.warning("a push ended after %d staged blocks: %s", blocks, error)
            # The status goes out once the source has sent everything: a client of gRPC's
            # asyncio API whose write meets a finished call reports INTERNAL instead of the
            # status (grpc/grpc#36066). The source keeps its calls short for this.
            async for _ in chunks:
                pass
            raise error from None
        finally:
            # A block refused, cut off, or whose call was cancelled gives its room back.
            for _, block_reserved, checked in checking:
                checked.cancel()
                staging.release(block_reserved)
            if reserved:
                staging.release(reserved)
        return PushReceipt(blocks, staged_bytes)
