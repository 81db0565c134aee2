"""Every unit's ExecStart, as a VM would run it, through the real command-line parser.

Each boot template is rendered with the values Terraform passes (the keys of the module's
``local.boot_settings``, plus role and units, as workers.tf and coordinator.tf call
``templatefile``); the env file the rendered script writes is expanded with what its
metadata and secret lookups would find; each unit the script writes has its ExecStart
expanded as systemd does, and the argv after the binary goes through `spotinfer`'s parser
and then the subcommand's config source with that environment, which is what the process
does before it starts anything. A flag that does not exist, a value that does not parse, a
variable the env file does not set, a setting that fails validation, or a store the process
would refuse to connect to (``StoreConfig.check_exposure``: plaintext Redis off loopback, or
no KV MAC keyring) fails here.

When terraform is installed, the renderer is also checked against terraform's own output.
"""

from __future__ import annotations

import base64
import contextlib
import io
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from common.config_source import ConfigSource
from spotinfer.cli import build_parser
from spotinfer.fleet.render import (
    boot_files,
    braced_variables,
    expand_exec_start,
    render_template,
    unit_exec_start,
)
from store.mac_keyring import keyring_for, new_keyring_text
from tests.infra.conftest import BOOT_DIR, TERRAFORM_DIR

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 is not installed")
from tests.infra import hcl_properties as hcl  # noqa: E402

BINARY = "/opt/spotinfer/venv/bin/spotinfer"
WORKER_UNITS = ("spotinfer-daemon.service", "spotinfer-worker.service")
COORDINATOR_UNITS = ("spotinfer-coordinator.service",)
RENDERINGS = [
    ("aws-boot.sh.tftpl", "aws", "worker", WORKER_UNITS),
    ("aws-boot.sh.tftpl", "aws", "coordinator", COORDINATOR_UNITS),
    ("gcp-boot.sh.tftpl", "gcp", "worker", WORKER_UNITS),
    ("gcp-boot.sh.tftpl", "gcp", "coordinator", COORDINATOR_UNITS),
]
IDS = [f"{r[1]}-{r[2]}" for r in RENDERINGS]

# What Terraform would pass for each key of local.boot_settings (a key without a value here
# fails the test: a new setting needs a value a real deployment would give it).
TERRAFORM_VALUES: dict[str, Any] = {
    "region": "us-east-1",
    "project": "spotinfer-test",
    "package": "spotinfer[gpu]==0.1.0",
    "pip_args": "",
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "worker_port": 50061,
    "daemon_peer_port": 50071,
    "coordinator_address": "internal-spotinfer-coord-123.elb.us-east-1.amazonaws.com:50052",
    "coordinator_port": 50051,
    "coordinator_http": 8000,
    "coordinator_internal": 50052,
    "worker_metrics": 9400,
    "daemon_metrics": 9401,
    "lease_interval": 2,
    "lease_ttl": 6,
    "termination_drain": 120,
    "worker_stop_grace": 25,
    "redis_host": "master.spotinfer-kv.abc123.use1.cache.amazonaws.com",
    "redis_port": 6379,
    "redis_secret_arn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:redis-auth",
    "redis_secret_id": "spotinfer-redis-auth",
    "redis_ca_pem": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
    "tls_secret_arn_coordinator": "arn:aws:secretsmanager:us-east-1:123456789012:secret:tls-c",
    "tls_secret_arn_worker": "arn:aws:secretsmanager:us-east-1:123456789012:secret:tls-w",
    "tls_secret_id_coordinator": "spotinfer-tls-coordinator",
    "tls_secret_id_worker": "spotinfer-tls-worker",
    "kv_mac_secret_arn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:kv-mac",
    "kv_mac_secret_id": "spotinfer-kv-mac",
}
# What the boot script's own commands find on the VM (metadata, secrets).
SHELL_VALUES = {
    "instance_id": "i-0123456789abcdef0",
    "instance_name": "spotinfer-worker-x7k2",
    "private_ip": "10.0.2.15",
    "zone": "us-east-1a",
    "instance_type": "g5.xlarge",
    "machine_type": "g2-standard-8",
    "spot": "true",
    "redis_token": "t0ken",
    "redis_auth": "auth-string",
}


