"""The worker's calls to its own daemon for what peer daemons staged there (FetchStaged,
DropStaged). Proto messages stop here.

    worker's KV load ──FetchStaged(request, keys)──▶ its daemon's staging ──▶ {key: bytes}
                      (keys it does not get: read from the store, as without a peer push)
    resume done / migration aborted ──DropStaged(request)──▶ freed

The bytes are a block's stored form: the worker verifies them as it verifies a Redis read
(store.decode_block against the tokens it holds) before they reach its KV cache. The daemon
takes these calls from its own node's worker only (a worker certificate over a local
connection, common.authz.OWN_WORKER).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from common.channels import PLAINTEXT, TransportConfig, async_channel
from context_daemon.block_chunks import BlockChunk, ChunkAssembler
from context_daemon.peer_staging import DroppedStage
from protos.spotinfer.v1 import daemon_pb2, daemon_pb2_grpc

# A staged block is at most what the daemon may stage; a worker reads below any such cap.
_MAX_BLOCK_BYTES = 1 << 40


class StagingClient:
    """``address``: the node's daemon (``host:port`` on loopback, or ``unix:/path``). Make it
    on the event loop that calls it (gRPC's asyncio channels belong to one loop)."""

    def __init__(self, address: str, transport: TransportConfig = PLAINTEXT) -> None:
        self.address = address
        self._channel = async_channel(address, transport=transport)
        self._stub = daemon_pb2_grpc.ContextDaemonStub(self._channel)

    async def fetch(
        self, request_id: str, keys: Sequence[str] = (), timeout_seconds: float = 30.0
    ) -> dict[str, bytes]:
        """The staged blocks of ``request_id`` that ``keys`` names (all when empty), by key;
        a key that is not staged is absent. Raises grpc.aio.AioRpcError."""
        call = self._stub.FetchStaged(
            daemon_pb2.FetchStagedRequest(request_id=request_id, block_keys=list(keys)),
            timeout=timeout_seconds,
        )
        assembler = ChunkAssembler(_MAX_BLOCK_BYTES)
        blocks: dict[str, bytes] = {}
        async for msg in call:
            block = assembler.add(
                BlockChunk(
                    msg.request_id, msg.block_key, msg.offset, msg.block_bytes, msg.data, msg.last
                )  # fmt: skip
            )
            if block is not None:
                blocks[block.key] = bytes(block.data)
        assembler.finish()
        return blocks

    async def drop(self, request_id: str, timeout_seconds: float = 5.0) -> DroppedStage:
        """Frees what is staged for ``request_id``. Raises grpc.aio.AioRpcError."""
        response = await self._stub.DropStaged(
            daemon_pb2.DropStagedRequest(request_id=request_id), timeout=timeout_seconds
        )
        return DroppedStage(response.blocks, response.bytes)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> StagingClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
