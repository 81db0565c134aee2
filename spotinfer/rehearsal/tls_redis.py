"""Redis as the ElastiCache / Memorystore modules configure it: TLS only, with an AUTH token.

A throw-away certificate authority signs the server's certificate for its rehearsal address;
clients verify it with ``ssl_ca_certs`` in the ``rediss://`` URL, as the GCP boot script
does with Memorystore's per-instance CA. The server runs inside its VM's namespace and keeps
nothing on disk.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spotinfer.local.managed_process import ManagedProcess
from spotinfer.rehearsal.netns import Host

if TYPE_CHECKING:
    from typing_extensions import Self

REDIS_TLS_PORT = 6379  # ElastiCache's and Memorystore's port, TLS or not
START_TIMEOUT_SECONDS = 15.0
STOP_TIMEOUT_SECONDS = 5.0
READY_LINE = "Ready to accept connections"
_CERT_DAYS = 2


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_tls_files(directory: Path, server_address: str) -> TlsFiles:
    """A new CA and a server certificate it signs for `server_address` (an IP SAN)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    expiry = now + datetime.timedelta(days=_CERT_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("spotinfer rehearsal CA"))
        .issuer_name(_name("spotinfer rehearsal CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(expiry)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_address))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("redis"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(expiry)
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.pem", directory / "redis.pem", directory / "redis-key.pem")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(_pem_key(key))
    files.server_key.chmod(0o600)
    return files


class TlsRedis(ManagedProcess):
    """``redis-server`` with ``--port 0 --tls-port 6379 --requirepass`` in `host`'s namespace."""

    def __init__(self, host: Host, directory: Path, port: int = REDIS_TLS_PORT) -> None:
        self.host = host
        self.port = port
        self.password = secrets.token_urlsafe(24)
        self.directory = directory
        self.tls = make_tls_files(directory / "tls", host.address)
        self._ready = threading.Event()
        super().__init__("redis-tls", directory / "redis.log", cwd=directory)

    def url(self, ca_file: Path | None = None) -> str:
        """The ``rediss://`` URL a node's env file carries, verifying with the CA."""
        ca = ca_file or self.tls.ca_cert
        return f"rediss://:{self.password}@{self.host.address}:{self.port}/0?ssl_ca_certs={ca}"

    def on_line(self, line: str) -> None:
        if READY_LINE in line:
            self._ready.set()

    def start(self) -> Self:
        self._ready.clear()
        self.spawn(
            self.host.command(
                [
                    "redis-server",
                    *("--port", "0"),
                    *("--tls-port", str(self.port)),
                    *("--bind", self.host.address),
                    *("--tls-cert-file", str(self.tls.server_cert)),
                    *("--tls-key-file", str(self.tls.server_key)),
                    *("--tls-ca-cert-file", str(self.tls.ca_cert)),
                    *("--tls-auth-clients", "no"),
                    *("--requirepass", self.password),
                    *("--save", ""),
                    *("--appendonly", "no"),
                    *("--dir", str(self.directory)),
                ]
            )
        )
        self.wait_until(self._ready.is_set, START_TIMEOUT_SECONDS, poll_seconds=0.05)
        return self

    def stop(self) -> None:
        self.terminate(STOP_TIMEOUT_SECONDS)
