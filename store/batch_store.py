"""The Batch API's state in the store: uploaded files, batch jobs, each line's attempt and
each line's result, written once.

    file  ─ meta (HASH) + content (STRING)
    batch ─ meta (HASH: the job's fields and counters)
          ─ lines   (HASH custom_id -> the line's latest attempt: its request id)
          ─ results (HASH custom_id -> the line's output line; HSETNX: written once)
          ─ lease   (STRING: the coordinator that runs the job, with a TTL)
    batches:{index} (ZSET by created_at), batches:{active} (SET of unfinished ids)

The job's meaning (statuses, validation, OpenAI's shapes) is the coordinator's
(coordinator/batch_jobs.py); here are only fields. `BatchStore` is the protocol the
coordinator's runner takes; `RedisBatchStore` runs, `MemoryBatchStore`
(batch_memory_store.py) is its twin for unit tests. Every method raises StoreUnavailable
when Redis cannot be reached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from store import keys
from store.keys import KeyKind
from store.lua_scripts import PUT_BATCH_RESULT, TAKE_BATCH_LEASE, ScriptCode
from store.redis_link import RedisClient, RedisLink, connect, evalsha
from store.store_config import StoreConfig


class BatchStore(Protocol):
    def put_file(self, file_id: str, meta: Mapping[str, str], content: bytes) -> None:
        """Stores a new file (its id is new: ids are random, or derived from a job)."""
        ...

    def file_meta(self, file_id: str) -> dict[str, str] | None: ...

    def file_content(self, file_id: str) -> bytes | None: ...

    def create_batch(self, batch_id: str, fields: Mapping[str, str], created_at: int) -> None:
        """The job's fields, in the index and among the active jobs."""
        ...

    def batch(self, batch_id: str) -> dict[str, str] | None: ...

    def update_batch(self, batch_id: str, fields: Mapping[str, str], final: bool = False) -> None:
        """Sets fields; ``final``: the job leaves the active set (nothing runs it again)."""
        ...

    def batch_ids(self) -> list[str]:
        """Every job, newest first."""
        ...

    def active_batch_ids(self) -> list[str]: ...

    def put_result(self, batch_id: str, custom_id: str, line: str, counter: str) -> bool:
        """Writes the line's result unless one is there, and then only adds 1 to the job's
        field ``counter``, atomically; False (nothing written) when it had one."""
        ...

    def results(self, batch_id: str) -> dict[str, str]: ...

    def result_ids(self, batch_id: str) -> set[str]: ...

    def note_attempt(self, batch_id: str, custom_id: str, attempt: str) -> None: ...

    def attempts(self, batch_id: str) -> dict[str, str]: ...

    def add_to_counters(self, batch_id: str, amounts: Mapping[str, int]) -> None: ...

    def take_lease(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        """True when ``owner`` holds the job's lease for ``ttl_ms`` now (it was free, had
        expired, or was its own); False while another owner holds it."""
        ...


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _texts(fields: Mapping[bytes, bytes]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in fields.items()}


class RedisBatchStore:
    """The BatchStore on Redis (standalone or Cluster: each job's keys share its hash tag;
    the two sets live where their own tags put them)."""

    def __init__(self, client: RedisClient) -> None:
        self._link = RedisLink(client)

    @classmethod
    def from_config(cls, config: StoreConfig) -> RedisBatchStore:
        config.check_exposure()
        return cls(connect(config.url, config.cluster, config))

    def close(self) -> None:
        self._link.close()

    def put_file(self, file_id: str, meta: Mapping[str, str], content: bytes) -> None:
        content_key = keys.batch_object_key(KeyKind.FILE_CONTENT, file_id)
        meta_key = keys.batch_object_key(KeyKind.FILE_META, file_id)
        # Content first: a file whose meta exists always has its bytes.
        self._link.run([("SET", content_key, content)])
        self._link.run([("HSET", meta_key, *[x for kv in meta.items() for x in kv])])

    def file_meta(self, file_id: str) -> dict[str, str] | None:
        (fields,) = self._link.run([("HGETALL", keys.batch_object_key(KeyKind.FILE_META, file_id))])
        return _texts(fields) if fields else None

    def file_content(self, file_id: str) -> bytes | None:
        (data,) = self._link.run([("GET", keys.batch_object_key(KeyKind.FILE_CONTENT, file_id))])
        return bytes(data) if data is not None else None

    def create_batch(self, batch_id: str, fields: Mapping[str, str], created_at: int) -> None:
        meta_key = keys.batch_object_key(KeyKind.BATCH_META, batch_id)
        self._link.run([("HSET", meta_key, *[x for kv in fields.items() for x in kv])])
        self._link.run(
            [
                ("SADD", keys.batch_set_key(KeyKind.BATCH_ACTIVE), batch_id),
                ("ZADD", keys.batch_set_key(KeyKind.BATCH_INDEX), created_at, batch_id),
            ]
        )

    def batch(self, batch_id: str) -> dict[str, str] | None:
        (fields,) = self._link.run(
            [("HGETALL", keys.batch_object_key(KeyKind.BATCH_META, batch_id))]
        )
        return _texts(fields) if fields else None

    def update_batch(self, batch_id: str, fields: Mapping[str, str], final: bool = False) -> None:
        meta_key = keys.batch_object_key(KeyKind.BATCH_META, batch_id)
        if fields:
            self._link.run([("HSET", meta_key, *[x for kv in fields.items() for x in kv])])
        if final:
            self._link.run([("SREM", keys.batch_set_key(KeyKind.BATCH_ACTIVE), batch_id)])

    def batch_ids(self) -> list[str]:
        (ids,) = self._link.run([("ZREVRANGE", keys.batch_set_key(KeyKind.BATCH_INDEX), 0, -1)])
        return [_text(i) for i in ids]

    def active_batch_ids(self) -> list[str]:
        (ids,) = self._link.run([("SMEMBERS", keys.batch_set_key(KeyKind.BATCH_ACTIVE))])
        return sorted(_text(i) for i in ids)

    def put_result(self, batch_id: str, custom_id: str, line: str, counter: str) -> bool:
        script_keys = [
            keys.batch_object_key(KeyKind.BATCH_RESULTS, batch_id),
            keys.batch_object_key(KeyKind.BATCH_META, batch_id),
        ]
        (code,) = self._link.run(
            [evalsha(PUT_BATCH_RESULT, script_keys, [custom_id, line, counter])]
        )
        return int(code) == ScriptCode.OK

    def results(self, batch_id: str) -> dict[str, str]:
        (fields,) = self._link.run(
            [("HGETALL", keys.batch_object_key(KeyKind.BATCH_RESULTS, batch_id))]
        )
        return _texts(fields)

    def result_ids(self, batch_id: str) -> set[str]:
        (ids,) = self._link.run([("HKEYS", keys.batch_object_key(KeyKind.BATCH_RESULTS, batch_id))])
        return {_text(i) for i in ids}

    def note_attempt(self, batch_id: str, custom_id: str, attempt: str) -> None:
        key = keys.batch_object_key(KeyKind.BATCH_LINES, batch_id)
        self._link.run([("HSET", key, custom_id, attempt)])

    def attempts(self, batch_id: str) -> dict[str, str]:
        (fields,) = self._link.run(
            [("HGETALL", keys.batch_object_key(KeyKind.BATCH_LINES, batch_id))]
        )
        return _texts(fields)

    def add_to_counters(self, batch_id: str, amounts: Mapping[str, int]) -> None:
        meta_key = keys.batch_object_key(KeyKind.BATCH_META, batch_id)
        commands = [("HINCRBY", meta_key, name, amount) for name, amount in amounts.items()]
        if commands:
            self._link.run(commands)

    def take_lease(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        key = keys.batch_object_key(KeyKind.BATCH_LEASE, batch_id)
        (code,) = self._link.run([evalsha(TAKE_BATCH_LEASE, [key], [owner, ttl_ms])])
        return int(code) == ScriptCode.OK
