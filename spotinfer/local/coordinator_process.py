"""A real coordinator process (`python -m coordinator`) for tests and benchmarks.

Started on free ports with the given flags, waited for until it prints its listening line,
always stopped (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from common.channels import PLAINTEXT, TransportConfig
from protos.spotinfer.v1 import control_pb2_grpc, inference_pb2_grpc
from spotinfer.local.managed_process import ServiceProcess, free_port

if TYPE_CHECKING:
    from typing_extensions import Self

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 30.0
LISTENING_LINE = "listening on"  # what coordinator/server.py prints once it serves
ADDRESS_IN_USE = "address already in use"  # the bind error a taken port gives
PORT_ATTEMPTS = 3


class CoordinatorProcess(ServiceProcess):
    def __init__(
        self,
        *flags: str,
        log_dir: Path | None = None,
        port: int | None = None,
        http_port: int | None = None,
        transport: TransportConfig = PLAINTEXT,
        api_key: str = "",
        internal_port: int | None = None,
    ) -> None:
        """With a TLS ``transport`` (the launcher's own certificate, which the coordinator's
        flags must also configure) `channel` goes to the mutual-TLS internal port."""
        super().__init__(
            "coordinator", log_dir, port=port or 0, transport=transport, api_key=api_key
        )
        # Ports we picked may be taken by someone else before the child binds them: then
        # the start tries again on new ones. Ports the caller named are kept.
        self._picked_ports = not (port or http_port or internal_port)
        self._flags = flags
        self._use_ports(self.port, http_port or free_port(), internal_port or free_port())
        self._listening = threading.Event()

    def _use_ports(self, port: int, http_port: int, internal_port: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.channel_address = self.address
        self.http_port = http_port
        scheme = "https" if self.transport.tls else "http"
        self.http_url = f"{scheme}://127.0.0.1:{self.http_port}"
        self.internal_port = internal_port
        self.internal_address = f"127.0.0.1:{self.internal_port}"
        if self.transport.tls:
            self.channel_address = self.internal_address
        self._cmd = [
            *(sys.executable, "-m", "coordinator"),
            *("--port", str(self.port)),
            *("--http-port", str(self.http_port)),
            *("--internal-port", str(self.internal_port)),
            *self._flags,
        ]

    def start(self) -> Self:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._listening.clear()
            self.spawn(self._cmd)
            try:
                self.wait_until(self._listening.is_set, START_TIMEOUT_SECONDS, poll_seconds=0.1)
                return self
            except RuntimeError as exc:
                if not self._picked_ports or ADDRESS_IN_USE not in str(exc):
                    raise
                if attempt == PORT_ATTEMPTS:
                    raise
                self.close_channel()
                self._use_ports(free_port(), free_port(), free_port())
        return self

    def on_line(self, line: str) -> None:
        if LISTENING_LINE in line:
            self._listening.set()

    @property
    def inference(self) -> inference_pb2_grpc.InferenceStub:
        assert self.channel is not None
        return inference_pb2_grpc.InferenceStub(self.channel)

    @property
    def control(self) -> control_pb2_grpc.ControlStub:
        assert self.channel is not None
        return control_pb2_grpc.ControlStub(self.channel)

    def kill(self) -> None:
        """SIGKILL, as a crash or a vanished VM would: no drain."""
        self.close_channel()
        super().kill()

    def stop(self) -> None:
        self.close_channel()
        self.terminate(STOP_TIMEOUT_SECONDS)
