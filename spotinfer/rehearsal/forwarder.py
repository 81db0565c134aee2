"""A way into a VM for the process that runs the rehearsal: a unix socket whose connections
leave from inside the VM.

    gRPC channel "unix:<path>" ──▶ forwarder ──(TCP socket made in the client VM)──▶ target

A unix socket is a file, seen from every network namespace; the TCP socket of each
forwarded connection is created inside the client VM's namespace, so the bytes cross the
rehearsal network from the client VM exactly as a client there would send them. The
forwarder only ever connects to the one target address it was given.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from types import TracebackType

from spotinfer.rehearsal.netns import Host

_CHUNK_BYTES = 1 << 16
_CONNECT_TIMEOUT_SECONDS = 5.0


class Forwarder:
    """``with Forwarder(client_vm, ("10.213.0.2", 50051), path) as fw: grpc.insecure_channel(
    fw.target)``."""

    def __init__(self, origin: Host, target: tuple[str, int], path: Path) -> None:
        self.origin = origin
        self.destination = target
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._closed = threading.Event()
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def target(self) -> str:
        """The gRPC target for a channel through this forwarder."""
        return f"unix:{self.path}"

    def __enter__(self) -> Forwarder:
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        threading.Thread(target=self._accept, name="forwarder", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(inbound,), daemon=True).start()

    def _open(self, inbound: socket.socket) -> None:
        try:
            with self.origin.entered():
                outbound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            outbound.settimeout(_CONNECT_TIMEOUT_SECONDS)
            outbound.connect(self.destination)
            outbound.settimeout(None)
        except OSError:
            inbound.close()
            return
        with self._lock:
            self._connections += [inbound, outbound]
        threading.Thread(target=self._pump, args=(outbound, inbound), daemon=True).start()
        self._pump(inbound, outbound)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(_CHUNK_BYTES):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        with self._lock:
            for connection in self._connections:
                connection.close()
        self.path.unlink(missing_ok=True)
