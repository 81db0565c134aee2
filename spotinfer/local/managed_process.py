"""A child process this process owns: the one launcher under Redis, coordinator, worker and
daemon processes of tests, benchmarks and the local cluster.

    spawn ──▶ output pump (log file + memory) ──▶ wait_until(ready) ──▶ terminate / kill
              (own process group; dies with us)                          (SIGTERM, then SIGKILL)

No orphans: each child leads its own process group (so SIGKILL reaches whatever it forked)
and, on Linux, asks the kernel to SIGKILL it when its parent dies (PR_SET_PDEATHSIG, set by
an exec wrapper before the real command). The kernel sends that signal when the *thread*
that forked the child ends, not the process, and the local cluster starts workers from
short-lived loader threads; so every child is forked from one spawner thread that lives as
long as this process.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.channels import PLAINTEXT, TransportConfig, sync_channel

if TYPE_CHECKING:
    from typing_extensions import Self

REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m worker` etc. resolve
OUTPUT_TAIL_CHARS = 4000
# How long to wait for a SIGKILLed process to be reaped. It cannot refuse to die, but on a
# loaded machine its end can take a while: a worker of two tensor-parallel ranks killed while
# its standby prefills took over 10 s once, with the whole machine stalled for 8 s.
KILL_WAIT_SECONDS = 60.0
# argv: parent pid, then the command. prctl option 1 is PR_SET_PDEATHSIG (<linux/prctl.h>);
# the setting survives the exec.
_DEATH_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
# The one thread that forks every child (see the module docstring): created on first use,
# it idles until the interpreter exits.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="managed-process-spawner")


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICKED_PORT = 10000
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range: the kernel's own pick (port 0) comes from that range, where any
    outgoing connection may take the port before the child binds it (a coordinator failed
    to start on one in CI). Never the same port twice in one process."""
    low = _ephemeral_low()
    with _handed_out_lock:
        for _ in range(200):
            port = random.randrange(_LOWEST_PICKED_PORT, low) if low > _LOWEST_PICKED_PORT else 0
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                port = int(sock.getsockname()[1])
            _handed_out.add(port)
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: the kernel's pick


def process_environment() -> dict[str, str]:
    """This environment with what a CPU test machine needs (one thread, no vLLM subprocess,
    no hub), for every spotinfer process started here."""
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


def _dying_with_parent(command: Sequence[str]) -> list[str]:
    """`command`, started through a tiny exec wrapper that first asks the kernel for SIGKILL
    when this process dies (and goes at once if it already has). Not a preexec_fn: Python
    code between fork and exec would run gRPC's fork handlers in the child, which can crash
    it before the exec."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _DEATH_WRAPPER, str(os.getpid()), *command]


class ManagedProcess(abc.ABC):
    """One child: ``spawn(command)``, ``wait_until(ready)``, ``terminate()`` or ``kill()``.

    Its output (stdout and stderr) goes line by line to ``log_path`` and to ``output``;
    `on_line` sees each line first. A second spawn of the same object appends to the log.
    A subclass says how its process starts and stops; ``with`` calls both.
    """

    def __init__(
        self,
        name: str,
        log_path: Path,
        cwd: Path = REPO_ROOT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._cwd = cwd
        self._env = dict(env) if env is not None else None
        self._lines: list[str] = []
        self._spawns = 0
        self.process: subprocess.Popen[str] | None = None

    def spawn(self, command: Sequence[str]) -> subprocess.Popen[str]:
        if self.running:
            # A second process would find the port taken and exit, leaving the first one
            # running with nobody to stop it.
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        process = _SPAWNER.submit(
            subprocess.Popen,
            _dying_with_parent(command),
            cwd=self._cwd,
            env=self._env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group
        ).result()
        self.process = process
        mode = "a" if self._spawns else "w"
        self._spawns += 1
        threading.Thread(
            target=self._pump, args=(process, mode), name=f"{self.name}-output", daemon=True
        ).start()
        return process

    def _pump(self, process: subprocess.Popen[str], mode: str) -> None:
        assert process.stdout is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, mode) as log:
            for line in process.stdout:
                self._lines.append(line)
                self.on_line(line)
                log.write(line)
                log.flush()

    def on_line(self, line: str) -> None:  # noqa: B027  (a hook; most launchers need none)
        """Called from the pump thread for each line of output, before it is logged."""

    @property
    def output(self) -> str:
        return "".join(self._lines)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_until(
        self, ready: Callable[[], bool], timeout_seconds: float, poll_seconds: float
    ) -> None:
        """Returns once ``ready()``; RuntimeError if the process exits first, TimeoutError
        (the process is killed) if ``timeout_seconds`` pass."""
        deadline = time.monotonic() + timeout_seconds
        while not ready():
            if not self.running:
                raise RuntimeError(f"{self.name} exited early:\n{self._tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"{self.name} not ready after {timeout_seconds:g}s:\n{self._tail()}"
                )
            time.sleep(poll_seconds)

    def terminate(self, timeout_seconds: float) -> int | None:
        """SIGTERM (a clean stop or drain); SIGKILL to its group if it has not gone after
        ``timeout_seconds``. The exit code; None if it was never started."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to its whole group, as a crash or a vanished VM would: no drain."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited since the poll
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(KILL_WAIT_SECONDS)

    def _tail(self) -> str:
        return self.output[-OUTPUT_TAIL_CHARS:]

    @abc.abstractmethod
    def start(self) -> Self:
        """Spawn the process and return once it is ready."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the process (with grace) and release what it held; safe to call twice."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceProcess(ManagedProcess):
    """A spotinfer gRPC process on a loopback port: its channel, and a health wait.

    With ``metrics``, it also serves /metrics on a free port of its own (see `metrics_url`).
    ``transport`` (the launcher's certificate, e.g. an operator's) and ``api_key`` are what
    `channel` shows the process; ``channel_address`` is where it connects (default: ``address``).
    """

    def __init__(
        self,
        name: str,
        log_dir: Path | None,
        metrics: bool = False,
        port: int = 0,
        transport: TransportConfig = PLAINTEXT,
        api_key: str = "",
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.channel_address = self.address
        self.transport = transport
        self.api_key = api_key
        self.metrics_port = free_port() if metrics else 0
        super().__init__(
            name, (log_dir or Path("/tmp")) / f"{name}-{self.port}.log", env=process_environment()
        )
        self.channel: grpc.Channel | None = None

    def spawn(self, command: Sequence[str]) -> subprocess.Popen[str]:
        process = super().spawn(command)
        self.channel = sync_channel(
            self.channel_address, transport=self.transport, api_key=self.api_key
        )
        return process

    @property
    def metrics_flags(self) -> tuple[str, ...]:
        return ("--metrics-port", str(self.metrics_port)) if self.metrics_port else ()

    @property
    def metrics_url(self) -> str:
        assert self.metrics_port, "started without metrics=True"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def health(self) -> int:
        """The overall grpc.health.v1 status; raises grpc.RpcError when it does not answer."""
        assert self.channel is not None
        stub = health_pb2_grpc.HealthStub(self.channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status)

    def serving(self) -> bool:
        try:
            return self.health() == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def wait_serving(self, timeout: float, poll_seconds: float = 0.2) -> None:
        self.wait_until(self.serving, timeout, poll_seconds)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
