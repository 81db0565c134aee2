"""The worker → daemon hand-off (store/handoff.py, worker/daemon_writer.py,
context_daemon/persister.py) against a real redis-server: blocks land bit-exact, a worker
process killed right after handing blocks over loses none of them, a full ring drops only
optional blocks, and a worker whose daemon is not there yet writes Redis itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from context_daemon.persister import Persister
from store import (
    KVFormat,
    RedisStore,
    RequestRecord,
    RequestStatus,
    TokenCommit,
    block_hashes,
    tail_hash,
)
from store.block_codec import header_bytes
from store.block_writer import PendingBlock
from tests.support.redis_server import RedisServer
from tests.support.wait import wait_until
from worker import daemon_writer
from worker.daemon_writer import HandoffWriter
from worker.flush_state import read_flush_state

FORMAT = KVFormat(
    model_fingerprint="tiny-llama:fp32:handoff",
    dtype="float32",
    layout="cpu:blocks,kv_heads,block,2*head_dim",
    layer_count=2,
    block_tokens=16,
)
PAYLOAD_BYTES = 2 * 2 * 16 * 64 * 4
SLOT_BYTES = header_bytes(FORMAT) + PAYLOAD_BYTES
PROMPT = tuple(range(100, 165))  # 65 tokens
OUTPUTS = (7, 8, 9)  # context 68: KV for 67 tokens = 4 full blocks and a 3-token tail
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own redis-server: tests freeze it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def store(redis: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis.url)
    yield store
    store.close()


@pytest.fixture
def persister(store: RedisStore, tmp_path: Path) -> Iterator[Persister]:
    persister = Persister(str(tmp_path / "handoff.sock"), store)
    yield persister
    persister.close()


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        model_fingerprint=FORMAT.model_fingerprint,
        prompt_token_ids=PROMPT,
        sampling_params={"max_tokens": 64},
        kv_block_tokens=FORMAT.block_tokens,
        status=RequestStatus.RUNNING,
        owner_worker_id="worker-a",
    )


def _hashes() -> tuple[list[bytes], bytes]:
    context = list(PROMPT + OUTPUTS)
    full = block_hashes(FORMAT.model_fingerprint, context[:64], FORMAT.block_tokens)
    tail = tail_hash(FORMAT.model_fingerprint, context[:67], FORMAT.block_tokens)
    assert tail is not None
    return full, tail


def _hand_over(
    writer: HandoffWriter, request_id: str, index: int, prefix_hash: bytes, num_tokens: int = 0
) -> torch.Tensor:
    """What the connector does: a buffer from the writer, the KV copied in, submitted. The
    payload is a pattern of the block's index, so a mix-up shows."""
    required = num_tokens > 0
    buffer = writer.buffer(SLOT_BYTES, required)
    assert buffer is not None
    payload = torch.arange(PAYLOAD_BYTES, dtype=torch.int64).add_(index * 7).remainder_(251)
    buffer[header_bytes(FORMAT) :].copy_(payload.to(torch.uint8))
    expected = buffer[header_bytes(FORMAT) :].clone()
    writer.submit(PendingBlock(request_id, index, prefix_hash, buffer, num_tokens), required)
    return expected


def _flush_complete(store: RedisStore, request_id: str) -> bool:
    state = read_flush_state(
        store, request_id, FORMAT.model_fingerprint, FORMAT.block_tokens, 0, True
    )
    return state.complete


def test_blocks_handed_over_are_written_bit_exact(store: RedisStore, persister: Persister) -> None:
    request_id = "handoff-exact"
    store.create_request(_record(request_id))
    writer = HandoffWriter(persister.socket_path, store, FORMAT, SLOT_BYTES, 8)
    try:
        assert writer.handed_over, "the daemon takes the writes"
        full, tail = _hashes()
        expected = [_hand_over(writer, request_id, i, h) for i, h in enumerate(full)]
        writer.submit_tokens(TokenCommit(request_id, 0, OUTPUTS))
        _hand_over(writer, request_id, 4, tail, num_tokens=3)
        store.update_status(request_id, RequestStatus.PAUSED)
        wait_until(lambda: _flush_complete(store, request_id), "the flush complete", 10)
        assert persister.settle(5.0)
        assert store.get_request(request_id).persisted_block_hashes == tuple(full)
        assert store.committed_tokens(request_id) == list(OUTPUTS)
        stored = store.get_block_values(full)
        for value, payload in zip(stored, expected, strict=True):
            assert value is not None
            assert value[header_bytes(FORMAT) :] == payload.numpy().tobytes()
        # The daemon's totals reach the worker (its metrics), and every slot came back.
        wait_until(lambda: writer.written_blocks == 5, "the totals back at the worker", 10)
        assert writer.dropped_blocks == 0
    finally:
        writer.close(5.0)


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from store import RedisStore
    from store.block_codec import header_bytes
    from store.block_writer import PendingBlock
    from tests.context_daemon.test_persister import FORMAT, SLOT_BYTES, _hashes
    from worker.daemon_writer import HandoffWriter

    socket_path, url, request_id = sys.argv[1:4]
    writer = HandoffWriter(socket_path, RedisStore.from_url(url), FORMAT, SLOT_BYTES, 8)
    assert writer.handed_over
    full, _ = _hashes()
    for index, prefix_hash in enumerate(full):
        buffer = writer.buffer(SLOT_BYTES)
        buffer[header_bytes(FORMAT):].fill_(index + 1)
        writer.submit(PendingBlock(request_id, index, prefix_hash, buffer))
    # Gone the instant after the hand-over: nothing of this process writes anything.
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_worker_killed_right_after_handing_over_loses_nothing(
    redis: RedisServer, store: RedisStore, persister: Persister
) -> None:
    """Redis is frozen while a worker process hands four blocks over and is SIGKILLed: the
    blocks were in no Redis yet, and its daemon writes every one once Redis thaws."""
    request_id = "handoff-killed"
    store.create_request(_record(request_id))
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, persister.socket_path, redis.url, request_id],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    assert persister.settle(30.0), "the daemon wrote what the dead worker left"
    full, _ = _hashes()
    assert store.get_request(request_id).persisted_block_hashes == tuple(full)
    for index, value in enumerate(store.get_block_values(full)):
        assert value is not None
        assert set(value[header_bytes(FORMAT) :]) == {index + 1}


