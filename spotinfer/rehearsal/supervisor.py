"""A small stand-in for systemd: runs one service unit's ExecStart verbatim and restarts it.

    EnvironmentFile= ─┐
    Environment=     ─┼─▶ environment ─▶ ExecStart (expanded) ─▶ process in the VM's namespace
    overrides        ─┘                                              │ exits
                           Restart= / RestartSec= ◀─────────────────┘

Paths are mapped, not rewritten in the unit: `paths` sends a VM path (/etc/spotinfer,
/var/lib/spotinfer) to a folder of the rehearsal, and the unit's binary
(/opt/spotinfer/venv/bin/spotinfer) runs as this interpreter's ``python -m spotinfer``. What
a rehearsal cannot apply (``User=``, ``ProtectSystem=`` ...) is listed once in the log.
`stop` sends KillSignal= and, after TimeoutStopSec=, SIGKILL to the process group.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from spotinfer.fleet.render import expand_exec_start, parse_env_file
from spotinfer.local.managed_process import ManagedProcess
from spotinfer.rehearsal.unit_file import ServiceUnit, UnitError

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

INSTALLED_BINARY = "/opt/spotinfer/venv/bin/spotinfer"
_POLL_SECONDS = 0.05


def default_binaries() -> dict[str, list[str]]:
    """The installed spotinfer entry point, as this interpreter runs it."""
    return {INSTALLED_BINARY: [sys.executable, "-m", "spotinfer"]}


@dataclass(frozen=True)
class Start:
    """One start of the unit's process: when, and how it ended (None while it runs)."""

    started_at: float
    pid: int
    exit_code: list[int] = field(default_factory=list)


class UnitSupervisor(ManagedProcess):
    """``with UnitSupervisor(unit, wrap=host.command, paths=...) as service: ...``.

    `wrap` turns the expanded argv into the command actually spawned (``ip netns exec NS``);
    `base_environment` is what the process inherits besides the unit's own settings, and
    `overrides` a drop-in's ``Environment=`` applied last.
    """

    def __init__(
        self,
        unit: ServiceUnit,
        log_path: Path,
        *,
        wrap: Callable[[Sequence[str]], list[str]] = list,
        paths: Mapping[str, Path] | None = None,
        binaries: Mapping[str, Sequence[str]] | None = None,
        base_environment: Mapping[str, str] | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> None:
        self.unit = unit
        self._wrap = wrap
        self._paths = dict(paths or {})
        self._binaries = dict(binaries if binaries is not None else default_binaries())
        self._base = dict(base_environment if base_environment is not None else os.environ)
        self._overrides = dict(overrides or {})
        self.starts: list[Start] = []
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        super().__init__(unit.name, log_path)

    def map_path(self, text: str) -> str:
        for vm_path, local in self._paths.items():
            if text == vm_path or text.startswith(vm_path + "/"):
                return str(local) + text[len(vm_path) :]
        return text

    def environment(self) -> dict[str, str]:
        """The process's environment as systemd builds it: Environment=, then each
        EnvironmentFile= (which win), then the overrides; values with VM paths mapped."""
        environment = dict(self._base)
        unit_env = dict(self.unit.environment)
        for entry in self.unit.environment_files:
            optional = entry.startswith("-")
            path = Path(self.map_path(entry.lstrip("-")))
            if not path.exists():
                if optional:
                    continue
                raise UnitError(f"{self.unit.name}: EnvironmentFile {entry} ({path}) missing")
            unit_env.update(parse_env_file(path.read_text()))
        unit_env.update(self._overrides)
        environment.update({name: self.map_path(value) for name, value in unit_env.items()})
        return environment

    def argv(self, environment: Mapping[str, str] | None = None) -> list[str]:
        """ExecStart expanded against the environment, binary and paths mapped."""
        words = expand_exec_start(self.unit.exec_start, environment or self.environment())
        if words and words[0][:1] in "-@+!:":
            words[0] = words[0].lstrip("-@+!:")  # prefixes that change how systemd runs it
        binary = self._binaries.get(words[0]) if words else None
        head = list(binary) if binary is not None else [self.map_path(words[0])]
        return head + [self.map_path(word) for word in words[1:]]

    def start(self) -> Self:
        if self.unit.ignored:
            log.info("%s: not applied here: %s", self.unit.name, ", ".join(self.unit.ignored))
        self._stopping.clear()
        self._start_once()
        self._watcher = threading.Thread(
            target=self._watch, name=f"{self.unit.name}-restart", daemon=True
        )
        self._watcher.start()
        return self

    def _start_once(self) -> None:
        environment = self.environment()
        self._env = environment
        process = self.spawn(self._wrap(self.argv(environment)))
        self.starts.append(Start(time.time(), process.pid))

    def _watch(self) -> None:
        while not self._stopping.is_set():
            process = self.process
            assert process is not None
            code = process.poll()
            if code is None:
                time.sleep(_POLL_SECONDS)
                continue
            self.starts[-1].exit_code.append(code)
            if not self.unit.restarts_after(code):
                log.info("%s exited (%d); Restart=%s", self.unit.name, code, self.unit.restart)
                return
            if self._stopping.wait(self.unit.restart_seconds):
                return
            log.info("%s exited (%d); restarting", self.unit.name, code)
            self._start_once()

    @property
    def restarts(self) -> int:
        return max(0, len(self.starts) - 1)

    def stop(self) -> None:
        """KillSignal=, then SIGKILL after TimeoutStopSec=; no restart after it."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.unit.kill_signal)
            try:
                self.process.wait(self.unit.timeout_stop_seconds)
            except subprocess.TimeoutExpired:
                self.kill()

    def stop_for(self, timeout_seconds: float) -> None:
        """`stop` with a shorter TimeoutStopSec (a test's patience, not the unit's)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        self.terminate(timeout_seconds)
