"""Everything a local cluster's Redis needs to run locked down, written into one directory:
the server's certificate (TLS with CA verification; spotinfer/local/certs.py) signed by the
cluster's CA, or by a CA of its own when there is none, an ``aclfile`` with one user per role
(store/acl.py) plus the operator's ``default`` user, each with a random password in its own
file, and the cluster's KV MAC keyring.

``server_args(port)`` are redis-server's flags (``cluster_bus_args()`` besides for a node of a
Redis Cluster, whose nodes share one set of these files); ``store_flags(url, role)`` the
flags a process of that role connects with, as its own ACL user.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotinfer.local.certs import CertPaths, make_ca, make_server_cert
from store.acl import Role, acl_file_line
from store.mac_keyring import new_keyring_text
from store.store_config import StoreConfig

ADMIN_USER = "default"
ACL_FILE = "users.acl"
KEYRING_FILE = "kv-mac.keys"
SERVER_CERT_NAME = "redis"
# The server's certificate (and a CA of its own) lie in its temporary directory and die with it.
CERT_VALID_DAYS = 1


@dataclass(frozen=True)
class RedisSecurity:
    directory: Path
    ca_file: Path
    server_cert: CertPaths
    acl_file: Path
    keyring_file: Path

    @classmethod
    def create(cls, directory: Path, ca: CertPaths | None = None) -> RedisSecurity:
        """The files in ``directory``; the server's certificate signed by ``ca`` (the local
        cluster's, which its gRPC TLS uses too), or by a new CA of its own when None."""
        directory.mkdir(parents=True, exist_ok=True)
        tls = directory / "tls"
        if ca is None:
            ca = make_ca(tls, days=CERT_VALID_DAYS)
        server_cert = make_server_cert(ca, tls, SERVER_CERT_NAME, days=CERT_VALID_DAYS)
        lines = []
        for user in (ADMIN_USER, *(role.value for role in Role)):
            password = secrets.token_hex(16)
            password_file = directory / f"{user}.password"
            password_file.write_text(password + "\n")
            password_file.chmod(0o600)
            if user == ADMIN_USER:
                lines.append(f"user {ADMIN_USER} on >{password} ~* &* +@all")
            else:
                lines.append(acl_file_line(Role(user), password))
        acl_file = directory / ACL_FILE
        acl_file.write_text("\n".join(lines) + "\n")
        acl_file.chmod(0o600)
        keyring_file = directory / KEYRING_FILE
        keyring_file.write_text(new_keyring_text())
        keyring_file.chmod(0o600)
        return cls(directory, ca.cert, server_cert, acl_file, keyring_file)

    def password_file(self, user: str) -> Path:
        return self.directory / f"{user}.password"

    def password(self, user: str) -> str:
        return self.password_file(user).read_text().strip()

    def server_args(self, port: int) -> list[str]:
        """TLS only (no plaintext port), clients verified only if they show a certificate,
        users from the aclfile."""
        return [
            *("--port", "0"),
            *("--tls-port", str(port)),
            *("--tls-cert-file", str(self.server_cert.cert)),
            *("--tls-key-file", str(self.server_cert.key)),
            *("--tls-ca-cert-file", str(self.ca_file)),
            *("--tls-auth-clients", "optional"),
            *("--aclfile", str(self.acl_file)),
        ]

    def cluster_bus_args(self) -> list[str]:
        """A cluster node's bus and replication links over TLS as well, with the same
        certificate both ways (it is good as a client certificate too)."""
        return [*("--tls-cluster", "yes"), *("--tls-replication", "yes")]

    def admin_options(self) -> dict[str, str]:
        """redis-py options of the operator's user (leak checks, scans, cluster set-up)."""
        return {
            "username": ADMIN_USER,
            "password": self.password(ADMIN_USER),
            "ssl_ca_certs": str(self.ca_file),
        }

    def store_config(self, url: str, role: Role, **overrides: Any) -> StoreConfig:
        """The StoreConfig of a process of ``role`` on the rediss:// ``url``."""
        settings: dict[str, Any] = {
            "url": url,
            "tls_ca_file": str(self.ca_file),
            "username": role.value,
            "password_file": str(self.password_file(role.value)),
            "mac_key_file": str(self.keyring_file),
        }
        return StoreConfig(**{**settings, **overrides})

    def store_flags(self, url: str, role: Role) -> list[str]:
        """The store flags of a process of ``role`` on the rediss:// ``url``."""
        return [
            *("--redis-url", url),
            *("--redis-tls-ca-file", str(self.ca_file)),
            *("--redis-username", role.value),
            *("--redis-password-file", str(self.password_file(role.value))),
            *("--kv-mac-key-file", str(self.keyring_file)),
        ]
