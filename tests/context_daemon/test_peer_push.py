"""Peer migration's transport on real daemon processes: a source pushes KV blocks straight to
the target's daemon (PushBlocks over parallel streams), which verifies and stages them for its
worker (FetchStaged, DropStaged); one test across a network namespace boundary."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.channels import PLAINTEXT, TransportConfig
from context_daemon.peer_push import PeerBlock, PeerPusher, PushOutcome
from context_daemon.staging_client import StagingClient
from protos.spotinfer.v1 import daemon_pb2
from spotinfer.local.certs import make_ca, make_node_cert
from spotinfer.local.daemon_process import DaemonProcess
from store import KVBlock, KVFormat, keys
from store.block_codec import chain_hash, encode_block
from store.mac_keyring import MacKeyring, parse_keyring

pytestmark = pytest.mark.integration

BLOCK_TOKENS = 128
FORMAT = KVFormat("peer-test-model", "bfloat16", "test:whole", 30, BLOCK_TOKENS)
MIB = 1024 * 1024
PUSH_SECONDS = 60.0
KEYRING_TEXT = f"7:{'ab' * 32}\n"
OTHER_KEYRING_TEXT = f"7:{'cd' * 32}\n"  # the same key id, another key: a foreign cluster
NETNS_PREFIX = "sppp"


def keyring(text: str = KEYRING_TEXT) -> MacKeyring:
    return parse_keyring(text)


def full_block(
    request_id: str, seed: int, payload_bytes: int, ring: MacKeyring | None = None
) -> PeerBlock:
    """A sealed full block of ``payload_bytes`` random bytes under its content address."""
    prefix_hash = chain_hash(bytes(16), FORMAT.model_fingerprint, [seed])
    payload = os.urandom(payload_bytes)
    data = encode_block(KVBlock(FORMAT, prefix_hash, BLOCK_TOKENS, payload), ring or keyring())
    return PeerBlock(request_id, keys.block_key(prefix_hash), data)


def tail_block(request_id: str, payload_bytes: int) -> PeerBlock:
    prefix_hash = chain_hash(bytes(16), FORMAT.model_fingerprint, [1, 2, 3])
    payload = os.urandom(payload_bytes)
    data = encode_block(KVBlock(FORMAT, prefix_hash, 3, payload), keyring())
    return PeerBlock(request_id, keys.request_tail_key(request_id), data)


def flipped(block: PeerBlock, at: int) -> PeerBlock:
    data = bytearray(block.data)
    data[at] ^= 0x01
    return PeerBlock(block.request_id, block.key, bytes(data))


def status(daemon: DaemonProcess) -> daemon_pb2.DaemonStatus:
    return daemon.stub.Status(daemon_pb2.DaemonStatusRequest(), timeout=10)


@pytest.fixture(scope="module")
def keyring_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "kv-mac.keys"
    path.write_text(KEYRING_TEXT)
    return path


def start_daemon(keyring_file: Path, *flags: str, **options: object) -> DaemonProcess:
    return DaemonProcess(
        *("--notice-source", "file", "--notice-file", "/nonexistent/peer-test-notice"),
        *("--kv-mac-key-file", str(keyring_file)),
        *flags,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def target(keyring_file: Path) -> Iterator[DaemonProcess]:
    """A target daemon with room for everything the tests push."""
    with start_daemon(keyring_file, "--staging-max-bytes", str(256 * MIB)) as daemon:
        yield daemon


async def push(
    address: str, blocks: list[PeerBlock], streams: int, transport: TransportConfig = PLAINTEXT
) -> PushOutcome:
    async with PeerPusher(address, transport, streams=streams) as pusher:
        return await pusher.push(blocks, PUSH_SECONDS)


async def fetch(address: str, request_id: str, transport: TransportConfig = PLAINTEXT) -> dict:
    async with StagingClient(address, transport) as client:
        return await client.fetch(request_id)


@pytest.mark.parametrize("streams", [1, 4])
async def test_blocks_arrive_bit_exact_over_one_or_several_streams(
    target: DaemonProcess, streams: int
) -> None:
    first, second = f"rt-{streams}-a", f"rt-{streams}-b"
    # Blocks above gRPC's 4 MiB message limit travel in chunks; small ones in one message.
    # Seeds of their own: a content address names one content (the target module's daemon
    # serves every test).
    seed = 100 * streams
    big = [full_block(first, seed + n, size) for n, size in ((1, 5 * MIB), (2, 9 * MIB + 7))]
    small = [full_block(first, seed + n, 10_000 + n) for n in (3, 4, 5)]
    shared = full_block(second, seed + 6, 4 * MIB)  # both requests' prefix
    blocks = [*big, *small, shared, PeerBlock(first, shared.key, shared.data)]
    blocks.append(tail_block(first, 700))
    before = status(target).staged_bytes

    outcome = await push(target.address, blocks, streams)

    assert outcome.complete and not outcome.errors
    assert outcome.staged_blocks == len(blocks)
    assert sorted(outcome.staged[first]) == sorted(b.key for b in blocks if b.request_id == first)
    staged = await fetch(target.address, first)
    expected = {b.key: bytes(b.data) for b in blocks if b.request_id == first}
    assert staged.keys() == expected.keys()
    for key, data in expected.items():
        assert hashlib.sha256(staged[key]).digest() == hashlib.sha256(data).digest(), key
    assert (await fetch(target.address, second)) == {shared.key: bytes(shared.data)}
    # The shared block is held once.
    unique = sum(len(b.data) for b in blocks[:-2]) + len(blocks[-1].data)
    assert status(target).staged_bytes == before + unique


async def test_only_the_named_keys_are_fetched_and_a_drop_frees_them(
    target: DaemonProcess,
) -> None:
    blocks = [full_block("drop-a", seed, 6 * MIB) for seed in (11, 12)]
    shared = full_block("drop-b", 11, 6 * MIB)  # seed 11 again: the same key as blocks[0]
    before = status(target).staged_bytes
    assert (await push(target.address, [*blocks, shared], 2)).complete
    assert status(target).staged_bytes == before + sum(len(b.data) for b in blocks)

    async with StagingClient(target.address) as client:
        named = await client.fetch("drop-a", [blocks[1].key, keys.block_key(bytes(16))])
        assert named == {blocks[1].key: bytes(blocks[1].data)}
        dropped = await client.drop("drop-a")
        # Both blocks were the request's; the one drop-b shares stays.
        assert (dropped.blocks, dropped.bytes) == (2, len(blocks[1].data))
        assert await client.fetch("drop-a") == {}
        assert await client.fetch("drop-b") == {shared.key: bytes(blocks[0].data)}
        assert (await client.drop("drop-b")).bytes == len(shared.data)
        assert (await client.drop("drop-b")).blocks == 0
    assert status(target).staged_bytes == before


@pytest.mark.parametrize(
    ("spoil", "code"),
    [
        ("flip", grpc.StatusCode.DATA_LOSS),
        ("foreign key", grpc.StatusCode.INVALID_ARGUMENT),
        ("wrong name", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_a_block_that_fails_its_checks_is_refused_and_not_staged(
    target: DaemonProcess, spoil: str, code: grpc.StatusCode
) -> None:
    request_id = f"bad-{spoil.replace(' ', '-')}"
    good = full_block(request_id, 21, 5 * MIB)
    bad = full_block(request_id, 22, 5 * MIB)
    if spoil == "flip":
        bad = flipped(bad, len(bad.data) - 1000)  # a payload byte, past the first chunk
    elif spoil == "foreign key":
        bad = full_block(request_id, 22, 5 * MIB, keyring(OTHER_KEYRING_TEXT))
    else:  # a sound block under another block's address
        bad = PeerBlock(request_id, keys.block_key(b"\x01" * 16), bad.data)
    after = full_block(request_id, 23, 1000)
    refused_before = status(target).refused_blocks

    outcome = await push(target.address, [good, bad, after], 1)

    # One stream: the block before the bad one is staged, the bad one and the rest are not.
    assert outcome.staged == {request_id: [good.key]}
    assert outcome.failed == {request_id: [bad.key, after.key]}
    assert outcome.errors and outcome.errors[0].startswith(code.name)
    assert list(await fetch(target.address, request_id)) == [good.key]
    assert status(target).refused_blocks == refused_before + 1


async def test_a_refused_block_fails_only_its_own_streams_rest(target: DaemonProcess) -> None:
    blocks = [full_block("lanes", 70 + seed, 2 * MIB) for seed in range(8)]
    blocks[5] = flipped(blocks[5], 500)  # equal sizes go round robin: stream 1 has 1 and 5
    outcome = await push(target.address, blocks, 4)
    assert outcome.failed == {"lanes": [blocks[5].key]}
    assert sorted(outcome.staged["lanes"]) == sorted(b.key for b in blocks if b is not blocks[5])
    assert len(outcome.errors) == 1 and outcome.errors[0].startswith("DATA_LOSS")
    assert len(await fetch(target.address, "lanes")) == 7


async def test_over_the_cap_is_refused_whole_and_frees_its_reservation(
    keyring_file: Path,
) -> None:
    with start_daemon(keyring_file, "--staging-max-bytes", str(12 * MIB)) as daemon:
        too_big = full_block("cap-a", 31, 13 * MIB)
        outcome = await push(daemon.address, [too_big], 1)
        assert outcome.staged == {} and outcome.failed == {"cap-a": [too_big.key]}
        assert outcome.errors[0].startswith("RESOURCE_EXHAUSTED")
        assert "staging is full" in outcome.errors[0]
        assert status(daemon).staged_bytes == 0

        # Two fit, the third does not: the two stay staged, nothing of the third does.
        blocks = [full_block("cap-b", seed, 5 * MIB) for seed in (32, 33, 34)]
        outcome = await push(daemon.address, blocks, 1)
        assert outcome.staged == {"cap-b": [blocks[0].key, blocks[1].key]}
        assert outcome.failed == {"cap-b": [blocks[2].key]}
        assert status(daemon).staged_bytes == sum(len(b.data) for b in blocks[:2])
        # What the refused block had reserved is free again: a block that fits is taken.
        small = full_block("cap-c", 35, MIB)
        assert (await push(daemon.address, [small], 1)).complete


async def test_staged_blocks_expire_when_nobody_reads_or_drops_them(keyring_file: Path) -> None:
    with start_daemon(keyring_file, "--staging-ttl-seconds", "1") as daemon:
        block = full_block("ttl-a", 41, 5 * MIB)
        assert (await push(daemon.address, [block], 1)).complete
        assert status(daemon).staged_blocks == 1
        # The sweep frees it without any call; a fetch after the TTL finds nothing either.
        deadline = 15.0
        while status(daemon).staged_bytes and deadline > 0:
            await asyncio.sleep(0.25)
            deadline -= 0.25
        assert status(daemon).staged_bytes == 0
        assert await fetch(daemon.address, "ttl-a") == {}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TransportConfig]:
    """The cluster CA and a certificate of each node role."""
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder)
    made = {}
    for role in ("coordinator", "worker", "daemon", "operator"):
        paths = make_node_cert(ca, folder, role, role)
        made[role] = TransportConfig(str(ca.cert), str(paths.cert), str(paths.key))
    other = make_node_cert(ca, folder, "w1-worker", "worker", node="w1")
    made["named worker"] = TransportConfig(str(ca.cert), str(other.cert), str(other.key))
    return made


async def test_only_daemons_push_and_only_the_nodes_worker_reads(
    keyring_file: Path, certificates: dict[str, TransportConfig]
) -> None:
    server = certificates["daemon"]
    flags = ("--transport-ca-file", server.ca_file, "--transport-cert-file", server.cert_file)
    flags += ("--transport-key-file", server.key_file)
    with start_daemon(keyring_file, *flags, transport=certificates["operator"]) as daemon:
        block = full_block("authz-a", 51, 5 * MIB)
        for role in ("worker", "coordinator", "operator"):
            refused = await push(daemon.address, [block], 1, certificates[role])
            assert refused.errors[0].startswith("PERMISSION_DENIED"), role
        assert (await push(daemon.address, [block], 2, certificates["daemon"])).complete

        for role in ("daemon", "coordinator", "operator"):
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await fetch(daemon.address, "authz-a", certificates[role])
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
        # A worker certificate over loopback is this node's worker (the daemon names no node).
        for role in ("worker", "named worker"):
            staged = await fetch(daemon.address, "authz-a", certificates[role])
            assert staged == {block.key: bytes(block.data)}
        # The coordinator may drop a migration's blocks (an aborted handshake).
        async with StagingClient(daemon.address, certificates["coordinator"]) as coordinator:
            assert (await coordinator.drop("authz-a")).blocks == 1


async def test_a_push_across_a_network_namespace_boundary(
    keyring_file: Path, tmp_path: Path
) -> None:
    from spotinfer.rehearsal.forwarder import Forwarder
    from spotinfer.rehearsal.netns import Network, sweep_leftovers, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    sweep_leftovers(NETNS_PREFIX)  # what a killed earlier run of this test left
    with Network(prefix=NETNS_PREFIX) as net:  # removed with everything in it, also on failure
        source_vm, target_vm = net.add_host("source"), net.add_host("target")
        with start_daemon(
            keyring_file, host=target_vm.address, wrap=target_vm.command([])
        ) as daemon:
            port = int(daemon.address.rsplit(":", 1)[1])
            # Every connection the pusher opens leaves from the source VM's namespace.
            forwarder = Forwarder(source_vm, (target_vm.address, port), tmp_path / "fwd.sock")
            with forwarder:
                blocks = [full_block("netns-a", seed, 5 * MIB) for seed in (61, 62, 63)]
                blocks.append(full_block("netns-b", 64, 20_000))
                outcome = await push(forwarder.target, blocks, 4)
                assert outcome.complete, outcome.errors
                staged = await fetch(forwarder.target, "netns-a")
                assert staged == {b.key: bytes(b.data) for b in blocks[:3]}
