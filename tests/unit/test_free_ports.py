"""Ports the launchers pick: below the kernel's ephemeral range (where an outgoing
connection can take a port before the child binds it), never the same one twice, and a
coordinator that finds its picked port taken starts again on new ones."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotinfer.local import managed_process
from spotinfer.local.coordinator_process import CoordinatorProcess
from spotinfer.local.managed_process import free_port

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE_FILE.exists(), reason="no Linux ephemeral port range here")
def test_picked_ports_lie_below_the_ephemeral_range_and_differ() -> None:
    low = int(RANGE_FILE.read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < low for port in ports), (low, sorted(ports)[-3:])
    for port in ports[:20]:  # each is bindable right now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_coordinator_whose_picked_port_is_taken_starts_on_new_ones(
    taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spotinfer.local import coordinator_process

    picks = iter([taken_port])  # the first HTTP port picked is the taken one
    real = managed_process.free_port
    monkeypatch.setattr(coordinator_process, "free_port", lambda: next(picks, None) or real())
    process = CoordinatorProcess("--failover-policy", "fail", log_dir=tmp_path)
    assert process.http_port == taken_port
    try:
        process.start()
        assert process.http_port != taken_port and process.running
    finally:
        process.stop()


def test_a_coordinator_on_named_ports_does_not_move_from_them(
    taken_port: int, tmp_path: Path
) -> None:
    process = CoordinatorProcess(
        "--failover-policy", "fail", log_dir=tmp_path, http_port=taken_port
    )
    try:
        with pytest.raises(RuntimeError, match="address already in use"):
            process.start()
        assert process.http_port == taken_port
    finally:
        process.stop()
