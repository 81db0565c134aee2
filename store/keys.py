"""The Redis key schema: the one place that spells a key.

Every key starts with a versioned prefix. The part inside ``{…}`` is the Redis Cluster hash
tag: only it decides the slot. All keys of one request carry ``{request_id}``, so they live
in one slot and a Lua script may touch them together; a full KV block is content-addressed
and shared by every request with the same prefix, so it carries its own hash as its tag and
blocks spread over the cluster.

::

    key                                 type    holds                                   expiry
    ----------------------------------  ------  --------------------------------------  ------------------
    si:v1:req:{<request_id>}:meta       HASH    the request record (fields below)       request TTL, reset
                                                                                        on every commit;
                                                                                        retention at end
    si:v1:req:{<request_id>}:tokens     STRING  committed token ids, packed uint32 LE,  as meta
                                                index i at byte offset 4*i
    si:v1:req:{<request_id>}:blocks     HASH    block index -> hex block hash of every  as meta
                                                full KV block persisted for the request
    si:v1:req:{<request_id>}:tail       STRING  the partial last KV block (header +      as meta
                                                payload); not content-addressed
    si:v1:req:{<request_id>}:tails      HASH    the other shards' tails (below): shard  as meta
                                                suffix -> tail, suffix + "#header" ->
                                                its header bytes
    si:v1:req:{<request_id>}:route      HASH    the coordinator's record: owner worker, own TTL, set by
                                                status, delivered length                the coordinator
    si:v1:blk:{<block_hash_hex>}        STRING  one full KV block (header + payload),   block TTL, reset
                                                shared by all requests with its prefix  when referenced
    si:v1:blk:{<block_hash_hex>}:s<t>.<p>       the shard of tensor-parallel rank t,    as the block
                                                pipeline stage p (not 0.0) of a sharded
                                                worker's block
    si:v1:file:{<file_id>}:meta         HASH    an uploaded or a batch's output file:   none (deleted
                                                id, tenant, filename, purpose, bytes,   by an operator)
                                                created_at
    si:v1:file:{<file_id>}:content      STRING  the file's bytes (JSONL)                as meta
    si:v1:batch:{<batch_id>}:meta       HASH    a batch job (coordinator/batch_jobs.py) none
    si:v1:batch:{<batch_id>}:lines      HASH    custom_id -> the line's latest attempt  as meta
                                                (its request id, JSON)
    si:v1:batch:{<batch_id>}:results    HASH    custom_id -> the line's output line;    as meta
                                                written once (HSETNX, with its count)
    si:v1:batch:{<batch_id>}:lease      STRING  the coordinator running the job         lease TTL
    si:v1:batches:{index}               ZSET    every batch id, scored by created_at    none
    si:v1:batches:{active}              SET     the batch ids not yet in a final state  none

    meta fields: request_id, model_fingerprint, prompt_token_ids (packed uint32 LE),
    sampling_params (JSON), status, owner_worker_id, committed_length, created_unix_ms,
    updated_unix_ms, kv_block_tokens, paused_without_kv ("1" after a pause that found none
    of its KV computed, until it runs again)

A worker whose KV cache is sharded (tensor or pipeline parallel) stores one value per shard:
rank 0 of stage 0 under the plain key, every other shard's full blocks under the plain key plus
its suffix (``shard_suffix``; the block's hash tag is unchanged, so all shards of a block share
a slot) and its tail as a field of the request's ``tails`` hash, so the request's lifecycle
(its TTL, its end, its deletion) covers every shard.
A reader of another degree reads the plain key and refuses it by its layout string
(``tp=0/2``), never another rank's bytes.

Request ids may not contain ``{``, ``}`` or whitespace and may not be empty: an empty tag or a
brace inside it would move keys of one request to different slots.
"""

from __future__ import annotations

import enum
import re

from store.constants import KEY_PREFIX


