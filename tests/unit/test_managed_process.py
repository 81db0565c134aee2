"""The one launcher: output pumped to a log, readiness wait, stop with grace, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from spotinfer.local.managed_process import REPO_ROOT, ManagedProcess

if TYPE_CHECKING:
    from typing_extensions import Self

PYTHON = sys.executable
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + (
    "print('up', flush=True); time.sleep(600)"
)


class _Script(ManagedProcess):
    """A python -c child, ready once it printed `up`."""

    def __init__(self, code: str, log_path: Path) -> None:
        super().__init__("script", log_path)
        self._code = code

    def start(self) -> Self:
        self.spawn([PYTHON, "-c", self._code])
        self.wait_until(lambda: "up" in self.output, timeout_seconds=30, poll_seconds=0.02)
        return self

    def stop(self) -> None:
        self.terminate(timeout_seconds=0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still has a pid until its parent (init, here) reaps it.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] != "Z"


def _wait_gone(pid: int, timeout_seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_output_goes_to_the_log_and_to_memory(tmp_path: Path) -> None:
    code = "print('up', flush=True); print('second line', flush=True)"
    with _Script(code, tmp_path / "script.log") as script:
        assert script.process is not None
        script.process.wait(10)
    time.sleep(0.1)  # the pump thread writes the last line
    assert "second line" in script.output
    assert "second line" in (tmp_path / "script.log").read_text()


def test_a_process_that_exits_before_ready_is_an_error_with_its_output(tmp_path: Path) -> None:
    script = _Script("print('bad flag'); raise SystemExit(2)", tmp_path / "script.log")
    with pytest.raises(RuntimeError, match="script exited early:\nbad flag"):
        script.start()


def test_a_process_never_ready_is_killed_at_the_timeout(tmp_path: Path) -> None:
    script = _Script("import time; time.sleep(600)", tmp_path / "script.log")
    script.spawn([PYTHON, "-c", "import time; time.sleep(600)"])
    with pytest.raises(TimeoutError, match="not ready after 0.3s"):
        script.wait_until(lambda: False, timeout_seconds=0.3, poll_seconds=0.05)
    assert not script.running


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    script = _Script(IGNORES_SIGTERM, tmp_path / "script.log").start()
    assert script.terminate(timeout_seconds=0.5) == -signal.SIGKILL


def test_a_second_spawn_while_running_is_refused(tmp_path: Path) -> None:
    script = _Script(IGNORES_SIGTERM, tmp_path / "script.log").start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            script.spawn([PYTHON, "-c", "pass"])
    finally:
        script.stop()


def test_a_child_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    # The kernel's parent-death signal follows the forking thread; the local cluster starts
    # workers from loader threads that end once the worker is up.
    script = _Script(IGNORES_SIGTERM, tmp_path / "script.log")
    loader = threading.Thread(target=script.start)
    loader.start()
    loader.join()
    time.sleep(0.3)
    try:
        assert script.running
    finally:
        script.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_no_orphan_when_the_parent_is_killed(tmp_path: Path) -> None:
    parent_code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from tests.unit.test_managed_process import _Script, IGNORES_SIGTERM
        script = _Script(IGNORES_SIGTERM, Path({str(tmp_path / "child.log")!r})).start()
        print(script.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [PYTHON, "-c", parent_code], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.kill()  # SIGKILL: no chance to stop its children
        parent.wait(10)
        assert _wait_gone(child_pid), f"child {child_pid} outlived its parent"
    finally:
        parent.kill()
