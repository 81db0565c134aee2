"""A worker's registration: the coordinator list it takes (comma-separated, repeated, or from
SPOTINFER_COORDINATOR), and the Registrar against in-process Control servers on loopback: it
renews with every coordinator, survives one that is down, and stops when refused."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest

from common.authz import AuthorizationInterceptor
from common.channels import async_server, listen
from common.errors import ServiceError
from common.messages import Registration
from common.rpc import maps_errors
from coordinator.errors import ModelMismatch
from protos.convert import registration_from_proto
from protos.spotinfer.v1 import control_pb2, control_pb2_grpc
from spotinfer.local.worker_process import free_port
from worker.config import CONFIG_SOURCE, WorkerConfig
from worker.registration import Registrar


def _resolve(*argv: str, environ: dict[str, str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    CONFIG_SOURCE.add_arguments(parser)
    return CONFIG_SOURCE.resolve(parser.parse_args(["--model", "m", *argv]), environ or {}).config


def test_coordinators_are_a_comma_separated_or_repeated_list() -> None:
    config = _resolve("--coordinator", "10.0.0.1:50051,10.0.0.2:50051", "--coordinator", "c:1")
    assert config.coordinator_addresses == ("10.0.0.1:50051", "10.0.0.2:50051", "c:1")
    from_env = _resolve(environ={"SPOTINFER_COORDINATOR": "lb.internal:50051,10.0.0.9:50051"})
    assert from_env.coordinator_addresses == ("lb.internal:50051", "10.0.0.9:50051")
    assert _resolve().coordinator_addresses == ()


def test_a_coordinator_without_a_port_is_refused() -> None:
    with pytest.raises(ValueError, match="coordinator must be host:port"):
        _resolve("--coordinator", "10.0.0.1:50051,lb.internal")


def test_pool_labels_and_lease_come_from_flags_and_env() -> None:
    config = _resolve(
        "--cloud",
        "gcp",
        "--spot",
        environ={"SPOTINFER_ZONE": "us-central1-a", "SPOTINFER_INSTANCE_TYPE": "g2-standard-8"},
    )
    assert (config.pool.cloud, config.pool.zone, config.pool.instance_type, config.pool.spot) == (
        "gcp",
        "us-central1-a",
        "g2-standard-8",
        True,
    )
    with pytest.raises(ValueError, match="lease_ttl_seconds"):
        _resolve("--lease-interval-seconds", "5", "--lease-ttl-seconds", "5")


class _Control(control_pb2_grpc.ControlServicer):
    def __init__(self, refuse: bool = False) -> None:
        self.registrations: list[Registration] = []
        self.deregistered: list[str] = []
        self.refuse = refuse

    @maps_errors
    async def RegisterWorker(  # noqa: N802
        self, request: control_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.RegisterWorkerResponse:
        if self.refuse:
            error: ServiceError = ModelMismatch(request.address, "b" * 32, "a" * 32, "test")
            raise error
        self.registrations.append(registration_from_proto(request))
        return control_pb2.RegisterWorkerResponse(
            worker_id=request.worker_id, already_registered=len(self.registrations) > 1
        )

    @maps_errors
    async def DeregisterWorker(  # noqa: N802
        self, request: control_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.DeregisterWorkerResponse:
        self.deregistered.append(request.address)
        return control_pb2.DeregisterWorkerResponse(was_registered=True)


async def _serve(control: _Control) -> tuple[grpc.aio.Server, str]:
    server = async_server(1 << 20)
    control_pb2_grpc.add_ControlServicer_to_server(control, server)
    port = listen(server, "127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _registration() -> Registration:
    return Registration(address="10.0.0.5:50061", worker_id="w", lease_ttl_seconds=6.0)


async def test_every_coordinator_is_renewed_and_one_down_does_not_stop_the_rest() -> None:
    controls = [_Control(), _Control()]
    servers = [await _serve(c) for c in controls]
    down = f"127.0.0.1:{free_port()}"
    registrar = Registrar(
        [servers[0][1], down, servers[1][1]], _registration, 0.05, timeout_seconds=0.5
    )
    try:
        for _ in range(3):
            await registrar.renew()
        assert [len(c.registrations) for c in controls] == [3, 3]
        assert controls[0].registrations[0].lease_ttl_seconds == 6.0
        await registrar.deregister("10.0.0.5:50061")
        assert [c.deregistered for c in controls] == [["10.0.0.5:50061"]] * 2
    finally:
        await registrar.close()
        for server, _ in servers:
            await server.stop(0)


async def test_a_refusal_ends_the_renewals_with_the_reason() -> None:
    control = _Control(refuse=True)
    server, address = await _serve(control)
    registrar = Registrar([address], _registration, 0.05)
    try:
        await asyncio.wait_for(registrar.run(), 5)
        assert "a" * 32 in registrar.refusal and "b" * 32 in registrar.refusal
    finally:
        await registrar.close()
        await server.stop(0)


async def test_the_worker_registers_with_its_certificate_at_a_mutual_tls_port(
    tmp_path: Path,
) -> None:
    from coordinator.server import AUTHORIZATION
    from spotinfer.local.cluster_secrets import ClusterSecrets

    secrets = ClusterSecrets.make(tmp_path)
    control = _Control()
    server = async_server(1 << 20, interceptors=[AuthorizationInterceptor(AUTHORIZATION)])
    control_pb2_grpc.add_ControlServicer_to_server(control, server)
    port = listen(server, "127.0.0.1:0", secrets.transport("coordinator"), client_auth=True)
    await server.start()
    address = f"127.0.0.1:{port}"
    with_cert = Registrar([address], _registration, 0.05, transport=secrets.transport("worker"))
    plaintext = Registrar([address], _registration, 0.05, timeout_seconds=1.0)
    try:
        await with_cert.renew()
        await plaintext.renew()  # refused at the handshake: logged, nothing registered
        assert len(control.registrations) == 1
    finally:
        await with_cert.close()
        await plaintext.close()
        await server.stop(0)
