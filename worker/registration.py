"""The worker's registration with its coordinator(s): it joins by itself and holds a lease.

Once the engine is ready the worker calls RegisterWorker on every coordinator address it was
given, and again every ``lease_interval_seconds``; each call renews a lease the coordinator
keeps for ``lease_ttl_seconds``. Every address is renewed, not only the first that answers:
each coordinator replica keeps its own registry, and a restarted one learns the fleet from
the next round. A DNS name is one address (gRPC's resolver connects to one of its records;
behind a load balancer, that balancer picks a coordinator per connection).

    engine ready ─▶ register ─▶ renew … renew ─▶ (SIGTERM) drain, still renewing
                                                   ─▶ stop renewing ─▶ DeregisterWorker

A coordinator that refuses the worker's model (FAILED_PRECONDITION) stops it: renewing would
be refused forever. Any other failure is logged once per address and retried next round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from common.channels import PLAINTEXT, TransportConfig, async_channel
from common.messages import Registration
from protos.convert import registration_to_proto
from protos.spotinfer.v1 import control_pb2, control_pb2_grpc
from worker.constants import REGISTER_TIMEOUT_SECONDS

log = logging.getLogger(__name__)


class RegistrationRefused(RuntimeError):
    """A coordinator refused this worker for good (another model than the fleet's)."""


class Registrar:
    """Registers ``registration()`` (called afresh each round: capacity changes) with every
    coordinator in ``coordinators`` every ``interval_seconds``, over ``transport`` (with TLS:
    the worker's node certificate, to the coordinators' mutual-TLS internal port).

    `run` returns only when a coordinator refused the worker (`refusal` says why); cancel it
    to stop renewing. `deregister` tells every coordinator the worker leaves."""

    def __init__(
        self,
        coordinators: Sequence[str],
        registration: Callable[[], Registration],
        interval_seconds: float,
        timeout_seconds: float = REGISTER_TIMEOUT_SECONDS,
        transport: TransportConfig = PLAINTEXT,
    ) -> None:
        """``transport``: the worker's own (mutual TLS with its worker certificate: the
        coordinator takes RegisterWorker from node certificates only)."""
        self._coordinators = tuple(coordinators)
        self._transport = transport
        self._registration = registration
        self._interval_seconds = interval_seconds
        self._timeout_seconds = timeout_seconds
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, control_pb2_grpc.ControlStub] = {}
        for address in self._coordinators:
            self._connect(address)
        self._failing: set[str] = set()
        self.refusal: str = ""
        self.renewals = 0

    async def run(self) -> None:
        while True:
            try:
                await self.renew()
            except RegistrationRefused as refused:
                self.refusal = str(refused)
                return
            await asyncio.sleep(self._interval_seconds)

    async def renew(self) -> None:
        """One round: every coordinator at once. Raises RegistrationRefused."""
        request = registration_to_proto(self._registration())
        await asyncio.gather(*(self._register(address, request) for address in self._coordinators))
        self.renewals += 1

    async def _register(self, address: str, request: control_pb2.RegisterWorkerRequest) -> None:
        try:
            answer = await self._stubs[address].RegisterWorker(
                request, timeout=self._timeout_seconds
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.error("coordinator %s refused this worker: %s", address, exc.details())
                raise RegistrationRefused(f"{address}: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                # A fresh channel dials at once; the old one would wait out its reconnect
                # backoff, which grows past the lease while a coordinator restarts.
                await self._channels[address].close()
                self._connect(address)
            if address not in self._failing:
                log.warning(
                    "coordinator %s did not take the registration (%s); retrying every %.1f s",
                    address,
                    exc.code().name,
                    self._interval_seconds,
                )
            self._failing.add(address)
            return
        if address in self._failing or not answer.already_registered:
            log.info(
                "registered with coordinator %s as %s (fleet model %s)",
                address,
                answer.worker_id,
                answer.fleet_fingerprint,
            )
        self._failing.discard(address)

    def _connect(self, address: str) -> None:
        self._channels[address] = async_channel(address, transport=self._transport)
        self._stubs[address] = control_pb2_grpc.ControlStub(self._channels[address])

    async def deregister(self, address: str) -> None:
        """Best effort, every coordinator at once: one that does not answer finds out when
        the lease runs out."""
        request = control_pb2.DeregisterWorkerRequest(address=address)

        async def one(coordinator: str) -> None:
            try:
                await self._stubs[coordinator].DeregisterWorker(
                    request, timeout=self._timeout_seconds
                )
                log.info("deregistered from coordinator %s", coordinator)
            except grpc.aio.AioRpcError as exc:
                log.warning("coordinator %s: deregistration failed: %s", coordinator, exc.code())

        await asyncio.gather(*(one(c) for c in self._coordinators))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
