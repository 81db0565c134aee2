"""KV authenticity and tenant isolation end to end: real vLLM workers on the tiny model,
persisting to a locked-down Redis (TLS, the worker's ACL user, the cluster keyring).

Worker A generates for tenant "a" until two blocks are stored and is SIGKILLed. Then:
(a) block 1 is altered in Redis — one payload byte, CRC recomputed to match — and the resume
    refuses it by its MAC: block 0 loads, block 1 on is recomputed, the output is the
    uninterrupted one, the worker's MAC counter is up by one and the RECOVERED event says
    one block was refused by its MAC;
(b) the same request under tenant "b" (same prompt, same committed tokens) loads nothing:
    tenant b's content addresses are not tenant a's, although a's blocks are there.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from spotinfer.local.redis_process import RedisProcess
from spotinfer.local.redis_security import ADMIN_USER, RedisSecurity
from spotinfer.local.worker_process import WorkerProcess
from store import RedisStore, RequestRecord, block_hashes
from store.acl import Role
from store.keys import block_key
from tests.metrics.scrape import scrape
from tests.resume.conftest import BLOCK_TOKENS, MAX_MODEL_LEN
from tests.resume.streams import (
    STREAM_TIMEOUT_SECONDS,
    StreamReader,
    generate,
    greedy_request,
    resume_stream,
)
from tests.support.wait import wait_until
from worker.model_fingerprint import model_fingerprint

MAX_TOKENS = 900  # with a 40-token prompt: 7 full blocks by the end (as tests/resume)
PROMPT = list(range(200, 240))  # the tiny model's vocabulary is 512
TENANT = "a"
REQUEST_ID = "mac-tenant-a"
MAC_COUNTER = "spotinfer_worker_kv_mac_rejected_blocks_total"


@dataclasses.dataclass(frozen=True)
class Killed:
    """What worker A left behind for tenant a."""

    record: RequestRecord
    received: list[int]
    committed: list[int]
    hashes: list[bytes]  # tenant a's chain over prompt + committed


def _security(server: RedisProcess) -> RedisSecurity:
    assert server.security is not None
    return server.security


def _flags(server: RedisProcess) -> tuple[str, ...]:
    return (
        *("--dtype", "float32"),
        *("--max-model-len", str(MAX_MODEL_LEN)),
        *("--memory-gib", "0.25"),
        *("--kv-persist-policy", "eager"),
        *_security(server).store_flags(server.url, Role.WORKER),
    )


@pytest.fixture(scope="module")
def fingerprint(tiny_model: Path) -> str:
    return model_fingerprint(str(tiny_model), "float32")


@pytest.fixture(scope="module")
def worker_store(secure_redis: RedisProcess) -> Iterator[RedisStore]:
    store = RedisStore.from_config(
        _security(secure_redis).store_config(secure_redis.url, Role.WORKER)
    )
    yield store
    store.close()


@pytest.fixture(scope="module")
def standby(
    tiny_model: Path, secure_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    with WorkerProcess(
        tiny_model,
        *_flags(secure_redis),
        *("--worker-id", "worker-b"),
        log_dir=tmp_path_factory.mktemp("standby-logs"),
        metrics=True,
    ) as process:
        yield process


def _stored_blocks(store: RedisStore, hashes: list[bytes]) -> int:
    count = 0
    for present in store.blocks_present(hashes) if hashes else []:
        if not present:
            break
        count += 1
    return count


@pytest.fixture(scope="module")
def killed(
    tiny_model: Path,
    secure_redis: RedisProcess,
    worker_store: RedisStore,
    fingerprint: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Killed:
    request = greedy_request(REQUEST_ID, PROMPT, MAX_TOKENS)
    request.tenant = TENANT
    with WorkerProcess(
        tiny_model,
        *_flags(secure_redis),
        *("--worker-id", "worker-a"),
        log_dir=tmp_path_factory.mktemp("worker-a-logs"),
    ) as worker_a:
        reader = StreamReader(worker_a.stub.Generate(request, timeout=STREAM_TIMEOUT_SECONDS))

        def two_blocks_stored() -> bool:
            tokens = PROMPT + reader.tokens()
            return (
                _stored_blocks(
                    worker_store, block_hashes(fingerprint, tokens, BLOCK_TOKENS, TENANT)
                )
                >= 2
            )

        wait_until(lambda: reader.done or two_blocks_stored(), "two of tenant a's blocks stored")
        worker_a.kill()
        reader.join()
    assert reader.error is not None, "worker A finished before it was killed; nothing to test"
    assert reader.tokens(), f"worker A streamed nothing: {reader.error}"
    record = worker_store.get_request(REQUEST_ID)
    assert record.tenant == TENANT
    committed = worker_store.committed_tokens(REQUEST_ID)
    hashes = block_hashes(fingerprint, PROMPT + committed, BLOCK_TOKENS, TENANT)
    assert _stored_blocks(worker_store, hashes) >= 2
    return Killed(record, reader.tokens(), committed, hashes)


@pytest.fixture(scope="module")
def reference(standby: WorkerProcess) -> list[int]:
    request = greedy_request("mac-reference", PROMPT, MAX_TOKENS)
    request.tenant = "reference"  # its blocks touch neither tenant's
    return generate(standby, request)


def test_a_block_altered_with_a_matching_crc_is_refused_by_its_mac_and_recomputed(
    secure_redis: RedisProcess,
    standby: WorkerProcess,
    killed: Killed,
    reference: list[int],
) -> None:
    security = _security(secure_redis)
    admin = redis.Redis.from_url(
        secure_redis.url,
        username=ADMIN_USER,
        password=security.password(ADMIN_USER),
        ssl_ca_certs=str(security.ca_file),
    )
    try:
        key = block_key(killed.hashes[1])
        value = bytearray(admin.get(key) or b"")
        assert value, "block 1 must be in Redis before it can be altered"
        value[-1] ^= 0x01  # one byte of the last KV element
        struct.pack_into("<I", value, 8, zlib.crc32(bytes(value[12:])))
        admin.set(key, bytes(value))
    finally:
        admin.close()
    before = scrape(standby.metrics_url).value(MAC_COUNTER)

    event, resumed = resume_stream(standby, REQUEST_ID, from_index=0)

    context_tokens = len(PROMPT) + len(killed.committed)
    assert resumed == reference
    assert killed.received == reference[: len(killed.received)]
    assert event.loaded_tokens == BLOCK_TOKENS  # block 0; block 1 on is recomputed
    assert event.recomputed_tokens == context_tokens - BLOCK_TOKENS - 1
    assert "rejected (mac)" in standby.output
    # The resume's event says it too (the drill report and the client's stream show it).
    assert "1 stored block refused by its MAC (recomputed)" in event.detail, event.detail
    wait_until(
        lambda: scrape(standby.metrics_url).value(MAC_COUNTER) == before + 1,
        "the MAC counter up by one",
    )


def test_tenant_b_never_loads_tenant_a_blocks_of_the_same_prompt(
    worker_store: RedisStore,
    standby: WorkerProcess,
    killed: Killed,
    fingerprint: str,
    reference: list[int],
) -> None:
    copy_id = "mac-tenant-b"
    worker_store.create_request(dataclasses.replace(killed.record, request_id=copy_id, tenant="b"))
    worker_store.commit(copy_id, 0, killed.committed)
    b_hashes = block_hashes(fingerprint, PROMPT + killed.committed, BLOCK_TOKENS, "b")
    assert not set(b_hashes) & set(killed.hashes)
    assert worker_store.blocks_present(killed.hashes[:1]) == [True]  # a's block 0 is there

    event, resumed = resume_stream(standby, copy_id, from_index=0)

    assert resumed == reference
    assert event.loaded_tokens == 0, "tenant b loaded KV that tenant a stored"
    assert event.recomputed_tokens == len(PROMPT) + len(killed.committed) - 1
    assert "MAC" not in event.detail, "a block of another tenant is not looked up, not refused"
