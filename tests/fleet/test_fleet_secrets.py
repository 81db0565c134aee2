"""The fleet's secrets as the boot scripts fetch them: the cloud CLI stand-ins answer in the
real CLIs' formats, and a rendered boot script, run verbatim, leaves a VM with its TLS bundle,
API keys and KV MAC keyring, and a coordinator that serves only mutual TLS with them."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1.health_pb2_grpc import HealthStub

from common.api_keys import load_keys
from common.channels import sync_channel
from protos.spotinfer.v1 import control_pb2
from spotinfer.rehearsal.fleet import Rehearsal, RehearsalConfig
from spotinfer.rehearsal.fleet_secrets import FleetSecrets, secret_ids
from store.mac_keyring import load_keyring
from tests.fleet.fleet_support import wait_for


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[FleetSecrets, Path]:
    folder = tmp_path_factory.mktemp("secrets")
    secrets = FleetSecrets.make(
        folder / "operator", secret_ids("aws"), "token-1", ("10.213.0.3",), ("10.213.0.9",)
    )
    secrets.install_clis(folder / "bin")
    return secrets, folder / "bin"


def run(cli: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cli), *args], capture_output=True, text=True)  # noqa: S603


def test_aws_prints_the_secret_string_as_text_output_does(
    made: tuple[FleetSecrets, Path],
) -> None:
    secrets, shims = made
    ids = secret_ids("aws")
    for secret_id, value in secrets.by_id.items():
        done = run(
            shims / "aws", "secretsmanager", "get-secret-value", "--region", "us-east-1",
            "--secret-id", secret_id, "--query", "SecretString", "--output", "text",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout == value + "\n"
    bundle = json.loads(secrets.by_id[ids.tls_coordinator])
    assert set(bundle) == {"ca", "cert", "key", "api_keys"}
    assert set(json.loads(secrets.by_id[ids.tls_worker])) == {"ca", "cert", "key"}
    missing = run(
        shims / "aws", "secretsmanager", "get-secret-value", "--secret-id", "nope",
        "--query", "SecretString", "--output", "text",
    )  # fmt: skip
    assert missing.returncode == 254 and "ResourceNotFoundException" in missing.stderr
    assert missing.stdout == ""
    other = run(shims / "aws", "secretsmanager", "get-secret-value", "--secret-id", ids.redis)
    assert other.returncode != 0 and "--query SecretString --output text" in other.stderr


def test_gcloud_prints_the_payload_as_stored(made: tuple[FleetSecrets, Path]) -> None:
    secrets, shims = made
    ids = secret_ids("aws")  # the stand-ins serve whatever ids the store holds
    keyring = run(shims / "gcloud", "secrets", "versions", "access", "latest",
                  f"--secret={ids.kv_mac}", "--project=p")  # fmt: skip
    assert keyring.returncode == 0, keyring.stderr
    assert keyring.stdout == secrets.by_id[ids.kv_mac]  # its own newline, none added
    missing = run(shims / "gcloud", "secrets", "versions", "access", "latest",
                  "--secret=nope", "--project=p")  # fmt: skip
    assert missing.returncode == 1
    assert "NOT_FOUND: Secret [projects/p/secrets/nope] not found" in missing.stderr
    old = run(shims / "gcloud", "secrets", "versions", "access", "3", f"--secret={ids.redis}")
    assert old.returncode != 0 and "latest" in old.stderr


@pytest.fixture(params=["aws", "gcp"])
def coordinator_only(
    request: pytest.FixtureRequest, namespaces: None, tiny_model: Path, tmp_path: Path
) -> Iterator[Rehearsal]:
    config = RehearsalConfig(model=tiny_model, workdir=tmp_path, cloud=request.param, nodes=0)
    with Rehearsal(config) as fleet:
        yield fleet


def test_the_boot_script_provisions_every_secret_and_the_coordinator_serves_mutual_tls(
    coordinator_only: Rehearsal,
) -> None:
    fleet = coordinator_only
    vm = fleet.coordinator
    tls = vm.boot.root / "etc/spotinfer/tls"
    assert sorted(p.name for p in tls.iterdir()) == ["ca.pem", "keys.jsonl", "node.key", "node.pem"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in tls.iterdir())
    assert tls.stat().st_mode & 0o777 == 0o700
    assert len(load_keys(tls / "keys.jsonl")) == 2
    keyring = vm.boot.root / "etc/spotinfer/kv-mac.keys"
    assert not load_keyring(str(keyring)).is_loopback
    environment = vm.environment
    service = next(iter(vm.services.values()))
    for setting in ("TRANSPORT_CA_FILE", "TRANSPORT_CERT_FILE", "KV_MAC_KEY_FILE", "API_KEYS_FILE"):
        assert Path(service.map_path(environment[f"SPOTINFER_{setting}"])).is_file()
    # The hourly renewal went into the VM's own /etc/cron.d, not this machine's.
    assert "spotinfer-fetch-tls.sh" in (vm.boot.root / "etc/cron.d/spotinfer-tls").read_text()
    assert not Path("/etc/cron.d/spotinfer-tls").exists()

    assert fleet.secrets is not None
    # The operator's certificate opens Control on the mutual-TLS port (no node yet) ...
    # A bound, not a timing: the VM's coordinator starts a Python process, slow on a loaded
    # machine (60 s was once not enough at load average 13).
    wait_for(lambda: _lists_workers(fleet), 180, f"ListWorkers\n{fleet.logs_tail()}")
    # ... a client with the CA only is refused there, and answered on the public port.
    anonymous = sync_channel(fleet.control_target, transport=fleet.secrets.client_transport)
    with anonymous, pytest.raises(grpc.RpcError):
        HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=5)
    public = sync_channel(fleet.coordinator_target, transport=fleet.secrets.client_transport)
    with public:
        HealthStub(public).Check(health_pb2.HealthCheckRequest(), timeout=5)


def _lists_workers(fleet: Rehearsal) -> bool:
    try:
        fleet.control.ListWorkers(control_pb2.ListWorkersRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return True