# The files the boot script fetches from the secret store before any unit starts (the TLS
# bundle, the KV MAC keyring), as they would be on the VM; test_tls_boot.py checks it fetches
# them. The settings that name them must name files that exist: the processes check.
FETCHED_FILES = {
    "tls/ca.pem": "-----BEGIN CERTIFICATE-----\n",
    "tls/node.pem": "-----BEGIN CERTIFICATE-----\n",
    "tls/node.key": "-----BEGIN PRIVATE KEY-----\n",
    "tls/keys.jsonl": "",
    "kv-mac.keys": new_keyring_text(),
}
ETC = "/etc/spotinfer/"


def on_vm(environ: dict[str, str], root: Path) -> dict[str, str]:
    """``environ`` with /etc/spotinfer/ moved under ``root``, where the fetched files are."""
    for name, text in FETCHED_FILES.items():
        path = root / ETC.strip("/") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {name: value.replace(ETC, f"{root}{ETC}") for name, value in environ.items()}


def _config_source(command: str) -> ConfigSource[Any]:
    from context_daemon.config import CONFIG_SOURCE as DAEMON
    from coordinator.config import CONFIG_SOURCE as COORDINATOR
    from worker.config import CONFIG_SOURCE as WORKER

    return {"coordinator": COORDINATOR, "worker": WORKER, "daemon": DAEMON}[command]


def terraform_variables(cloud: str, role: str, units: tuple[str, ...], boot_dir: Path) -> dict:
    settings = hcl.load_module(TERRAFORM_DIR / cloud).locals["boot_settings"]
    missing = sorted(set(settings) - set(TERRAFORM_VALUES) - {"install_script"})
    assert not missing, f"no test value for boot_settings {missing}"
    variables = {key: TERRAFORM_VALUES[key] for key in settings if key in TERRAFORM_VALUES}
    variables["install_script"] = (BOOT_DIR / "install-spotinfer.sh").read_text()
    variables["role"] = role
    variables["units"] = {unit: (boot_dir / unit).read_text() for unit in units}
    return variables


def exec_start_problems(
    boot_dir: Path, template: str, cloud: str, role: str, units: tuple, root: Path
) -> list[str]:
    """Every way the rendered units' ExecStart lines would fail to start (empty: none)."""
    script = render_template(
        (boot_dir / template).read_text(), terraform_variables(cloud, role, units, boot_dir)
    )
    environ, written = boot_files(script, SHELL_VALUES)
    environ = on_vm(environ, root)
    assert sorted(written) == sorted(units), "the script writes the units it was given"
    problems = []
    for unit in units:
        command = unit_exec_start(written[unit])
        unset = [name for name in braced_variables(command) if not environ.get(name)]
        if unset:
            problems.append(f"{unit}: ExecStart uses {unset}, which the env file does not set")
        argv = expand_exec_start(command, environ)
        if argv[0] != BINARY:
            problems.append(f"{unit}: runs {argv[0]}, not {BINARY}")
            continue
        problem = _parse(argv[1:], environ)
        if problem:
            problems.append(f"{unit}: {problem}")
    return problems


def _parse(argv: list[str], environ: dict[str, str]) -> str:
    """What the process would say about ``argv`` before it starts (empty: nothing)."""
    parser = build_parser()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = parser.parse_args(argv)
    except SystemExit:
        return f"spotinfer {' '.join(argv[:1])}: {errors.getvalue().strip().splitlines()[-1]}"
    try:
        config = _config_source(args.command).resolve(args, environ).config
        # What RedisStore.from_config refuses before it connects (plaintext or unkeyed
        # Redis off loopback): the process would exit here too, just a little later.
        config.store.check_exposure()
    except (TypeError, ValueError) as exc:
        return f"spotinfer {args.command}: {exc}"
    return ""


@pytest.mark.parametrize(("template", "cloud", "role", "units"), RENDERINGS, ids=IDS)
def test_every_exec_start_parses_with_the_env_file(
    tmp_path: Path, template: str, cloud: str, role: str, units: tuple[str, ...]
) -> None:
    assert exec_start_problems(BOOT_DIR, template, cloud, role, units, tmp_path) == []


