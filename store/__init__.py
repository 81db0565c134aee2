"""The Redis store: request records, committed tokens and content-addressed KV blocks.

``keys`` spells every key; ``block_codec`` names and encodes blocks; ``lua_scripts`` holds
the atomic server-side steps; ``redis_link`` sends command batches and translates failures;
``redis_store`` is the API the daemon uses, on Redis or Redis Cluster alike; ``protocol``
names the record-and-token part the coordinator and the token committer call, which
``memory_store`` also implements (in a dict, for unit tests).
"""

from store.batch_memory_store import MemoryBatchStore
from store.batch_store import BatchStore, RedisBatchStore
from store.block_codec import (
    BlockSummary,
    KVBlock,
    KVFormat,
    block_hashes,
    tail_hash,
)
from store.block_refs import BlockRead, BlockWrite, block_reads
from store.errors import (
    BlockRejected,
    CommitConflict,
    ConflictReason,
    InvalidTransition,
    RecordRejected,
    RejectReason,
    RequestExists,
    RequestNotFound,
    StoreError,
    StoreUnavailable,
)
from store.memory_store import MemoryStore
from store.protocol import RequestStore
from store.redis_store import CommitOutcome, RedisStore, TokenCommit
from store.request_record import RequestRecord, RequestStatus
from store.store_config import StoreConfig

__all__ = [
    "BatchStore",
    "MemoryBatchStore",
    "RedisBatchStore",
    "BlockRead",
    "BlockRejected",
    "BlockSummary",
    "BlockWrite",
    "CommitConflict",
    "CommitOutcome",
    "ConflictReason",
    "InvalidTransition",
    "KVBlock",
    "KVFormat",
    "RecordRejected",
    "MemoryStore",
    "RedisStore",
    "RejectReason",
    "RequestExists",
    "RequestNotFound",
    "RequestRecord",
    "RequestStatus",
    "RequestStore",
    "StoreConfig",
    "StoreError",
    "StoreUnavailable",
    "TokenCommit",
    "block_hashes",
    "block_reads",
    "tail_hash",
]
