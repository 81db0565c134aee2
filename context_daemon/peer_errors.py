"""Why a peer's push, or a read of what it staged, is refused; each error says its gRPC status.

    BadChunk        INVALID_ARGUMENT    chunks out of order, lengths that do not add up
    BlockRefused    INVALID_ARGUMENT    malformed, another format version, a MAC that does
                                        not verify, a key that does not name the block
    BlockCorrupted  DATA_LOSS           the CRC does not match: bytes changed on the way
    StagingFull     RESOURCE_EXHAUSTED  the block does not fit the staging cap

A PushBlocks call that ends in one of them keeps the blocks it staged before; the trailing
metadata ``staged-blocks`` says how many (they are staged in the order they were sent).
"""

from __future__ import annotations

import grpc

from common.errors import ServiceError
from context_daemon.constants import STAGED_BLOCKS_METADATA_KEY


class PeerError(ServiceError):
    """Base of the peer transport's refusals; ``staged_blocks``: what the call staged first."""

    staged_blocks: int = 0

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((STAGED_BLOCKS_METADATA_KEY, str(self.staged_blocks)),)


class BadChunk(PeerError, ValueError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    http_type = "invalid_request_error"


class BlockRefused(PeerError):
    """A pushed block that is not a sealed block of this cluster under the key it names."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    http_type = "invalid_request_error"


class BlockCorrupted(PeerError):
    """A pushed block whose checksum fails."""

    grpc_code = grpc.StatusCode.DATA_LOSS
    http_status = 500
    http_type = "internal_error"


class StagingFull(PeerError):
    """The staging area has no room for a block (its cap, less what is staged or arriving)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    http_type = "rate_limit_error"