def test_a_full_ring_drops_optional_blocks_and_takes_required_ones(
    redis: RedisServer, store: RedisStore, persister: Persister
) -> None:
    request_id = "handoff-full-ring"
    store.create_request(_record(request_id))
    writer = HandoffWriter(persister.socket_path, store, FORMAT, SLOT_BYTES, 1)
    assert redis.pid is not None
    full, tail = _hashes()
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        slots = daemon_writer.MIN_SLOTS
        for index in range(slots):
            _hand_over(writer, request_id, index, full[index])
        # The ring is full while Redis does not answer: an optional block is dropped...
        assert writer.buffer(SLOT_BYTES) is None
        assert writer.dropped_blocks == 1
        # ...and a pause's tail travels in a memfd of its own.
        _hand_over(writer, request_id, 4, tail, num_tokens=3)
        writer.submit_tokens(TokenCommit(request_id, 0, OUTPUTS))
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    try:
        store.update_status(request_id, RequestStatus.PAUSED)
        wait_until(lambda: _flush_complete(store, request_id), "the flush complete", 30)
        wait_until(lambda: writer.buffer(SLOT_BYTES) is not None, "a slot free again", 10)
    finally:
        writer.close(5.0)


def test_a_worker_writes_itself_until_its_daemon_listens(
    store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon_writer, "RECONNECT_SECONDS", 0.2)
    path = str(tmp_path / "late.sock")
    request_id = "handoff-late-daemon"
    store.create_request(_record(request_id))
    writer = HandoffWriter(path, store, FORMAT, SLOT_BYTES, 8)
    persister = None
    try:
        assert not writer.handed_over
        full, _ = _hashes()
        _hand_over(writer, request_id, 0, full[0])
        wait_until(lambda: writer.written_blocks == 1, "written by the worker itself", 10)
        persister = Persister(path, store)
        wait_until(lambda: writer.handed_over, "the daemon taking over", 10)
        _hand_over(writer, request_id, 1, full[1])
        assert persister.settle(10.0)
        wait_until(lambda: persister.written_blocks == 1, "written by the daemon", 10)
        wait_until(lambda: writer.written_blocks == 2, "both counted at the worker", 10)
        assert store.get_request(request_id).persisted_block_hashes == tuple(full[:2])
    finally:
        writer.close(5.0)
        if persister is not None:
            persister.close()


def test_a_malformed_hand_off_is_refused_and_nothing_is_written(
    store: RedisStore, persister: Persister
) -> None:
    """A process that speaks to the socket without the ring first is cut off; the daemon goes
    on serving others."""
    from store import handoff

    sock = handoff.connect(persister.socket_path, 1.0)
    try:
        sock.sendall(b"\x02{}")  # a BLOCK before HELLO
        sock.settimeout(5.0)
        assert sock.recv(16) == b"", "the daemon closed the connection"
    finally:
        sock.close()
    assert persister.settle(5.0)
    other = HandoffWriter(persister.socket_path, store, FORMAT, SLOT_BYTES, 8)
    try:
        assert other.handed_over
    finally:
        other.close(5.0)


