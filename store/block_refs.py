"""What callers hand the store to write or read KV blocks, and how a read list is derived."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from store.block_codec import (
    EncodedBlock,
    KVBlock,
    KVFormat,
    block_hashes,
    tail_hash,
)
from store.keys import block_key, request_tail_key, request_tails_key, validate_request_id


@dataclass(frozen=True)
class BlockWrite:
    """Persist ``block`` as block ``block_index`` of ``request_id``.

    A full block goes to its content-addressed key and is linked to the request; a partial
    block replaces the request's tail. An ``EncodedBlock`` (the writer's, built in place) is
    sent as it is; a ``KVBlock`` is encoded first.
    """

    request_id: str
    block_index: int
    block: KVBlock | EncodedBlock
    shard: str = ""  # a sharded worker's rank (store.keys.shard_suffix)

    def __post_init__(self) -> None:
        validate_request_id(self.request_id)
        if self.block_index < 0:
            raise ValueError("block_index must not be negative")


@dataclass(frozen=True)
class BlockRead:
    """Load block ``block_index`` of ``request_id``, expected to hold the KV of the tokens whose
    chain hash is ``prefix_hash`` (``num_tokens`` of them in this block)."""

    request_id: str
    block_index: int
    prefix_hash: bytes
    num_tokens: int
    is_full: bool
    shard: str = ""  # which rank's shard (store.keys.shard_suffix)

    @property
    def key(self) -> str:
        """Where the value is: a full block's own key, the request's tail, or (the tail of a
        shard beyond the first) the request's ``tails`` hash, field ``shard``."""
        if self.is_full:
            return block_key(self.prefix_hash, self.shard)
        return (
            request_tails_key(self.request_id) if self.shard else request_tail_key(self.request_id)
        )

    @property
    def expected(self) -> tuple[bytes, int]:
        """What the block must hold: (prefix hash, filled tokens), as decode_block takes them."""
        return self.prefix_hash, self.num_tokens

    @property
    def name(self) -> str:
        """How rejections name the block in errors and logs."""
        kind = "block" if self.is_full else "tail"
        return (
            f"{self.request_id}#{self.block_index}{self.shard}"
            f"({kind} {self.prefix_hash.hex()[:12]})"
        )


def block_reads(
    request_id: str,
    kv_format: KVFormat,
    token_ids: Sequence[int],
    include_tail: bool = True,
    tenant: str = "",
) -> list[BlockRead]:
    """Reads for every block that would hold the KV of ``token_ids`` (the chain of
    ``tenant``), from block 0 on, of the shard ``kv_format`` names."""
    block_tokens = kv_format.block_tokens
    reads = [
        BlockRead(request_id, index, prefix_hash, block_tokens, True, kv_format.shard)
        for index, prefix_hash in enumerate(
            block_hashes(kv_format.model_fingerprint, token_ids, block_tokens, tenant)
        )
    ]
    tail = tail_hash(kv_format.model_fingerprint, token_ids, block_tokens, tenant)
    if include_tail and tail is not None:
        reads.append(
            BlockRead(
                request_id,
                len(reads),
                tail,
                len(token_ids) - len(reads) * block_tokens,
                False,
                kv_format.shard,
            )
        )
    return reads
