"""A real worker process (`python -m worker`) run by tests, benchmarks and the local cluster.

The process is started with the test environment (OMP_NUM_THREADS=1, no vLLM
multiprocessing of its own beyond the engine core), waited for until its health says
SERVING, and always stopped — SIGTERM first, SIGKILL if it does not go.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.spotinfer.v1 import worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m worker` resolves
READY_TIMEOUT_SECONDS = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


class WorkerProcess:
    """`with WorkerProcess(model, "--dtype", "float32") as worker: worker.stub.Generate(...)`."""

    def __init__(
        self, model: Path | str, *flags: str, log_dir: Path | None = None, metrics: bool = False
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # With ``metrics``: /metrics on a free port of its own (see `metrics_url`).
        self.metrics_port = free_port() if metrics else 0
        self._cmd = [
            sys.executable,
            "-m",
            "worker",
            "--model",
            str(model),
            "--port",
            str(self.port),
            *(("--metrics-port", str(self.metrics_port)) if self.metrics_port else ()),
            *flags,
        ]
        self._log_path = (log_dir or Path("/tmp")) / f"worker-{self.port}.log"
        self._lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.channel: grpc.Channel | None = None

    def start(self, wait_ready: bool = True) -> WorkerProcess:
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
        if wait_ready:
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

    def health(self) -> int:
        assert self.channel is not None
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status

    def wait_serving(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.output[-4000:]}")
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"worker not SERVING after {timeout}s:\n{self.output[-4000:]}")

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        assert self.channel is not None
        return worker_pb2_grpc.WorkerStub(self.channel)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (a drain), then the exit code; SIGKILL if it does not stop in time."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.process.returncode)

    def kill(self) -> None:
        assert self.process is not None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.terminate(timeout=30)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
