"""RedisStore: request records, committed tokens and KV blocks in Redis or Redis Cluster.

Every method is one round trip (a pipeline when it touches several keys or requests), so an
engine step costs one network wait no matter how many requests it advanced. Redis being
unreachable surfaces as StoreUnavailable within the socket timeout; nothing here retries
in a loop, because the caller (the write-behind persister) decides what to drop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from store import keys
from store.block_codec import (
    HEADER_FIXED_BYTES,
    BlockSummary,
    EncodedBlock,
    KVBlock,
    KVFormat,
    decode_block,
    encoded_block,
    pack_token_ids,
    read_summary,
    unpack_token_ids,
)
from store.block_refs import BlockRead, BlockWrite
from store.constants import RECORD_MAC_FIELD, TOKEN_ID_BYTES
from store.errors import (
    BlockRejected,
    CommitConflict,
    ConflictReason,
    InvalidTransition,
    RecordRejected,
    RequestExists,
    RequestNotFound,
    StoreUnavailable,
)
from store.eviction import check_eviction_policy
from store.lua_scripts import (
    ATTACH_BLOCK,
    COMMIT_TOKENS,
    CREATE_REQUEST,
    FINISH_REQUEST,
    MARK_PAUSED_WITHOUT_KV,
    PUT_SHARD_TAIL,
    PUT_TAIL,
    RELEASE_REQUEST,
    SET_STATUS,
    ScriptCode,
)
from store.mac_keyring import MacKeyring, keyring_for
from store.redis_link import Command, RedisClient, RedisLink, ValuesMoved, connect, evalsha
from store.request_record import (
    ALLOWED_PREVIOUS,
    RequestRecord,
    RequestStatus,
    record_mac,
    record_verifies,
)
from store.store_config import StoreConfig
from store.streamed_reads import PayloadAt, read_blocks_into, write_blocks

log = logging.getLogger(__name__)

_CONFLICT_BY_CODE = {
    ScriptCode.GAP: ConflictReason.GAP,
    ScriptCode.MISMATCH: ConflictReason.MISMATCH,
    ScriptCode.NO_RECORD: ConflictReason.UNKNOWN_REQUEST,
    ScriptCode.ENDED: ConflictReason.REQUEST_ENDED,
}


@dataclass(frozen=True)
class TokenCommit:
    """Tokens ``[start_index, start_index + len(token_ids))`` of one request's output."""

    request_id: str
    start_index: int
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        keys.validate_request_id(self.request_id)
        if self.start_index < 0:
            raise ValueError("start_index must not be negative")


@dataclass(frozen=True)
class CommitOutcome:
    """Result of one TokenCommit: the committed length after it, or why it was refused."""

    request_id: str
    committed_length: int
    conflict: CommitConflict | None = None


@dataclass(frozen=True)
class RequestView:
    """A request as the store holds it at one moment (see RedisStore.request_views)."""

    record: RequestRecord
    committed_tokens: list[int]
    tail: BlockSummary | None
    """The header of the stored partial tail, unverified; None when there is none."""


def _status_result(
    request_id: str, code: int, before: bytes, wanted: RequestStatus
) -> RequestStatus:
    """The status before a script's move; raises what its code says went wrong."""
    if code == ScriptCode.NO_RECORD:
        raise RequestNotFound(request_id)
    if code == ScriptCode.BAD_TRANSITION:
        raise InvalidTransition(request_id, before.decode(), wanted.value)
    return RequestStatus(before.decode())


def _finish_args(
    config: StoreConfig, status: RequestStatus, finish_reason: str, now_ms: int
) -> list[Any]:
    """FINISH_REQUEST's arguments: the keys are deleted, or kept ``retention_seconds`` with
    ``status`` and ``finish_reason`` (a FinishReason name); a FINISHED request nobody released
    yet (`RedisStore.release_request`) keeps them ``undelivered_retention_seconds`` if longer."""
    if not status.is_terminal:
        raise ValueError(f"{status} is not a terminal status")
    hold = config.undelivered_retention_seconds if status is RequestStatus.FINISHED else 0
    allowed = (previous.value for previous in ALLOWED_PREVIOUS[status])
    return [status.value, now_ms, config.retention_seconds, hold, finish_reason, *allowed]


