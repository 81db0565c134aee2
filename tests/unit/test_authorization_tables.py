"""Every RPC of every service has a row in its server's authorization table: an RPC added to
a .proto without one is refused to everyone (the interceptor fails closed), which would show
up only when a caller first tries it — here it fails the suite at once."""

from __future__ import annotations

from typing import Any

import pytest

import context_daemon.server
import coordinator.server
import worker.server
from protos.spotinfer.v1 import control_pb2, daemon_pb2, inference_pb2, worker_pb2

SERVICES: list[tuple[Any, str, dict[str, dict[str, frozenset[str]]]]] = [
    (inference_pb2, "Inference", coordinator.server.AUTHORIZATION),
    (control_pb2, "Control", coordinator.server.AUTHORIZATION),
    (worker_pb2, "Worker", worker.server.AUTHORIZATION),
    (daemon_pb2, "ContextDaemon", context_daemon.server.AUTHORIZATION),
]


@pytest.mark.parametrize(("module", "service", "table"), SERVICES, ids=[s[1] for s in SERVICES])
def test_every_rpc_has_a_row(
    module: Any, service: str, table: dict[str, dict[str, frozenset[str]]]
) -> None:
    descriptor = module.DESCRIPTOR.services_by_name[service]
    rows = table[descriptor.full_name]
    methods = {method.name for method in descriptor.methods}
    assert methods - set(rows) == set(), f"{service}: RPCs with no authorization row"
    assert set(rows) - methods == set(), f"{service}: rows for RPCs the service lacks"
    assert all(rows.values()), f"{service}: a row that lets no role in"
