"""A real context daemon process (`python -m context_daemon`) run by tests and the local
cluster: started, waited for until its health says SERVING, always stopped (SIGTERM first,
SIGKILL if it does not go).

``wrap`` starts it through a command prefix (``ip netns exec <namespace>``: a daemon on a VM
of a test's network, listening on ``host`` there); such a daemon is ready once it prints the
line that it listens, since this process may have no route to it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.channels import PLAINTEXT, TransportConfig
from protos.spotinfer.v1 import daemon_pb2_grpc
from spotinfer.local.managed_process import ServiceProcess

if TYPE_CHECKING:
    from typing_extensions import Self

READY_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 30.0
LISTENING_LINE = " listening on "  # context_daemon.server prints it once it serves


class DaemonProcess(ServiceProcess):
    """`with DaemonProcess("--notice-source", "aws", "--metadata-url", url, ...) as daemon:`."""

    def __init__(
        self,
        *flags: str,
        log_dir: Path | None = None,
        metrics: bool = False,
        transport: TransportConfig = PLAINTEXT,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
    ) -> None:
        super().__init__("daemon", log_dir, metrics, transport=transport)
        self.address = self.channel_address = f"{host}:{self.port}"
        self._wrapped = bool(wrap)
        self._cmd = [
            *wrap,
            *(sys.executable, "-m", "context_daemon"),
            *("--host", host),
            *("--port", str(self.port)),
            *self.metrics_flags,
            *flags,
        ]

    def start(self) -> Self:
        self.spawn(self._cmd)
        if self._wrapped:
            self.wait_until(lambda: LISTENING_LINE in self.output, READY_TIMEOUT_SECONDS, 0.1)
        else:
            self.wait_serving(READY_TIMEOUT_SECONDS, poll_seconds=0.1)
        return self

    @property
    def stub(self) -> daemon_pb2_grpc.ContextDaemonStub:
        assert self.channel is not None
        return daemon_pb2_grpc.ContextDaemonStub(self.channel)

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        self.close_channel()
        self.terminate(timeout)