def _put_tail(write: BlockWrite, encoded: EncodedBlock, ttl_seconds: int) -> Command:
    """The write of a partial tail: the request's tail, or a field of its ``tails`` hash for
    a shard beyond the first (with its header beside it: what a flush check reads)."""
    meta = keys.request_meta_key(write.request_id)
    if not write.shard:
        tail = keys.request_tail_key(write.request_id)
        return evalsha(PUT_TAIL, [meta, tail], [encoded.data, ttl_seconds])
    return evalsha(
        PUT_SHARD_TAIL,
        [meta, keys.request_tails_key(write.request_id)],
        [write.shard, encoded.data, HEADER_FIXED_BYTES, ttl_seconds],
    )


def _shard_view_commands(
    wanted: Mapping[str, Sequence[bytes]], shards: Sequence[str]
) -> list[Command]:
    commands: list[Command] = []
    for request_id, hashes in wanted.items():
        for shard in shards:
            commands += [("EXISTS", keys.block_key(h, shard)) for h in hashes]
            if shard:
                tails = keys.request_tails_key(request_id)
                commands.append(("HGET", tails, keys.shard_tail_header_field(shard)))
            else:
                tail = keys.request_tail_key(request_id)
                commands.append(("GETRANGE", tail, 0, HEADER_FIXED_BYTES - 1))
    return commands


def _shard_views_from(
    results: Iterator[Any], wanted: Mapping[str, Sequence[bytes]], shards: Sequence[str]
) -> dict[str, list[tuple[int, BlockSummary | None]]]:
    views: dict[str, list[tuple[int, BlockSummary | None]]] = {}
    for request_id, hashes in wanted.items():
        views[request_id] = []
        for _ in shards:
            present = [bool(next(results)) for _ in hashes]
            run = present.index(False) if False in present else len(present)
            views[request_id].append((run, read_summary(next(results) or None)))
    return views


def _read_commands(reads: Sequence[BlockRead], block_ttl_seconds: int) -> list[Command]:
    """The command that reads each block: a full block's GETEX (restarting its TTL: a
    referenced prefix stays), a tail's GET, a shard's tail's HGET."""
    return [
        ("GETEX", read.key, "EX", block_ttl_seconds)
        if read.is_full
        else ("HGET", read.key, read.shard)
        if read.shard
        else ("GET", read.key)
        for read in reads
    ]


def _decoded(
    read: BlockRead, data: bytes | None, kv_format: KVFormat, keyring: MacKeyring
) -> KVBlock | BlockRejected:
    try:
        return decode_block(read.name, data, kv_format, *read.expected, keyring)
    except BlockRejected as rejected:
        return rejected


def _stored_form(block: KVBlock | EncodedBlock, keyring: MacKeyring) -> EncodedBlock:
    return block if isinstance(block, EncodedBlock) else encoded_block(block, keyring)


def _verified(keyring: MacKeyring, request_id: str, fields: Mapping[bytes, bytes]) -> bool:
    """Whether a stored record carries a valid MAC; one that does not is logged."""
    if record_verifies(keyring, fields):
        return True
    log.warning("the record of %s fails its MAC; ignored", request_id)
    return False


