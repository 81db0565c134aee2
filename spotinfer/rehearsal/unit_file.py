"""A systemd .service file, read as systemd reads the parts a rehearsal runs.

Honoured: ``EnvironmentFile=`` (a leading ``-`` makes it optional), ``Environment=``,
``ExecStart=`` (expanded by spotinfer.fleet.render.expand_exec_start, as systemd does),
``Restart=`` (no, always, on-failure),
``RestartSec=``, ``TimeoutStopSec=`` and ``KillSignal=``. Everything else of ``[Service]``
(``User=``, ``ProtectSystem=``, ``LimitNOFILE=`` ...) is kept in `ignored` so a supervisor
can say what it did not apply.
"""

from __future__ import annotations

import re
import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path

HONOURED = frozenset(
    {
        "EnvironmentFile",
        "Environment",
        "ExecStart",
        "Restart",
        "RestartSec",
        "TimeoutStopSec",
        "KillSignal",
    }
)
RESTART_POLICIES = ("no", "always", "on-failure")
DEFAULT_RESTART_SEC = 0.1  # systemd's default
DEFAULT_TIMEOUT_STOP_SEC = 90.0
_TIME_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


class UnitError(ValueError):
    """The unit file says something systemd would refuse, or this reader cannot run."""


@dataclass(frozen=True)
class ServiceUnit:
    name: str
    exec_start: str
    environment_files: tuple[str, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    restart: str = "no"
    restart_seconds: float = DEFAULT_RESTART_SEC
    timeout_stop_seconds: float = DEFAULT_TIMEOUT_STOP_SEC
    kill_signal: signal.Signals = signal.SIGTERM
    ignored: tuple[str, ...] = field(default=())

    def restarts_after(self, exit_code: int) -> bool:
        """Whether systemd would start the service again after it exited with `exit_code`
        (a negative code: killed by that signal)."""
        if self.restart == "always":
            return True
        return self.restart == "on-failure" and exit_code != 0


def parse_seconds(text: str) -> float:
    """A systemd time span: ``5``, ``90s``, ``1min 30s``, ``500ms``."""
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)\s*([a-z]*)", text.strip()):
        if unit not in _TIME_UNITS and unit:
            raise UnitError(f"unknown time unit {unit!r} in {text!r}")
        total += float(number) * _TIME_UNITS.get(unit, 1.0)
    return total


def _logical_lines(text: str) -> list[str]:
    """Lines with comments dropped and backslash continuations joined."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith(("#", ";"))):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def _assignments(value: str) -> list[tuple[str, str]]:
    """``Environment=A=1 "B=two words"``: the assignments, in order."""
    pairs = []
    for word in shlex.split(value):
        name, sep, setting = word.partition("=")
        if not sep:
            raise UnitError(f"Environment= entry {word!r} is not NAME=VALUE")
        pairs.append((name, setting))
    return pairs


def parse_unit(text: str, name: str = "unit.service") -> ServiceUnit:
    section = ""
    settings: dict[str, list[str]] = {}
    ignored: list[str] = []
    for line in _logical_lines(text):
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise UnitError(f"{name}: not KEY=VALUE: {line!r}")
        key, value = key.strip(), value.strip()
        if section != "Service":
            continue
        if key in HONOURED:
            settings.setdefault(key, []).append(value)
        else:
            ignored.append(key)
    exec_start = settings.get("ExecStart", [])
    if len(exec_start) != 1:
        raise UnitError(f"{name}: a Type=simple service needs exactly one ExecStart=")
    restart = (settings.get("Restart") or ["no"])[-1]
    if restart not in RESTART_POLICIES:
        raise UnitError(f"{name}: Restart={restart} is not one of {RESTART_POLICIES}")
    kill_signal = (settings.get("KillSignal") or ["SIGTERM"])[-1]
    return ServiceUnit(
        name=name,
        exec_start=exec_start[0],
        environment_files=tuple(settings.get("EnvironmentFile", [])),
        environment=tuple(
            p for value in settings.get("Environment", []) for p in _assignments(value)
        ),
        restart=restart,
        restart_seconds=parse_seconds((settings.get("RestartSec") or ["100ms"])[-1]),
        timeout_stop_seconds=parse_seconds((settings.get("TimeoutStopSec") or ["90s"])[-1]),
        kill_signal=signal.Signals[
            kill_signal if kill_signal.startswith("SIG") else f"SIG{kill_signal}"
        ],
        ignored=tuple(dict.fromkeys(ignored)),
    )


def load_unit(path: Path) -> ServiceUnit:
    return parse_unit(path.read_text(), path.name)
