"""The coordinator's core, in-process: fake workers and daemons (tests/support/fake_worker.py),
the in-memory store, manual clocks. These tests start no process — starting one fails the
test — and all of them together must run in under UNIT_BUDGET_SECONDS."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from tests.support.factories import Cluster, make_cluster

UNIT_BUDGET_SECONDS = 30.0
_HERE = os.path.dirname(__file__)
_spent_seconds = 0.0


class ProcessStarted(AssertionError):
    pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise ProcessStarted(f"a unit test started a process: {args[:1]!r}")


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(os, "posix_spawn", _refuse)
    monkeypatch.setattr(os, "posix_spawnp", _refuse)
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown of every test here count."""
    global _spent_seconds
    if os.path.abspath(report.fspath).startswith(_HERE):
        _spent_seconds += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _spent_seconds > UNIT_BUDGET_SECONDS:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(  # noqa: T201 - the reason the run failed
            f"\ncoordinator unit tests took {_spent_seconds:.1f} s, over their "
            f"{UNIT_BUDGET_SECONDS:.0f} s budget"
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _spent_seconds:
        terminalreporter.write_line(
            f"coordinator unit tests: {_spent_seconds:.2f} s of {UNIT_BUDGET_SECONDS:.0f} s"
        )


@pytest.fixture
async def clusters() -> AsyncIterator[Callable[..., Cluster]]:
    """`make_cluster`, closed at the end of the test (no task outlives it)."""
    made: list[Cluster] = []

    def make(**options: object) -> Cluster:
        cluster = make_cluster(**options)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.close()
