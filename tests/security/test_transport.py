"""Mutual TLS and the authorization tables on real gRPC servers (in process, loopback): the
worker's table behind the one server factory, certificate renewal without a restart."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from common.authz import AuthorizationInterceptor
from common.channels import PLAINTEXT, TransportConfig, async_channel, async_server, listen
from protos.spotinfer.v1 import worker_pb2, worker_pb2_grpc
from spotinfer.local.certs import make_node_cert, make_server_cert
from tests.security.conftest import Pki
from worker.server import AUTHORIZATION as WORKER_AUTHORIZATION

TIMEOUT_SECONDS = 5


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Answers the two calls the tests make; what matters is who gets through."""

    async def Stats(self, request, context):  # noqa: N802
        return worker_pb2.WorkerStats(worker_id="w0")

    async def Preempt(self, request, context) -> AsyncIterator[object]:  # noqa: N802
        if False:
            yield


WORKER_NODE = "w0"


async def _serve(transport: TransportConfig) -> tuple[grpc.aio.Server, str]:
    """The worker's table on a worker whose node (worker id) is WORKER_NODE."""
    server = async_server(
        0, interceptors=[AuthorizationInterceptor(WORKER_AUTHORIZATION, node=WORKER_NODE)]
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    port = listen(server, "127.0.0.1:0", transport)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _stats(address: str, transport: TransportConfig) -> grpc.StatusCode:
    async with async_channel(address, transport=transport) as channel:
        try:
            await worker_pb2_grpc.WorkerStub(channel).Stats(
                worker_pb2.StatsRequest(), timeout=TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _preempt(address: str, transport: TransportConfig) -> grpc.StatusCode:
    async with async_channel(address, transport=transport) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Preempt(
            worker_pb2.PreemptRequest(deadline_unix=1.0), timeout=TIMEOUT_SECONDS
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_an_internal_service_refuses_clients_without_a_cluster_certificate(pki: Pki) -> None:
    server, address = await _serve(pki.transport("worker"))
    try:
        assert await _stats(address, pki.transport("coordinator")) == grpc.StatusCode.OK
        # No certificate, another CA's certificate, or no TLS at all: no connection.
        assert await _stats(address, pki.client_only()) == grpc.StatusCode.UNAVAILABLE
        assert await _stats(address, pki.foreign_client()) == grpc.StatusCode.UNAVAILABLE
        assert await _stats(address, PLAINTEXT) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


def _daemon_of(pki: Pki, folder: Path, node: str) -> TransportConfig:
    paths = make_node_cert(pki.ca, folder, f"{node}-daemon", "daemon", node=node)
    return TransportConfig(str(pki.ca.cert), str(paths.cert), str(paths.key))


async def test_a_worker_takes_preempt_only_from_the_coordinator_or_its_own_daemon(
    pki: Pki, tmp_path: Path
) -> None:
    server, address = await _serve(pki.transport("worker"))
    own_daemon = _daemon_of(pki, tmp_path, WORKER_NODE)
    other_daemon = _daemon_of(pki, tmp_path, "w1")
    try:
        assert await _preempt(address, pki.transport("coordinator")) == grpc.StatusCode.OK
        assert await _preempt(address, own_daemon) == grpc.StatusCode.OK
        denied = grpc.StatusCode.PERMISSION_DENIED
        # Another node's daemon: a valid daemon certificate of the cluster, still refused,
        # though it calls from this very machine.
        assert await _preempt(address, other_daemon) == denied
        assert await _preempt(address, pki.transport("operator")) == denied
        assert await _preempt(address, pki.transport("worker")) == denied
        # A daemon certificate naming no node (a fleet's shared bundle) proves no node: it
        # is the own daemon only over a connection no other machine can open (loopback here).
        assert await _preempt(address, pki.transport("daemon")) == grpc.StatusCode.OK
        # Stats: an operator and any daemon may look; another worker may not.
        assert await _stats(address, pki.transport("operator")) == grpc.StatusCode.OK
        assert await _stats(address, other_daemon) == grpc.StatusCode.OK
        assert await _stats(address, pki.transport("worker")) == denied
    finally:
        await server.stop(0)


async def test_the_refusal_names_the_daemon_of_another_node(pki: Pki, tmp_path: Path) -> None:
    server, address = await _serve(pki.transport("worker"))
    try:
        async with async_channel(address, transport=_daemon_of(pki, tmp_path, "w1")) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Preempt(
                worker_pb2.PreemptRequest(deadline_unix=1.0), timeout=TIMEOUT_SECONDS
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "a daemon of another node" in (refused.value.details() or "")
    finally:
        await server.stop(0)


@pytest.mark.parametrize(
    ("peer_nodes", "peer_address", "own"),
    [
        ({"w0"}, "ipv4:10.0.0.7:5000", True),  # names this node: from anywhere
        ({"w1"}, "ipv4:127.0.0.1:5000", False),  # names another: never, loopback or not
        ({"w1"}, "unix:/run/spotinfer/worker.sock", False),
        (set(), "ipv4:127.0.0.1:5000", True),  # names none: only a local connection
        (set(), "ipv6:[::1]:5000", True),
        (set(), "unix:/run/spotinfer/worker.sock", True),
        (set(), "ipv4:10.0.0.7:5000", False),
        (set(), "ipv6:[fd00::7]:5000", False),
    ],
)
def test_which_daemon_is_of_the_own_node(
    peer_nodes: set[str], peer_address: str, own: bool
) -> None:
    from common.authz import is_own_node

    assert is_own_node(peer_nodes, WORKER_NODE, peer_address) is own


async def test_the_redis_certificate_of_the_cluster_ca_holds_no_role(
    pki: Pki, tmp_path: Path
) -> None:
    """The local cluster's redis-server has a certificate of the cluster CA: it connects to
    an internal service but may call nothing there, having no role."""
    redis = make_server_cert(pki.ca, tmp_path, "redis")
    as_redis = TransportConfig(str(pki.ca.cert), str(redis.cert), str(redis.key))
    server, address = await _serve(pki.transport("worker"))
    try:
        assert await _stats(address, as_redis) == grpc.StatusCode.PERMISSION_DENIED
        assert await _preempt(address, as_redis) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(0)


async def test_a_plaintext_server_trusts_its_loopback_peers_as_before() -> None:
    server, address = await _serve(PLAINTEXT)
    try:
        assert await _preempt(address, PLAINTEXT) == grpc.StatusCode.OK
    finally:
        await server.stop(0)


def _served_certificate(address: str, ca_file: Path) -> bytes:
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    context.load_cert_chain(*_operator_pair)
    with (
        socket.create_connection((host, int(port)), timeout=TIMEOUT_SECONDS) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        served = tls.getpeercert(binary_form=True)
    assert served is not None
    return served


_operator_pair: tuple[str, str] = ("", "")


def _pem_to_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


async def test_a_renewed_certificate_is_served_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    global _operator_pair
    operator = pki.nodes["operator"]
    _operator_pair = (str(operator.cert), str(operator.key))
    first = make_node_cert(pki.ca, tmp_path / "a", "node", "worker")
    second = make_node_cert(pki.ca, tmp_path / "b", "node", "worker")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(first.cert, live / "node.pem")
    shutil.copy(first.key, live / "node.key")
    transport = TransportConfig(str(pki.ca.cert), str(live / "node.pem"), str(live / "node.key"))
    server, address = await _serve(transport)
    try:
        served = await asyncio.to_thread(_served_certificate, address, pki.ca.cert)
        assert served == _pem_to_der(first.cert)
        # Renewal: new files in place (key first, then the certificate).
        shutil.copy(second.key, live / "node.key.new")
        (live / "node.key.new").replace(live / "node.key")
        shutil.copy(second.cert, live / "node.pem.new")
        (live / "node.pem.new").replace(live / "node.pem")
        served = await asyncio.to_thread(_served_certificate, address, pki.ca.cert)
        assert served == _pem_to_der(second.cert)
        # And gRPC clients keep working on the renewed certificate.
        assert await _stats(address, pki.transport("coordinator")) == grpc.StatusCode.OK
    finally:
        await server.stop(0)


@pytest.mark.parametrize("missing", ["key_file", "ca_file"])
def test_a_transport_config_with_a_half_pair_is_refused(pki: Pki, missing: str) -> None:
    fields = {
        "ca_file": str(pki.ca.cert),
        "cert_file": str(pki.nodes["worker"].cert),
        "key_file": str(pki.nodes["worker"].key),
    }
    fields[missing] = ""
    with pytest.raises(ValueError):
        TransportConfig(**fields)


async def test_an_api_key_travels_on_plaintext_channels_too(tmp_path: Path) -> None:
    """A server holding keys and no TLS: the key is all that lets a caller in, sent by both
    channel kinds of the factory."""
    from common.api_keys import KeyRing, new_key
    from common.authz import Gatekeeper, roles
    from common.channels import sync_channel

    record, token = new_key("acme")
    table = {"spotinfer.v1.Worker": {"Stats": roles("tenant")}}
    server = async_server(
        0, interceptors=[AuthorizationInterceptor(table, Gatekeeper(KeyRing([record])))]
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    port = listen(server, "127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        assert await _stats(address, PLAINTEXT) == grpc.StatusCode.UNAUTHENTICATED
        async with async_channel(address, api_key=token) as channel:
            await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)

        def blocking() -> str:
            with sync_channel(address, api_key=token) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                return stub.Stats(worker_pb2.StatsRequest(), timeout=5).worker_id

        assert await asyncio.to_thread(blocking) == "w0"
    finally:
        await server.stop(0)


async def test_mutual_tls_works_over_a_unix_socket(pki: Pki, tmp_path: Path) -> None:
    """The daemon reaches its worker over a local socket; the certificate is checked as
    localhost there."""
    server = async_server(
        0, interceptors=[AuthorizationInterceptor(WORKER_AUTHORIZATION, node=WORKER_NODE)]
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    address = f"unix:{tmp_path / 'worker.sock'}"
    listen(server, address, pki.transport("worker"))
    await server.start()
    try:
        # A daemon certificate naming no node: local by the socket; one naming another node
        # is refused here too.
        assert await _preempt(address, pki.transport("daemon")) == grpc.StatusCode.OK
        other = _daemon_of(pki, tmp_path, "w1")
        assert await _preempt(address, other) == grpc.StatusCode.PERMISSION_DENIED
        assert await _stats(address, pki.client_only()) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_a_renewed_client_certificate_is_presented_without_a_restart(
    pki: Pki, tmp_path: Path
) -> None:
    """One channel and one stub, made before the renewal: the certificate under the same
    file names changes from an operator's (which may not preempt) to a coordinator's (which
    may), and the next call shows the new one."""
    from common.renewing_channel import RenewingChannel

    live = tmp_path / "live"
    live.mkdir()
    operator = pki.nodes["operator"]
    coordinator = make_node_cert(pki.ca, tmp_path / "renewed", "client", "coordinator")
    shutil.copy(operator.cert, live / "client.pem")
    shutil.copy(operator.key, live / "client.key")
    transport = TransportConfig(
        str(pki.ca.cert), str(live / "client.pem"), str(live / "client.key")
    )
    server, address = await _serve(pki.transport("worker"))

    async def preempt(stub: worker_pb2_grpc.WorkerStub) -> grpc.StatusCode:
        call = stub.Preempt(worker_pb2.PreemptRequest(deadline_unix=1.0), timeout=TIMEOUT_SECONDS)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    try:
        async with async_channel(address, transport=transport) as channel:
            assert isinstance(channel, RenewingChannel)
            stub = worker_pb2_grpc.WorkerStub(channel)
            assert await preempt(stub) == grpc.StatusCode.PERMISSION_DENIED
            # Half way: the new key is in place, the certificate not yet. The old pair stays.
            shutil.copy(coordinator.key, live / "client.key.new")
            (live / "client.key.new").replace(live / "client.key")
            assert await preempt(stub) == grpc.StatusCode.PERMISSION_DENIED
            assert channel.generation == 0
            shutil.copy(coordinator.cert, live / "client.pem.new")
            (live / "client.pem.new").replace(live / "client.pem")
            assert await preempt(stub) == grpc.StatusCode.OK
            assert channel.generation == 1
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT_SECONDS)
            assert stats.worker_id == "w0"
    finally:
        await server.stop(0)
