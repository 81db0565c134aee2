"""Every gRPC channel and server of spotinfer is built here, so transport security is decided
in one place.

    TransportConfig ──▶ sync_channel / async_channel   (clients: coordinator, daemon, tools)
                   └──▶ async_server + listen          (coordinator, worker, daemon)
                   └──▶ http_ssl_context               (the coordinator's HTTP front)

A TransportConfig without files is plaintext (loopback, tests). With a CA file a client
verifies the server against that CA and, with a certificate and key, shows its own (mutual
TLS). A server with a certificate and key serves TLS; with ``require_client_cert`` it refuses
any client without a certificate signed by the CA (the internal services); the public front
passes ``client_auth=False``.

Renewal: servers load their certificate through a fetcher gRPC calls at each handshake; it
rereads the files when one changed (mtime or size), so a renewed certificate is served
without a restart. An asyncio client channel (every process's) looks at the same stamps on
each call and, when they changed, makes the next call on a channel rebuilt from the new files
(`common.renewing_channel`): renewed client certificates need no restart either. A blocking
channel (the user's tools, short-lived) reads the files when it is made.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from common.renewing_channel import RenewingChannel
from common.rpc import RejectsUndecodable

log = logging.getLogger(__name__)

ChannelOptions = Sequence[tuple[str, Any]]
UNIX_SOCKET_SERVER_NAME = "localhost"


@dataclass(frozen=True)
class TransportConfig:
    """How a channel or server protects its connections; no files: plaintext."""

    ca_file: str = field(
        default="",
        metadata={
            "help": "PEM CA bundle that signs the cluster's certificates: clients verify "
            "servers with it, servers verify client certificates; empty: plaintext"
        },
    )
    cert_file: str = field(
        default="", metadata={"help": "PEM certificate (chain) this process presents"}
    )
    key_file: str = field(default="", metadata={"help": "PEM private key of cert_file"})
    require_client_cert: bool = field(
        default=True,
        metadata={
            "help": "internal servers refuse clients without a certificate from the CA "
            "(mutual TLS); the public front never asks for one"
        },
    )

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("transport cert_file and key_file must be given together")
        if self.cert_file and not self.ca_file:
            raise ValueError("transport cert_file needs ca_file (the cluster CA)")
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"transport {name} {path!r} is not a file")

    @property
    def tls(self) -> bool:
        """Whether connections are TLS (a CA is configured)."""
        return bool(self.ca_file)

    @property
    def can_serve_tls(self) -> bool:
        return bool(self.ca_file and self.cert_file)


PLAINTEXT = TransportConfig()


def message_size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """The largest message a channel or server sends and receives; 0: gRPC's own limits."""
    if not max_message_bytes:
        return []
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    # No SO_REUSEPORT: a second server on a taken port must fail, not share it.
    return [*message_size_options(max_message_bytes), ("grpc.so_reuseport", 0)]


def channel_credentials(transport: TransportConfig) -> grpc.ChannelCredentials:
    """The CA to verify the server with and, where configured, this process's certificate."""
    assert transport.tls, "plaintext has no credentials"
    root = Path(transport.ca_file).read_bytes()
    if transport.cert_file:
        return grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=Path(transport.key_file).read_bytes(),
            certificate_chain=Path(transport.cert_file).read_bytes(),
        )
    return grpc.ssl_channel_credentials(root_certificates=root)


def sync_channel(
    address: str,
    max_message_bytes: int = 0,
    transport: TransportConfig = PLAINTEXT,
    api_key: str = "",
) -> grpc.Channel:
    """A blocking channel to ``address`` (``host:port`` or ``unix:/path``); ``api_key`` goes
    with every call as ``authorization: Bearer <key>``."""
    options = message_size_options(max_message_bytes)
    if transport.tls:
        options += _tls_target_options(address)
        credentials = channel_credentials(transport)
        if api_key:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(api_key)
            )
        return grpc.secure_channel(address, credentials, options=options)
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _BearerKey(api_key)) if api_key else channel


