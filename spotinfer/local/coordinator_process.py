"""A real coordinator process (`python -m coordinator`) for tests and benchmarks.

Started on free ports with the given flags, waited for until it prints its listening line,
always stopped (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from protos.spotinfer.v1 import control_pb2_grpc, inference_pb2_grpc
from spotinfer.local.worker_process import REPO_ROOT, free_port, process_environment

START_TIMEOUT_SECONDS = 60.0


class CoordinatorProcess:
    def __init__(
        self,
        *flags: str,
        log_dir: Path | None = None,
        port: int | None = None,
        http_port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self._cmd = [
            sys.executable,
            "-m",
            "coordinator",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            *flags,
        ]
        self._log_path = (log_dir or Path("/tmp")) / f"coordinator-{self.port}.log"
        self._lines: list[str] = []
        self._listening = threading.Event()
        self.process: subprocess.Popen[str] | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> CoordinatorProcess:
        if self.process is not None and self.process.poll() is None:
            # A second process would find the port taken and exit, leaving the first one
            # running with nobody to stop it.
            raise RuntimeError(f"the coordinator on {self.address} is already running")
        self._listening.clear()
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
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not self._listening.wait(0.1):
            if self.process.poll() is not None:
                raise RuntimeError(f"coordinator exited early:\n{self.output[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"coordinator did not start:\n{self.output[-4000:]}")
        self.channel = grpc.insecure_channel(self.address)
        return self

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with open(self._log_path, "w") as log:
            for line in self.process.stdout:
                self._lines.append(line)
                if "listening on" in line:
                    self._listening.set()
                log.write(line)
                log.flush()

    @property
    def output(self) -> str:
        return "".join(self._lines)

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
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