@pytest.mark.parametrize(("template", "cloud", "role", "units"), RENDERINGS, ids=IDS)
def test_the_processes_get_the_settings_the_fleet_needs(
    tmp_path: Path, template: str, cloud: str, role: str, units: tuple[str, ...]
) -> None:
    script = render_template(
        (BOOT_DIR / template).read_text(), terraform_variables(cloud, role, units, BOOT_DIR)
    )
    environ, written = boot_files(script, SHELL_VALUES)
    environ = on_vm(environ, tmp_path)
    configs = {}
    for unit in units:
        argv = expand_exec_start(unit_exec_start(written[unit]), environ)[1:]
        args = build_parser().parse_args(argv)
        configs[args.command] = _config_source(args.command).resolve(args, environ).config
    for config in configs.values():
        assert config.host == "0.0.0.0" and config.advertise_address == "10.0.2.15"
        assert config.store.url.startswith("rediss://")
        assert config.store.mac_key_file == f"{tmp_path}/etc/spotinfer/kv-mac.keys"
        assert not keyring_for(config.store.mac_key_file).is_loopback
        config.store.check_exposure()  # what RedisStore.from_config checks first
    if "coordinator" in configs:
        coordinator = configs["coordinator"]
        assert coordinator.failover_policy == "resume" and not coordinator.workers
        assert coordinator.port == 50051 and coordinator.http_port == 8000
    if "worker" in configs:
        worker, daemon = configs["worker"], configs["daemon"]
        assert worker.coordinator_addresses == (TERRAFORM_VALUES["coordinator_address"],)
        assert worker.daemon_address == "10.0.2.15:50071" and daemon.port == 50071
        assert worker.metrics_port == 9400 and daemon.metrics_port == 9401
        assert worker.pool.cloud == cloud and worker.pool.spot and worker.pool.zone
        assert worker.pool.instance_type in ("g5.xlarge", "g2-standard-8")
        assert (worker.lease_interval_seconds, worker.lease_ttl_seconds) == (2, 6)
        assert daemon.notice_source == cloud and daemon.worker_address == "127.0.0.1:50061"


def test_a_flag_that_does_not_exist_fails(tmp_path: Path) -> None:
    for name in (*WORKER_UNITS, "aws-boot.sh.tftpl"):
        shutil.copy(BOOT_DIR / name, tmp_path / name)
    unit = tmp_path / "spotinfer-worker.service"
    unit.write_text(unit.read_text().replace("--coordinator ", "--coordinators "))
    problems = exec_start_problems(
        tmp_path, "aws-boot.sh.tftpl", "aws", "worker", WORKER_UNITS, tmp_path
    )
    assert len(problems) == 1 and "unrecognized arguments: --coordinators" in problems[0]


def test_a_variable_the_env_file_does_not_set_fails(tmp_path: Path) -> None:
    for name in (*WORKER_UNITS, "gcp-boot.sh.tftpl"):
        shutil.copy(BOOT_DIR / name, tmp_path / name)
    template = tmp_path / "gcp-boot.sh.tftpl"
    template.write_text(template.read_text().replace("SPOTINFER_DAEMON_METRICS_PORT=", "X="))
    problems = exec_start_problems(
        tmp_path, "gcp-boot.sh.tftpl", "gcp", "worker", WORKER_UNITS, tmp_path
    )
    assert any("SPOTINFER_DAEMON_METRICS_PORT" in p for p in problems), problems


@pytest.mark.parametrize("template", ["aws-boot.sh.tftpl", "gcp-boot.sh.tftpl"])
def test_a_fleet_without_the_kv_mac_keyring_fails(tmp_path: Path, template: str) -> None:
    for name in (*WORKER_UNITS, template):
        shutil.copy(BOOT_DIR / name, tmp_path / name)
    boot = tmp_path / template
    boot.write_text(boot.read_text().replace("SPOTINFER_KV_MAC_KEY_FILE=", "X="))
    cloud = template.split("-")[0]
    problems = exec_start_problems(tmp_path, template, cloud, "worker", WORKER_UNITS, tmp_path)
    assert len(problems) == 2, problems  # the worker and the daemon
    assert all("without a KV MAC keyring" in problem for problem in problems), problems


@pytest.mark.parametrize(("template", "cloud", "role", "units"), RENDERINGS, ids=IDS)
def test_the_renderer_renders_as_terraform_does(
    template: str, cloud: str, role: str, units: tuple[str, ...]
) -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform is not installed (the reference renderer)")
    variables = terraform_variables(cloud, role, units, BOOT_DIR)
    ours = render_template((BOOT_DIR / template).read_text(), variables)
    arguments = ", ".join(f"{key} = {_hcl(value)}" for key, value in variables.items())
    expression = f'base64encode(templatefile("{BOOT_DIR}/{template}", {{{arguments}}}))\n'
    result = subprocess.run(
        [terraform, "console"], input=expression, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert base64.b64decode(result.stdout.strip().strip('"')).decode() == ours


def _hcl(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_hcl(k)} = {_hcl(v)}" for k, v in value.items()) + "}"
    if isinstance(value, int):
        return str(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("${", "$${").replace("%{", "%%{") + '"'