def test_settle_over_grpc_answers_and_refuses_a_bad_timeout(
    redis: RedisServer, tmp_path: Path
) -> None:
    import grpc

    from protos.spotinfer.v1 import daemon_pb2
    from spotinfer.local.daemon_process import DaemonProcess

    socket_path = str(tmp_path / "d.sock")
    flags = ("--notice-source", "file", "--notice-file", str(tmp_path / "notice"))
    with DaemonProcess(
        *flags, "--redis-url", redis.url, "--kv-handoff-socket", socket_path, log_dir=tmp_path
    ) as daemon:
        reply = daemon.stub.Settle(daemon_pb2.SettleRequest(timeout_seconds=1.0), timeout=10)
        assert (reply.handoff, reply.settled, reply.pending_blocks) == (True, True, 0)
        with pytest.raises(grpc.RpcError) as refused:
            daemon.stub.Settle(daemon_pb2.SettleRequest(timeout_seconds=-1.0), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_seconds" in (refused.value.details() or "")
    with DaemonProcess(*flags, log_dir=tmp_path) as plain:
        reply = plain.stub.Settle(daemon_pb2.SettleRequest(timeout_seconds=1.0), timeout=10)
        assert (reply.handoff, reply.settled) == (False, True)


def test_token_commits_go_through_the_daemon_and_its_errors_come_back(
    store: RedisStore, persister: Persister, tmp_path: Path
) -> None:
    from store import RequestExists, RequestNotFound
    from worker.daemon_store import DaemonCommitStore

    request_id = "handoff-tokens"
    through = DaemonCommitStore(persister.socket_path, store)
    try:
        assert through.through_daemon
        through.ping()
        through.create_request(_record(request_id))
        with pytest.raises(RequestExists):
            through.create_request(_record(request_id))
        outcomes = through.commit_step([TokenCommit(request_id, 0, OUTPUTS)])
        assert [(o.committed_length, o.conflict) for o in outcomes] == [(3, None)]
        gap = through.commit_step([TokenCommit(request_id, 9, (1,))])
        assert gap[0].conflict is not None and gap[0].committed_length == 3
        assert through.update_status(request_id, RequestStatus.PAUSED) is RequestStatus.RUNNING
        assert through.finish_request(request_id, RequestStatus.CANCELLED)
        with pytest.raises(RequestNotFound):  # a cancelled request's keys are gone
            through.update_status(request_id, RequestStatus.RUNNING)
    finally:
        through.close()
    # No daemon at that path: the same calls go to the store directly.
    direct = DaemonCommitStore(str(tmp_path / "none.sock"), store)
    assert not direct.through_daemon
    direct.create_request(_record("handoff-tokens-direct"))
    assert (
        direct.commit_step([TokenCommit("handoff-tokens-direct", 0, OUTPUTS)])[0].conflict is None
    )
    assert store.committed_tokens("handoff-tokens-direct") == list(OUTPUTS)


CALLER = textwrap.dedent(
    """
    import os, signal, sys
    from store import handoff
    from store.handoff_calls import CALLS_HELLO, commits_args
    from store.redis_store import TokenCommit
    import json

    sock = handoff.connect(sys.argv[1], 5.0)
    sock.sendall(CALLS_HELLO)
    commit = TokenCommit(sys.argv[2], 0, (7, 8, 9))
    sock.sendall(json.dumps({"op": "commit_step", "args": commits_args([commit])}).encode())
    os.kill(os.getpid(), signal.SIGKILL)  # before any answer
    """
)


def test_a_commit_the_worker_sent_is_written_though_it_died_at_once(
    redis: RedisServer, store: RedisStore, persister: Persister
) -> None:
    request_id = "handoff-commit-killed"
    store.create_request(_record(request_id))
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGSTOP)  # nothing can be written before the caller dies
    try:
        child = subprocess.run(
            [sys.executable, "-c", CALLER, persister.socket_path, request_id],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    wait_until(
        lambda: store.committed_tokens(request_id) == list(OUTPUTS), "the commit written", 30
    )


def test_an_abstract_socket_takes_its_own_user_and_refuses_another(store: RedisStore) -> None:
    """``@name``: no file (each network namespace, like each VM, has its own names); the
    daemon checks who connects (SO_PEERCRED) and takes its own user's processes only."""
    name = f"@spot-test-{os.getpid()}"
    persister = Persister(name, store)
    writer = HandoffWriter(name, store, FORMAT, SLOT_BYTES, 8)
    try:
        assert writer.handed_over
        system_python = "/usr/bin/python3"  # one another user may run (the venv's is root's)
        if os.getuid() != 0 or not os.access(system_python, os.X_OK):
            return  # another user's process needs root, and a python it may run
        stranger = subprocess.run(
            [
                system_python,
                "-c",
                "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
                "s.settimeout(10); s.connect('\\0' + sys.argv[1]); print(repr(s.recv(16)))",
                name[1:],
            ],
            capture_output=True,
            text=True,
            timeout=30,
            preexec_fn=lambda: os.setuid(65534),  # noqa: PLW1509 - a test's own child
        )
        assert stranger.stdout.strip() == "b''", stranger.stderr
        wait_until(lambda: persister.connections == 1, "the stranger not kept", 10)
    finally:
        writer.close(5.0)
        persister.close()