class RedisStore:
    """The daemon's view of Redis. See keys.py for the key schema.

    ``client`` must return bytes (``decode_responses=False``); use ``from_url`` to get one with
    the short timeouts the decode loop relies on. ``clock`` returns unix seconds.
    """

    def __init__(
        self,
        client: RedisClient,
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.time,
        keyring: MacKeyring | None = None,
    ) -> None:
        self._link = RedisLink(client)
        self._config = config or StoreConfig()
        self._clock = clock
        self._keyring = keyring or keyring_for(self._config.mac_key_file)

    @classmethod
    def from_url(
        cls,
        url: str,
        cluster: bool = False,
        config: StoreConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> RedisStore:
        """A store on ``url`` (any node's URL when ``cluster``); see redis_link.connect."""
        return cls(connect(url, cluster, config or StoreConfig()), config, clock)

    @classmethod
    def from_config(cls, config: StoreConfig, clock: Callable[[], float] = time.time) -> RedisStore:
        """A store on ``config.url`` as ``config`` says (cluster mode, expiry, timeouts, TLS,
        ACL user, MAC keyring); ValueError where ``config.check_exposure`` refuses it."""
        config.check_exposure()
        return cls.from_url(config.url, config.cluster, config, clock)

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def keyring(self) -> MacKeyring:
        """The MAC keys blocks and records are signed and verified with."""
        return self._keyring

    def close(self) -> None:
        self._link.close()

    # --- availability ---------------------------------------------------------------------

    def ping(self) -> None:
        """Raise StoreUnavailable unless Redis answers."""
        self._link.ping()

    def check_eviction_policy(self) -> None:
        """Raises EvictingStore when Redis may evict keys (see store/eviction.py)."""
        check_eviction_policy(self._link, self._config.url)

    def is_available(self) -> bool:
        try:
            self.ping()
        except StoreUnavailable:
            return False
        return True

    # --- request records ------------------------------------------------------------------

    def create_request(self, record: RequestRecord) -> None:
        """Store a new record; raise RequestExists if the id is taken."""
        now_ms = self._now_ms()
        fields = record.to_fields()
        fields["created_unix_ms"] = record.created_unix_ms or now_ms
        fields["updated_unix_ms"] = now_ms
        fields[RECORD_MAC_FIELD] = record_mac(self._keyring, fields)
        args: list[Any] = [self._config.request_ttl_seconds]
        for name, value in fields.items():
            args += [name, value]
        meta_key = keys.request_meta_key(record.request_id)
        (code,) = self._run([evalsha(CREATE_REQUEST, [meta_key], args)])
        if code == ScriptCode.EXISTS:
            raise RequestExists(record.request_id)

    def get_request(self, request_id: str) -> RequestRecord:
        fields, block_hashes = self._run(
            [
                ("HGETALL", keys.request_meta_key(request_id)),
                ("HGETALL", keys.request_blocks_key(request_id)),
            ]
        )
        if not fields:
            raise RequestNotFound(request_id)
        if not _verified(self._keyring, request_id, fields):
            raise RecordRejected(request_id)
        return RequestRecord.from_fields(fields, block_hashes)

    def update_status(
        self, request_id: str, status: RequestStatus, owner_worker_id: str | None = None
    ) -> RequestStatus:
        """Move the request to ``status`` (and to a new owner when given); return the old status.

        Raises RequestNotFound, or InvalidTransition for a move the lifecycle forbids.
        """
        if status.is_terminal:
            raise ValueError("use finish_request for a terminal status")
        args = [
            status.value,
            self._now_ms(),
            "1" if owner_worker_id is not None else "0",
            owner_worker_id or "",
            *(previous.value for previous in ALLOWED_PREVIOUS[status]),
        ]
        ((code, before),) = self._run(
            [evalsha(SET_STATUS, [keys.request_meta_key(request_id)], args)]
        )
        return _status_result(request_id, code, before, status)

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED,
        finish_reason: str = "",
    ) -> bool:
        """End the request (see `_finish_args`); False when no record exists (deleted or
        expired), so a retried finish is harmless. Shared KV blocks are not touched: other
        requests may use them; they expire."""
        args = _finish_args(self._config, status, finish_reason, self._now_ms())
        ((code, before),) = self._run(
            [evalsha(FINISH_REQUEST, keys.request_keys(request_id), args)]
        )
        if code == ScriptCode.NO_RECORD:
            return False
        _status_result(request_id, code, before, status)
        return True

    def release_request(self, request_id: str) -> bool:
        """The request's client got its end: an ended request keeps its keys for
        ``retention_seconds`` only (0 deletes them); a live one is marked so that its finish
        does. False when no record exists."""
        args = [self._config.retention_seconds]
        ((code, _),) = self._run([evalsha(RELEASE_REQUEST, keys.request_keys(request_id), args)])
        return bool(code == ScriptCode.OK)

    def mark_paused_without_kv(self, request_ids: Sequence[str]) -> list[bool]:
        """Record that the pause of each request found none of its KV computed (its flush
        owes no blocks and no tail), in one round trip; True per request whose live record
        took the mark. A worker running it again clears it (update_status to RUNNING)."""
        if not request_ids:
            return []
        results = self._run(
            [
                evalsha(MARK_PAUSED_WITHOUT_KV, [keys.request_meta_key(request_id)], [])
                for request_id in request_ids
            ]
        )
        return [result == ScriptCode.OK for result in results]

    def delete_request(self, request_id: str) -> int:
        """Delete every key of the request at once; return how many existed."""
        (deleted,) = self._run([("DEL", *keys.request_keys(request_id))])
        return int(deleted)

    def keys_for_request(self, request_id: str) -> list[str]:
        """Every key in Redis that belongs to the request (by SCAN, for leak checks)."""
        found = self._link.scan(keys.request_key_pattern(request_id))
        return sorted(key.decode() for key in found)

    # --- committed tokens -----------------------------------------------------------------

    def commit(self, request_id: str, start_index: int, token_ids: Sequence[int]) -> int:
        """Commit one range; return the committed length, raise CommitConflict if refused."""
        (outcome,) = self.commit_step([TokenCommit(request_id, start_index, tuple(token_ids))])
        if outcome.conflict is not None:
            raise outcome.conflict
        return outcome.committed_length

    def commit_step(self, commits: Sequence[TokenCommit]) -> list[CommitOutcome]:
        """Commit the new tokens of one engine step, for any number of requests, in one round trip.

        Each commit is applied atomically and independently: safe to retry in any order, it
        never duplicates, reorders or leaves a gap; a refused commit writes nothing and comes
        back with its conflict (the others still apply). Every commit restarts the request's
        abandonment TTL.
        """
        now_ms = self._now_ms()
        ttl = self._config.request_ttl_seconds
        commands = [
            evalsha(
                COMMIT_TOKENS,
                keys.request_keys(commit.request_id),
                [commit.start_index, pack_token_ids(commit.token_ids), ttl, now_ms],
            )
            for commit in commits
        ]
        outcomes = []
        for commit, (code, length) in zip(commits, self._run(commands), strict=True):
            conflict = None
            if code != ScriptCode.OK:
                reason = _CONFLICT_BY_CODE[ScriptCode(code)]
                conflict = CommitConflict(commit.request_id, reason, int(length))
            outcomes.append(CommitOutcome(commit.request_id, int(length), conflict))
        return outcomes

    def committed_tokens(self, request_id: str, start_index: int = 0) -> list[int]:
        """Committed token ids from ``start_index`` on."""
        width = TOKEN_ID_BYTES
        exists, data = self._run(
            [
                ("EXISTS", keys.request_meta_key(request_id)),
                ("GETRANGE", keys.request_tokens_key(request_id), start_index * width, -1),
            ]
        )
        if not exists:
            raise RequestNotFound(request_id)
        return unpack_token_ids(data)

    # --- KV blocks ------------------------------------------------------------------------

    def put_blocks(self, writes: Sequence[BlockWrite]) -> list[bool]:
        """Persist many blocks in one round trip; True per write that is linked to a live record.

        The pipeline holds, in this order: a plain SET per full block (its content-addressed
        key), one ATTACH_BLOCK script per request naming all of that request's full blocks of
        the batch, then the tails (PUT_TAIL), so on one node a link never names a block that
        was not sent and a stored tail means the full blocks before it were. Writing an
        existing full block again restarts its TTL. A write for a request whose record is gone
        stores the shared block (it expires) but no per-request key.
        """
        config = self._config
        sets: list[Command] = []
        links: dict[str, list[Any]] = {}
        tails: list[Command] = []
        for write in writes:
            encoded = _stored_form(write.block, self._keyring)
            if encoded.is_full:
                sets.append(
                    (
                        "SET",
                        keys.block_key(encoded.prefix_hash, write.shard),
                        encoded.data,
                        "EX",
                        config.block_ttl_seconds,
                    )
                )
                pairs = links.setdefault(write.request_id, [])
                pairs += [write.block_index, encoded.prefix_hash.hex()]
            else:
                tails.append(_put_tail(write, encoded, config.request_ttl_seconds))
        attaches = [
            evalsha(
                ATTACH_BLOCK,
                [keys.request_meta_key(request_id), keys.request_blocks_key(request_id)],
                [config.request_ttl_seconds, *pairs],
            )
            for request_id, pairs in links.items()
        ]
        results = self._run([*sets, *attaches, *tails])
        link_results = results[len(sets) : len(sets) + len(attaches)]
        linked_by_request = {
            request_id: result == ScriptCode.OK
            for request_id, result in zip(links, link_results, strict=True)
        }
        tail_results = iter(results[len(sets) + len(attaches) :])
        return [
            linked_by_request[write.request_id]
            if write.block.is_full
            else next(tail_results) == ScriptCode.OK
            for write in writes
        ]

    def link_blocks(self, links: Mapping[str, Sequence[tuple[int, bytes]]]) -> dict[str, bool]:
        """Link stored full blocks (block index, block hash) to their requests, one ATTACH per
        request in one round trip, as put_blocks does; True per request whose record took
        them. For blocks written while their record did not exist yet."""
        request_ids = [request_id for request_id, pairs in links.items() if pairs]
        if not request_ids:
            return {}
        ttl = self._config.request_ttl_seconds
        results = self._run(
            [
                evalsha(
                    ATTACH_BLOCK,
                    [keys.request_meta_key(request_id), keys.request_blocks_key(request_id)],
                    [ttl, *(v for index, h in links[request_id] for v in (index, h.hex()))],
                )
                for request_id in request_ids
            ]
        )
        return {
            request_id: result == ScriptCode.OK
            for request_id, result in zip(request_ids, results, strict=True)
        }

    def get_blocks(
        self, reads: Sequence[BlockRead], kv_format: KVFormat
    ) -> list[KVBlock | BlockRejected]:
        """Load and verify blocks in one round trip; a failed check comes back as BlockRejected.

        Reading a full block restarts its TTL: a referenced prefix stays.
        """
        replies = self._run(_read_commands(reads, self._config.block_ttl_seconds))
        return [
            _decoded(read, data, kv_format, self._keyring)
            for read, data in zip(reads, replies, strict=True)
        ]

    def get_blocks_into(
        self, reads: Sequence[BlockRead], kv_format: KVFormat, out: BinaryIO
    ) -> list[PayloadAt | BlockRejected]:
        """get_blocks, each verified payload written to ``out`` as it comes off the socket
        (store.streamed_reads). A stale cluster slot map (a resharding) is read again and
        the blocks read whole, which follows the moves: ``out`` rewritten from its start."""
        start = out.tell()
        commands = _read_commands(reads, self._config.block_ttl_seconds)
        try:
            return read_blocks_into(self._link, commands, reads, kv_format, self._keyring, out)
        except ValuesMoved as moved:
            log.info("%s; reading these blocks whole", moved)
            self._link.refresh_slots()
        out.seek(start)
        return write_blocks(self.get_blocks(reads, kv_format), out)

    def get_block_values(
        self, block_hashes: Sequence[bytes], shard: str = ""
    ) -> list[bytes | None]:
        """The stored bytes of full blocks (of one shard), unverified (None where absent), in
        one round trip; for a copy that is verified where it is used (a migration target's
        staging). Restarts their TTL like get_blocks."""
        return list(
            self._run(
                [
                    ("GETEX", keys.block_key(h, shard), "EX", self._config.block_ttl_seconds)
                    for h in block_hashes
                ]
            )
        )

    def blocks_present(self, block_hashes: Sequence[bytes], shard: str = "") -> list[bool]:
        """Which full blocks (of one shard) exist (unverified: a cheap probe for how much
        prefix is stored)."""
        results = self._run([("EXISTS", keys.block_key(h, shard)) for h in block_hashes])
        return [bool(result) for result in results]

    def shard_views(
        self, wanted: Mapping[str, Sequence[bytes]], shards: Sequence[str]
    ) -> dict[str, list[tuple[int, BlockSummary | None]]]:
        """For each request (id -> the hashes of its full blocks) and each of ``shards``: how
        many of those blocks lead the shard's stored run, and its tail's header (unverified),
        in one round trip. What a sharded worker's flush owes beyond the links."""
        results = self._run(_shard_view_commands(wanted, shards))
        return _shard_views_from(iter(results), wanted, shards)

    def request_views(self, request_ids: Sequence[str]) -> dict[str, RequestView | None]:
        """Each request's record, committed tokens and stored tail header (None: no record),
        all in one round trip: cheap enough to poll while a pause's flush lands."""
        commands: list[Command] = []
        for request_id in request_ids:
            commands += [
                ("HGETALL", keys.request_meta_key(request_id)),
                ("HGETALL", keys.request_blocks_key(request_id)),
                ("GET", keys.request_tokens_key(request_id)),
                ("GETRANGE", keys.request_tail_key(request_id), 0, HEADER_FIXED_BYTES - 1),
            ]
        results = self._run(commands)
        views: dict[str, RequestView | None] = {}
        for position, request_id in enumerate(request_ids):
            fields, block_hashes, tokens, tail = results[4 * position : 4 * position + 4]
            if fields and not _verified(self._keyring, request_id, fields):
                fields = {}  # not written by a holder of the key: as good as none
            views[request_id] = (
                RequestView(
                    RequestRecord.from_fields(fields, block_hashes),
                    unpack_token_ids(tokens or b""),
                    read_summary(tail or None),
                )
                if fields
                else None
            )
        return views

    def block_ttl_seconds(self, block_hash: bytes) -> int:
        """Remaining lifetime of a full block (-2: absent, -1: no expiry)."""
        (ttl,) = self._run([("TTL", keys.block_key(block_hash))])
        return int(ttl)

    def request_ttl_seconds(self, request_id: str) -> dict[str, int]:
        """Remaining lifetime of each existing key of the request."""
        request_keys = keys.request_keys(request_id)
        ttls = self._run([("TTL", key) for key in request_keys])
        return {key: int(ttl) for key, ttl in zip(request_keys, ttls, strict=True) if ttl != -2}

    # --- plumbing -------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _run(self, commands: Sequence[Command]) -> list[Any]:
        return self._link.run(commands)


def refuse_evicting_store(config: StoreConfig) -> None:
    """At a process's start: raises EvictingStore (a UserError too) when the store on
    ``config`` may evict request records; see store/eviction.py. A store it cannot reach,
    or a configuration the process will refuse anyway, is left to the process."""
    try:
        store = RedisStore.from_config(config)
    except (StoreUnavailable, ValueError, OSError) as exc:
        log.warning("could not check Redis's eviction policy: %s", exc)
        return
    try:
        store.check_eviction_policy()
    finally:
        store.close()
