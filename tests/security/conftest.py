"""A cluster CA with node certificates of every role, a foreign CA, and a keys file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from common.api_keys import ADMIN_ROLE, TENANT_ROLE, append_key, new_key
from common.channels import TransportConfig
from spotinfer.local.certs import CertPaths, make_ca, make_node_cert


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca: CertPaths
    nodes: dict[str, CertPaths]
    foreign: CertPaths  # a node cert signed by another CA

    def transport(self, role: str, **kwargs: object) -> TransportConfig:
        node = self.nodes[role]
        return TransportConfig(str(self.ca.cert), str(node.cert), str(node.key), **kwargs)  # type: ignore[arg-type]

    def client_only(self) -> TransportConfig:
        """Verifies the server, shows no certificate (a public client)."""
        return TransportConfig(str(self.ca.cert))

    def foreign_client(self) -> TransportConfig:
        return TransportConfig(str(self.ca.cert), str(self.foreign.cert), str(self.foreign.key))


@pytest.fixture(scope="package")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder)
    nodes = {
        role: make_node_cert(ca, folder, role, role)
        for role in ("coordinator", "worker", "daemon", "operator")
    }
    other = make_ca(folder / "other", name="someone else's CA")
    foreign = make_node_cert(other, folder / "other", "intruder", "coordinator")
    return Pki(folder, ca, nodes, foreign)


@dataclass(frozen=True)
class Keys:
    file: Path
    tenant: str
    admin: str
    limited: str  # a second tenant key, for the rate-limit tests


@pytest.fixture(scope="package")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    path = tmp_path_factory.mktemp("keys") / "keys.jsonl"
    made = {}
    for name, tenant, role in (
        ("tenant", "acme", TENANT_ROLE),
        ("admin", "", ADMIN_ROLE),
        ("limited", "globex", TENANT_ROLE),
    ):
        record, token = new_key(tenant, role)
        append_key(path, record)
        made[name] = token
    return Keys(path, made["tenant"], made["admin"], made["limited"])
