"""Redis as the ElastiCache / Memorystore modules configure it: TLS only, with an AUTH token.

A throw-away certificate authority signs the server's certificate for its rehearsal address;
clients verify it with ``ssl_ca_certs`` in the ``rediss://`` URL, as the GCP boot script
does with Memorystore's per-instance CA. The server runs inside its VM's namespace and keeps
nothing on disk.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spotinfer.local.certs import make_ca, make_server_cert
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


def make_tls_files(directory: Path, server_address: str) -> TlsFiles:
    """A new CA and a server certificate it signs for `server_address` (an IP SAN)."""
    ca = make_ca(directory, name="spotinfer rehearsal CA", days=_CERT_DAYS)
    server = make_server_cert(ca, directory, "redis", hosts=(server_address,), days=_CERT_DAYS)
    return TlsFiles(ca.cert, server.cert, server.key)


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
