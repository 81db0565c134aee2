"""The unit supervisor on tiny fake services: the unit file's settings, read and obeyed."""

from __future__ import annotations

import itertools
import signal
import sys
from pathlib import Path

import pytest

from spotinfer.rehearsal.supervisor import INSTALLED_BINARY, UnitSupervisor
from spotinfer.rehearsal.unit_file import UnitError, parse_seconds, parse_unit
from tests.support.wait import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def unit(exec_start: str, **service: str) -> str:
    lines = [f"{key}={value}" for key, value in service.items()]
    return "\n".join(["[Unit]", "Description=x", "[Service]", f"ExecStart={exec_start}", *lines])


def test_unit_settings_are_read_and_the_rest_listed() -> None:
    parsed = parse_unit(
        unit(
            "/bin/true",
            Restart="on-failure",
            RestartSec="1min 30s",
            TimeoutStopSec="500ms",
            KillSignal="SIGINT",
            User="spotinfer",
            ProtectSystem="full",
            Environment='HOME=/var/lib/x "B=two words"',
        )
    )
    assert parsed.restart_seconds == 90.0
    assert parsed.timeout_stop_seconds == 0.5
    assert parsed.kill_signal == signal.SIGINT
    assert parsed.environment == (("HOME", "/var/lib/x"), ("B", "two words"))
    assert parsed.ignored == ("User", "ProtectSystem")
    assert parsed.restarts_after(1) and not parsed.restarts_after(0)
    assert parse_seconds("5") == 5.0


def test_a_unit_without_exec_start_or_with_an_unknown_restart_is_refused() -> None:
    with pytest.raises(UnitError, match="ExecStart"):
        parse_unit("[Service]\nRestart=always\n")
    with pytest.raises(UnitError, match="Restart=sometimes"):
        parse_unit(unit("/bin/true", Restart="sometimes"))


def test_environment_file_values_win_and_paths_are_mapped(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "app.env").write_text("# comment\nA=file\nC='quoted'\nD=/etc/app/x\n")
    service = UnitSupervisor(
        parse_unit(
            unit(
                f"{INSTALLED_BINARY} --a ${{A}} --c $C --d ${{D}}",
                EnvironmentFile="/etc/app/app.env",
                Environment="A=unit B=unit",
            )
        ),
        tmp_path / "log",
        paths={"/etc/app": tmp_path / "etc"},
        base_environment={},
    )
    env = service.environment()
    assert (env["A"], env["B"], env["C"]) == ("file", "unit", "quoted")
    assert service.argv() == [
        sys.executable, "-m", "spotinfer", "--a", "file", "--c", "quoted",
        "--d", f"{tmp_path}/etc/x",
    ]  # fmt: skip


def test_a_missing_environment_file_is_an_error_unless_optional(tmp_path: Path) -> None:
    strict = UnitSupervisor(
        parse_unit(unit("/bin/true", EnvironmentFile="/nope.env")), tmp_path / "l"
    )
    with pytest.raises(UnitError, match="missing"):
        strict.environment()
    lenient = UnitSupervisor(
        parse_unit(unit("/bin/true", EnvironmentFile="-/nope.env")), tmp_path / "l"
    )
    assert "PATH" in lenient.environment()


def test_on_failure_restarts_a_failing_service_after_restart_sec(tmp_path: Path) -> None:
    spec = unit("/bin/sh -c 'echo started; exit 3'", Restart="on-failure", RestartSec="0.2")
    with UnitSupervisor(parse_unit(spec, "fail.service"), tmp_path / "log") as service:
        wait_until(lambda: service.restarts >= 2, timeout=10)
    gaps = [b.started_at - a.started_at for a, b in itertools.pairwise(service.starts)]
    assert all(gap >= 0.2 for gap in gaps)
    assert service.starts[0].exit_code == [3]
    assert (tmp_path / "log").read_text().count("started") >= 2


def test_on_failure_does_not_restart_a_clean_exit(tmp_path: Path) -> None:
    spec = unit("/bin/sh -c 'exit 0'", Restart="on-failure", RestartSec="0.05")
    with UnitSupervisor(parse_unit(spec), tmp_path / "log") as service:
        wait_until(lambda: bool(service.starts[0].exit_code), timeout=10)
        assert not service.running
    assert service.restarts == 0


def test_always_restarts_even_a_clean_exit(tmp_path: Path) -> None:
    spec = unit("/bin/sh -c 'exit 0'", Restart="always", RestartSec="0.05")
    with UnitSupervisor(parse_unit(spec), tmp_path / "log") as service:
        wait_until(lambda: service.restarts >= 2, timeout=10)


def test_stop_escalates_to_sigkill_after_timeout_stop_sec(tmp_path: Path) -> None:
    # The shell ignores SIGTERM: only the SIGKILL after TimeoutStopSec ends it.
    spec = unit(
        "/bin/sh -c 'trap \"\" TERM; echo up; while :; do sleep 0.1; done'",
        Restart="always",
        TimeoutStopSec="1",
    )
    service = UnitSupervisor(parse_unit(spec), tmp_path / "log").start()
    wait_until(lambda: "up" in service.output, timeout=10)
    service.stop()
    assert not service.running
    assert service.process is not None and service.process.returncode == -signal.SIGKILL
    assert service.restarts == 0