def async_channel(
    address: str,
    max_message_bytes: int = 0,
    transport: TransportConfig = PLAINTEXT,
    api_key: str = "",
    own_connection: bool = False,
) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (``host:port`` or ``unix:/path``); ``api_key`` as
    for `sync_channel`. With TLS it follows renewals of the transport's files.
    ``own_connection``: the channel opens a connection of its own instead of sharing one
    with other channels to the same address (gRPC pools them per process): parallel
    channels are then separate TCP flows."""
    options = message_size_options(max_message_bytes)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if transport.tls:
        options += _tls_target_options(address)

        def build() -> grpc.aio.Channel:
            credentials = channel_credentials(transport)
            if api_key:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(api_key)
                )
            return grpc.aio.secure_channel(address, credentials, options=options)

        files = CertificateFiles(transport)
        return RenewingChannel(build, files.changed, files.pair_usable)
    interceptors = [_AsyncBearerUnary(api_key), _AsyncBearerStream(api_key)] if api_key else None
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def _tls_target_options(address: str) -> list[tuple[str, Any]]:
    """A unix socket has no host name: gRPC would check the certificate against the socket's
    path. The process behind a local socket is checked as ``localhost`` (every node
    certificate names it)."""
    if address.startswith("unix:"):
        return [("grpc.ssl_target_name_override", UNIX_SOCKET_SERVER_NAME)]
    return []


def _with_key(details: Any, api_key: str) -> Any:
    metadata = [*(details.metadata or ()), ("authorization", f"Bearer {api_key}")]
    return details._replace(metadata=metadata)


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The API key on a plaintext blocking channel (gRPC sends call credentials only on
    TLS)."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_key(details, self._api_key), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_key(details, self._api_key), request)


class _AsyncBearerUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_key(details, self._api_key), request)


class _AsyncBearerStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_key(details, self._api_key), request)


def async_server(
    max_message_bytes: int,
    transport: TransportConfig = PLAINTEXT,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.aio.Server:
    """An asyncio server with the message limits (and, e.g., the authorization interceptor of
    `common.authz`) that answers an undecodable request INVALID_ARGUMENT
    (`RejectsUndecodable`); bind it with `listen`."""
    return grpc.aio.server(
        options=server_options(max_message_bytes),
        interceptors=[*interceptors, RejectsUndecodable()],
    )


def listen(
    server: grpc.aio.Server,
    address: str,
    transport: TransportConfig = PLAINTEXT,
    client_auth: bool | None = None,
) -> int:
    """Binds ``address`` (``host:port``, port 0 picks one, or ``unix:/path``); returns the port.
    TLS when the transport has a certificate; ``client_auth`` (default: the transport's
    ``require_client_cert``) refuses clients without a CA-signed certificate."""
    if not transport.can_serve_tls:
        if transport.tls:
            raise ValueError("a TLS server needs transport cert_file and key_file")
        return server.add_insecure_port(address)
    require = transport.require_client_cert if client_auth is None else client_auth
    return server.add_secure_port(address, server_credentials(transport, require))


def server_credentials(transport: TransportConfig, require_client_cert: bool) -> Any:
    """Credentials that reread the certificate files whenever they change."""
    files = CertificateFiles(transport)
    return grpc.dynamic_ssl_server_credentials(
        files.server_configuration(),
        files.fetch_if_changed,
        require_client_authentication=require_client_cert,
    )


def http_ssl_context(transport: TransportConfig) -> ssl.SSLContext | None:
    """The HTTP front's TLS (server authentication only); None for plaintext. Call
    `CertificateFiles.reload_into` to pick up renewed files."""
    if not transport.can_serve_tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(transport.cert_file, transport.key_file)
    return context


class CertificateFiles:
    """A process's certificate, key and CA files and the stamp (mtime, size) they were last
    read at; `fetch_if_changed` is gRPC's certificate-configuration fetcher."""

    def __init__(self, transport: TransportConfig) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._stamp = self._current_stamp()

    def _paths(self) -> tuple[str, ...]:
        t = self._transport
        return (t.cert_file, t.key_file, t.ca_file)

    def _current_stamp(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in self._paths():
            try:
                info = os.stat(path)
            except OSError:
                stamps.append((0, 0))
            else:
                stamps.append((info.st_mtime_ns, info.st_size))
        return tuple(stamps)

    def pair_usable(self) -> bool:
        """Whether the certificate and key belong together (no certificate: True); False
        while a renewal is half written."""
        t = self._transport
        if not t.cert_file:
            return True
        try:
            ssl.create_default_context().load_cert_chain(t.cert_file, t.key_file)
        except (OSError, ssl.SSLError):
            return False
        return True

    def server_configuration(self) -> Any:
        t = self._transport
        pair = (Path(t.key_file).read_bytes(), Path(t.cert_file).read_bytes())
        return grpc.ssl_server_certificate_configuration(
            [pair], root_certificates=Path(t.ca_file).read_bytes()
        )

    def changed(self) -> bool:
        """True (once) when a file changed since the last read."""
        stamp = self._current_stamp()
        with self._lock:
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            return True

    def fetch_if_changed(self) -> Any:
        """A new configuration when the files changed, None to keep the current one. A
        half-written pair (key not matching yet) keeps the old one until the next handshake."""
        if not self.changed():
            return None
        try:
            configuration = self.server_configuration()
        except OSError as exc:
            log.warning("certificate files unreadable, keeping the current ones: %s", exc)
            return None
        log.info("certificate files changed: serving %s", self._transport.cert_file)
        return configuration

    def reload_into(self, context: ssl.SSLContext) -> bool:
        """Loads changed files into an HTTP front's context; True when it did."""
        if not self.changed():
            return False
        try:
            context.load_cert_chain(self._transport.cert_file, self._transport.key_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning("certificate files unusable, keeping the current ones: %s", exc)
            return False
        return True