class KeyKind(enum.Enum):
    """Every kind of key of the schema; store/acl.py grants each to the roles that use it."""

    META = "meta"
    TOKENS = "tokens"
    BLOCKS = "blocks"
    TAIL = "tail"
    TAILS = "tails"
    ROUTE = "route"
    BLOCK = "blk"
    FILE_META = "file-meta"
    FILE_CONTENT = "file-content"
    BATCH_META = "batch-meta"
    BATCH_LINES = "batch-lines"
    BATCH_RESULTS = "batch-results"
    BATCH_LEASE = "batch-lease"
    BATCH_INDEX = "batch-index"
    BATCH_ACTIVE = "batch-active"


# The batch kinds: (family, part) of "<prefix><family>:{<id>}:<part>"; the two sets carry a
# fixed tag instead of an id.
_BATCH_KEY_PARTS = {
    KeyKind.FILE_META: ("file", "meta"),
    KeyKind.FILE_CONTENT: ("file", "content"),
    KeyKind.BATCH_META: ("batch", "meta"),
    KeyKind.BATCH_LINES: ("batch", "lines"),
    KeyKind.BATCH_RESULTS: ("batch", "results"),
    KeyKind.BATCH_LEASE: ("batch", "lease"),
}
_BATCH_SET_KEYS = {
    KeyKind.BATCH_INDEX: f"{KEY_PREFIX}batches:{{index}}",
    KeyKind.BATCH_ACTIVE: f"{KEY_PREFIX}batches:{{active}}",
}


def key_pattern(kind: KeyKind) -> str:
    """A Redis glob matching every key of ``kind`` and no key of another kind (request ids
    hold no braces, so ``{*}`` cannot reach past the hash tag)."""
    if kind is KeyKind.BLOCK:
        return f"{KEY_PREFIX}blk:{{*}}*"  # a shard's suffix follows the tag
    if kind in _BATCH_SET_KEYS:
        return _BATCH_SET_KEYS[kind]
    if kind in _BATCH_KEY_PARTS:
        family, part = _BATCH_KEY_PARTS[kind]
        return f"{KEY_PREFIX}{family}:{{*}}:{part}"
    return f"{KEY_PREFIX}req:{{*}}:{kind.value}"


MAX_REQUEST_ID_CHARS = 256
_FORBIDDEN_REQUEST_ID_CHARS = frozenset("{}")
_GLOB_SPECIAL_CHARS = frozenset("*?[]\\")


def validate_request_id(request_id: str) -> None:
    """Raise ValueError for an id that would break the hash-tag rule or the glob used by scans."""
    if not request_id:
        raise ValueError("request_id must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id longer than {MAX_REQUEST_ID_CHARS} characters")
    if any(ch in _FORBIDDEN_REQUEST_ID_CHARS or ch.isspace() for ch in request_id):
        raise ValueError(f"request_id {request_id!r} contains a brace or whitespace")


def _request_key(request_id: str, kind: KeyKind) -> str:
    validate_request_id(request_id)
    return f"{KEY_PREFIX}req:{{{request_id}}}:{kind.value}"


def request_meta_key(request_id: str) -> str:
    return _request_key(request_id, KeyKind.META)


def request_tokens_key(request_id: str) -> str:
    return _request_key(request_id, KeyKind.TOKENS)


def request_blocks_key(request_id: str) -> str:
    return _request_key(request_id, KeyKind.BLOCKS)


def request_tail_key(request_id: str) -> str:
    return _request_key(request_id, KeyKind.TAIL)


def request_tails_key(request_id: str) -> str:
    """The partial tails of a sharded worker's ranks beyond the first (a HASH by shard)."""
    return _request_key(request_id, KeyKind.TAILS)


def shard_tail_header_field(shard: str) -> str:
    """The field of ``request_tails_key`` that holds a shard's tail header alone (what a
    flush check reads, instead of the whole tail)."""
    return shard + "#header"


