"""Fixtures for the infra checks: a moto server and a fake Compute server, both on loopback."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.infra.fake_compute import FakeCompute, serve

REPO_ROOT = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = REPO_ROOT / "infra" / "terraform"
BOOT_DIR = REPO_ROOT / "infra" / "boot"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """One moto server (server mode, a real HTTP endpoint) for the session."""
    moto_server_module = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    server = moto_server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_endpoint(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The moto endpoint with its state reset, and throwaway credentials in the environment."""
    request = urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return moto_server


@pytest.fixture
def fake_compute() -> Iterator[FakeCompute]:
    pytest.importorskip("google.cloud.compute_v1", reason="google-cloud-compute is not installed")
    with serve(
        FakeCompute(project="spot-project", region="us-central1", group="demo-workers")
    ) as compute:
        yield compute
