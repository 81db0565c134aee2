"""A throw-away ``redis-server`` process on a free loopback port, for benchmarks and demos.

It keeps nothing on disk (``--save ""``, ``--appendonly no``) and lives in its own temporary
directory, so it never touches a Redis that already runs on 6379. ``stop()`` always removes
the process and the directory.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from spotinfer.local.worker_process import free_port

REDIS_SERVER_BINARY = "redis-server"
STARTUP_TIMEOUT_SECONDS = 15.0
STOP_TIMEOUT_SECONDS = 5.0
POLL_INTERVAL_SECONDS = 0.02


class RedisNotInstalled(RuntimeError):
    """No ``redis-server`` on PATH (Debian/Ubuntu: ``apt-get install redis-server``)."""


def _answers_ping(port: int) -> bool:
    # RESP by hand: the launcher needs no client library to know the server is up.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    """``with RedisProcess() as redis: RedisStore.from_url(redis.url)``."""

    def __init__(self, port: int | None = None) -> None:
        if shutil.which(REDIS_SERVER_BINARY) is None:
            raise RedisNotInstalled(f"{REDIS_SERVER_BINARY} is not on PATH")
        self.port = port if port is not None else free_port()
        self._dir = Path(tempfile.mkdtemp(prefix=f"redis-{self.port}-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        """Start the server; return once it answers PING."""
        command = [
            REDIS_SERVER_BINARY,
            *("--port", str(self.port)),
            *("--bind", "127.0.0.1"),
            *("--save", ""),
            *("--appendonly", "no"),
            *("--dir", str(self._dir)),
        ]
        self._dir.mkdir(parents=True, exist_ok=True)
        with (self._dir / "redis.log").open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not come up")
            time.sleep(POLL_INTERVAL_SECONDS)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would; `start()` brings it back on the same port, empty."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(STOP_TIMEOUT_SECONDS)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(STOP_TIMEOUT_SECONDS)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