def shard_suffix(tp_rank: int, pp_rank: int = 0) -> str:
    """What a shard's keys append to the plain key: nothing for rank 0 of stage 0 (and for
    every unsharded worker), ``:s<tp>.<pp>`` for the others."""
    if tp_rank < 0 or pp_rank < 0:
        raise ValueError(f"negative rank: tp {tp_rank}, pp {pp_rank}")
    return f":s{tp_rank}.{pp_rank}" if tp_rank or pp_rank else ""


def shard_suffixes(tp_size: int) -> tuple[str, ...]:
    """Every shard suffix of a worker with ``tp_size`` tensor-parallel ranks, rank order."""
    return tuple(shard_suffix(rank) for rank in range(tp_size))


def request_keys(request_id: str) -> tuple[str, str, str, str, str]:
    """Every key a request owns, in the order the Lua scripts expect them (meta first)."""
    return (
        request_meta_key(request_id),
        request_tokens_key(request_id),
        request_blocks_key(request_id),
        request_tail_key(request_id),
        request_tails_key(request_id),
    )


def request_key_pattern(request_id: str) -> str:
    """A SCAN MATCH pattern for every key of the request, known to this schema or not."""
    validate_request_id(request_id)
    escaped = "".join(f"\\{ch}" if ch in _GLOB_SPECIAL_CHARS else ch for ch in request_id)
    return f"{KEY_PREFIX}req:{{{escaped}}}:*"


def block_key(block_hash: bytes, shard: str = "") -> str:
    """Key of a full, content-addressed KV block; ``shard``: a sharded worker's rank
    (``shard_suffix``)."""
    if not block_hash:
        raise ValueError("block_hash must not be empty")
    return f"{KEY_PREFIX}{KeyKind.BLOCK.value}:{{{block_hash.hex()}}}{shard}"


_SHARD_SUFFIX = re.compile(r"(:s(0|[1-9][0-9]*)\.(0|[1-9][0-9]*))?")


def block_key_parts(key: str) -> tuple[bytes, str]:
    """The block hash and shard suffix a `block_key` was made of (a peer names a pushed block
    by its key); ValueError for a string that no `block_key` call returns."""
    head = f"{KEY_PREFIX}{KeyKind.BLOCK.value}:{{"
    hex_hash, closed, shard = key.removeprefix(head).partition("}")
    try:
        block_hash = bytes.fromhex(hex_hash)
    except ValueError:
        block_hash = b""
    if (
        not key.startswith(head)
        or not closed
        or not block_hash
        or _SHARD_SUFFIX.fullmatch(shard) is None
        or block_key(block_hash, shard) != key
    ):
        raise ValueError(f"{key!r} is not the key of a KV block")
    return block_hash, shard


def schema_pattern() -> str:
    """A SCAN MATCH pattern for every key this schema version owns."""
    return f"{KEY_PREFIX}*"


def request_route_key(request_id: str) -> str:
    """The coordinator's routing record of a request (HASH: coordinator_id, owner_worker_id,
    status, delivered_length, sla_class, updated_unix_ms). Shares the request's hash tag but
    not its lifecycle scripts: the coordinator writes it and sets its own expiry."""
    return _request_key(request_id, KeyKind.ROUTE)


def batch_object_key(kind: KeyKind, object_id: str) -> str:
    """A key of a file or a batch job (``kind`` one of the FILE_* / BATCH_* kinds with an
    id); the id follows the request-id rules (no braces, no whitespace)."""
    validate_request_id(object_id)
    family, part = _BATCH_KEY_PARTS[kind]
    return f"{KEY_PREFIX}{family}:{{{object_id}}}:{part}"


def batch_set_key(kind: KeyKind) -> str:
    """The index of every batch job (BATCH_INDEX) or of the unfinished ones (BATCH_ACTIVE)."""
    return _BATCH_SET_KEYS[kind]
