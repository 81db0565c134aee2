"""A real context daemon process (`python -m context_daemon`) run by tests and the local
cluster: started, waited for until its health says SERVING, always stopped (SIGTERM first,
SIGKILL if it does not go)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.spotinfer.v1 import daemon_pb2_grpc
from spotinfer.local.worker_process import REPO_ROOT, free_port, process_environment

READY_TIMEOUT_SECONDS = 60.0


class DaemonProcess:
    """`with DaemonProcess("--notice-source", "aws", "--metadata-url", url, ...) as daemon:`."""

    def __init__(self, *flags: str, log_dir: Path | None = None, metrics: bool = False) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # With ``metrics``: /metrics on a free port of its own (see `metrics_url`).
        self.metrics_port = free_port() if metrics else 0
        self._cmd = [
            sys.executable,
            "-m",
            "context_daemon",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(("--metrics-port", str(self.metrics_port)) if self.metrics_port else ()),
            *flags,
        ]
        self._log_path = (log_dir or Path("/tmp")) / f"daemon-{self.port}.log"
        self._lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> DaemonProcess:
        self.process = subprocess.Popen(
            self._cmd,
            cwd=REPO_ROOT,
            env=process_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        self.channel = grpc.insecure_channel(self.address)
        self.wait_serving()
        return self

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with open(self._log_path, "w") as log:
            for line in self.process.stdout:
                self._lines.append(line)
                log.write(line)
                log.flush()

    @property
    def metrics_url(self) -> str:
        assert self.metrics_port, "started without metrics=True"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def wait_serving(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        assert self.channel is not None and self.process is not None
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited early:\n{self.output[-4000:]}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"daemon not SERVING after {timeout}s:\n{self.output[-4000:]}")

    @property
    def stub(self) -> daemon_pb2_grpc.ContextDaemonStub:
        assert self.channel is not None
        return daemon_pb2_grpc.ContextDaemonStub(self.channel)

    def stop(self, timeout: float = 30.0) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
