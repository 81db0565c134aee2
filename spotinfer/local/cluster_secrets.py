"""A local cluster's certificates and API keys, made in its folder when it starts.

    <log_dir>/tls/ca.pem, ca.key              the cluster CA
    <log_dir>/tls/<role>.pem, <role>.key      coordinator, worker, daemon, operator
    <log_dir>/tls/<node>-<role>.pem, .key     a node's worker and daemon, naming the node
    <log_dir>/tls/keys.jsonl                  an admin key and a tenant key (hashes only)

The cluster itself (registration, status, the reference run on a worker) holds the operator
certificate; clients get the CA and the tenant key (`client_transport`, `api_key`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from common.api_keys import ADMIN_ROLE, TENANT_ROLE, append_key, new_key
from common.authz import DAEMON, NODE_ROLES, OPERATOR, WORKER
from common.channels import PLAINTEXT, TransportConfig
from spotinfer.local.certs import CertPaths, make_ca, make_node_cert

LOCAL_TENANT = "local"
FOLDER_NAME = "tls"
KEYS_FILE_NAME = "keys.jsonl"


@dataclass(frozen=True)
class ClusterSecrets:
    """Certificates by role, the keys file, and the keys it holds (empty: plaintext, no keys)."""

    ca: CertPaths | None = None
    nodes: tuple[tuple[str, CertPaths], ...] = ()
    keys_file: Path | None = None
    api_key: str = ""
    admin_key: str = ""

    @classmethod
    def make(cls, folder: Path) -> ClusterSecrets:
        # Absolute: the processes (redis-server among them) run in folders of their own.
        folder = folder.resolve() / FOLDER_NAME
        # A folder used before (a log folder given again) holds the certificates of another
        # CA: a node's are made on first use, and one of those would never verify.
        shutil.rmtree(folder, ignore_errors=True)
        ca = make_ca(folder)
        nodes = tuple((role, make_node_cert(ca, folder, role, role)) for role in NODE_ROLES)
        keys_file = folder / KEYS_FILE_NAME
        keys_file.unlink(missing_ok=True)
        made = []
        for tenant, role in ((LOCAL_TENANT, TENANT_ROLE), ("", ADMIN_ROLE)):
            record, token = new_key(tenant, role)
            append_key(keys_file, record)
            made.append(token)
        return cls(ca, nodes, keys_file, made[0], made[1])

    def transport(self, role: str) -> TransportConfig:
        """A process of ``role``: the CA, its certificate and key."""
        if self.ca is None:
            return PLAINTEXT
        node = dict(self.nodes)[role]
        return TransportConfig(str(self.ca.cert), str(node.cert), str(node.key))

    def node_transport(self, role: str, node: str) -> TransportConfig:
        """The worker or daemon of ``node`` (its worker id): a certificate of its own that
        names the node, made on first use, so a worker knows its own daemon from the others."""
        if self.ca is None:
            return PLAINTEXT
        if role not in (WORKER, DAEMON):
            raise ValueError(f"only workers and daemons belong to a node, not {role!r}")
        folder = self.ca.cert.parent
        paths = CertPaths(folder / f"{node}-{role}.pem", folder / f"{node}-{role}.key")
        if not paths.cert.exists():
            paths = make_node_cert(self.ca, folder, f"{node}-{role}", role, node=node)
        return TransportConfig(str(self.ca.cert), str(paths.cert), str(paths.key))

    @property
    def operator_transport(self) -> TransportConfig:
        return self.transport(OPERATOR)

    @property
    def client_transport(self) -> TransportConfig:
        """What a user's client needs: the CA to verify the coordinator (no certificate)."""
        return TransportConfig(str(self.ca.cert)) if self.ca is not None else PLAINTEXT

    def flags(self, role: str, node: str = "") -> tuple[str, ...]:
        """The transport flags of a process of ``role`` (the coordinator's keys file too);
        a worker's or daemon's of ``node`` with the node's own certificate."""
        if self.ca is None:
            return ()
        transport = self.node_transport(role, node) if node else self.transport(role)
        flags = [
            *("--transport-ca-file", transport.ca_file),
            *("--transport-cert-file", transport.cert_file),
            *("--transport-key-file", transport.key_file),
        ]
        if role == "coordinator" and self.keys_file is not None:
            flags += ["--api-keys-file", str(self.keys_file)]
        return tuple(flags)
