"""A TCP link that a test can cut: 127.0.0.1:port forwards to a server's port until `cut`,
which resets every connection through it and refuses new ones (the server stays up for
whoever reaches it another way) — a network partition between some processes and a server."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

from spotinfer.local.managed_process import free_port

BUFFER_BYTES = 1 << 16


class TcpLink:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.open()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def open(self) -> None:
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Every connection reset, and no new one accepted (connection refused)."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                # A reset, not a close: the peer's next read or write fails at once.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((self.host, self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def __enter__(self) -> TcpLink:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.cut()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(BUFFER_BYTES):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
