"""Every gRPC channel and server of spotinfer is built here, so transport security is decided
in one place.

    TransportConfig ──▶ sync_channel / async_channel   (clients: coordinator, daemon, tools)
                   └──▶ async_server + listen          (coordinator, worker, daemon)

Only the insecure transport exists today; TLS credentials would be made in `_credentials`
from fields of TransportConfig, and `listen` / the channel makers would use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from common.rpc import RejectsUndecodable

INSECURE = "insecure"
TRANSPORT_MODES = (INSECURE,)

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class TransportConfig:
    """How a channel or server protects its connections."""

    mode: str = INSECURE
    """Transport security: insecure (plaintext, for a private network or loopback)."""

    def __post_init__(self) -> None:
        if self.mode not in TRANSPORT_MODES:
            raise ValueError(f"transport mode must be one of {TRANSPORT_MODES}, got {self.mode!r}")


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


def sync_channel(
    address: str, max_message_bytes: int = 0, transport: TransportConfig = PLAINTEXT
) -> grpc.Channel:
    """A blocking channel to ``address`` (``host:port`` or ``unix:/path``)."""
    _credentials(transport)
    return grpc.insecure_channel(address, options=message_size_options(max_message_bytes))


def async_channel(
    address: str, max_message_bytes: int = 0, transport: TransportConfig = PLAINTEXT
) -> grpc.aio.Channel:
    """An asyncio channel to ``address`` (``host:port`` or ``unix:/path``)."""
    _credentials(transport)
    return grpc.aio.insecure_channel(address, options=message_size_options(max_message_bytes))


def async_server(max_message_bytes: int, transport: TransportConfig = PLAINTEXT) -> grpc.aio.Server:
    """An asyncio server with the message limits that answers an undecodable request
    INVALID_ARGUMENT (`RejectsUndecodable`); bind it with `listen`."""
    _credentials(transport)
    return grpc.aio.server(
        options=server_options(max_message_bytes), interceptors=(RejectsUndecodable(),)
    )


def listen(server: grpc.aio.Server, address: str, transport: TransportConfig = PLAINTEXT) -> int:
    """Binds ``address`` (``host:port``, port 0 picks one, or ``unix:/path``); returns the port."""
    _credentials(transport)
    return server.add_insecure_port(address)


def _credentials(transport: TransportConfig) -> None:
    """Where channel and server credentials are made: nothing to make for plaintext."""
    assert transport.mode == INSECURE, transport.mode
