"""The VM boot path, checked offline: systemd units, and the user-data / startup scripts the
Terraform renders (rendered here by terraform itself, then parsed by bash and shellcheck)."""

from __future__ import annotations

import base64
import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("hcl2", reason="python-hcl2 is not installed")

from tests.infra import hcl_properties as hcl
from tests.infra.conftest import BOOT_DIR, TERRAFORM_DIR

UNITS = ("spotinfer-worker.service", "spotinfer-daemon.service", "spotinfer-coordinator.service")
ENV_REFERENCE = re.compile(r"\$\{(SPOTINFER_[A-Z_]+)\}")


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string((BOOT_DIR / name).read_text())
    return parser


def _command(unit_name: str) -> tuple[list[str], dict[str, str]]:
    """ExecStart as (positional words, --flag values)."""
    words = shlex.split(_unit(unit_name)["Service"]["ExecStart"])
    positional: list[str] = []
    flags: dict[str, str] = {}
    index = 0
    while index < len(words):
        if words[index].startswith("--"):
            flags[words[index]] = words[index + 1]
            index += 2
        else:
            positional.append(words[index])
            index += 1
    return positional, flags


def test_worker_unit_runs_spotinfer_worker_with_its_flags() -> None:
    positional, flags = _command("spotinfer-worker.service")
    assert positional == ["/opt/spotinfer/venv/bin/spotinfer", "worker"]
    assert flags == {
        "--model": "${SPOTINFER_WORKER_MODEL}",
        "--host": "0.0.0.0",
        "--port": "${SPOTINFER_WORKER_PORT}",
        "--metrics-port": "${SPOTINFER_WORKER_METRICS_PORT}",
        "--advertise-address": "${SPOTINFER_ADVERTISE_ADDRESS}",
        "--worker-id": "${SPOTINFER_WORKER_ID}",
        "--coordinator": "${SPOTINFER_COORDINATOR}",
        "--daemon-address": "${SPOTINFER_ADVERTISE_ADDRESS}:${SPOTINFER_DAEMON_PORT}",
        "--redis-url": "${SPOTINFER_REDIS_URL}",
    }


def test_daemon_unit_watches_the_clouds_notices_beside_its_worker() -> None:
    positional, flags = _command("spotinfer-daemon.service")
    assert positional == ["/opt/spotinfer/venv/bin/spotinfer", "daemon"]
    assert flags == {
        "--host": "0.0.0.0",
        "--port": "${SPOTINFER_DAEMON_PORT}",
        "--advertise-address": "${SPOTINFER_ADVERTISE_ADDRESS}",
        "--metrics-port": "${SPOTINFER_DAEMON_METRICS_PORT}",
        "--notice-source": "${SPOTINFER_NOTICE_SOURCE}",
        "--worker-address": "127.0.0.1:${SPOTINFER_WORKER_PORT}",
        "--redis-url": "${SPOTINFER_REDIS_URL}",
    }


def test_daemon_outlives_the_worker_at_shutdown() -> None:
    # systemd stops in reverse start order: the worker must start after the daemon.
    worker = _unit("spotinfer-worker.service")["Unit"]
    assert "spotinfer-daemon.service" in worker["After"].split()
    daemon_stop = int(_unit("spotinfer-daemon.service")["Service"]["TimeoutStopSec"])
    worker_stop = int(_unit("spotinfer-worker.service")["Service"]["TimeoutStopSec"])
    assert daemon_stop >= 120 > worker_stop  # the whole AWS grace period for the daemon


@pytest.mark.parametrize("template", ["aws-boot.sh.tftpl", "gcp-boot.sh.tftpl"])
def test_boot_scripts_write_every_variable_the_units_read(template: str) -> None:
    used = {name for unit in UNITS for name in ENV_REFERENCE.findall((BOOT_DIR / unit).read_text())}
    text = (BOOT_DIR / template).read_text()
    env_block = text[text.index("<<ENV") : text.index("\nENV\n")]
    written = set(re.findall(r"^(SPOTINFER_[A-Z_]+)=", env_block, flags=re.MULTILINE))
    assert used <= written, f"{template} does not write {sorted(used - written)}"


# Every unit reads the whole environment file, and each process takes SPOTINFER_<FLAG> for
# every one of its settings: a variable written for one unit must not set another's setting.
# The VM's own address and cloud are the same for every process of the VM, on purpose.
SETTINGS_FROM_THE_ENV_FILE = {
    "coordinator": {"store.url", "advertise_address", "cloud"},
    "worker": {
        "store.url",
        "worker_id",
        "advertise_address",
        "coordinators",
        "pool.cloud",
        "pool.zone",
        "pool.instance_type",
        "pool.spot",
        "lease_interval_seconds",
        "lease_ttl_seconds",
        "drain_grace_seconds",
    },
    "daemon": {"store.url", "notice_source", "advertise_address"},
}
# AWS only: a scale-in's lifecycle hook wait is the daemon's notice deadline.
AWS_ONLY_SETTINGS = {"daemon": {"lifecycle_drain_seconds"}}


@pytest.mark.parametrize("template", ["aws-boot.sh.tftpl", "gcp-boot.sh.tftpl"])
def test_the_environment_file_sets_only_the_settings_meant(template: str) -> None:
    from context_daemon.config import CONFIG_SOURCE as DAEMON
    from coordinator.config import CONFIG_SOURCE as COORDINATOR
    from worker.config import CONFIG_SOURCE as WORKER

    text = (BOOT_DIR / template).read_text()
    env_block = text[text.index("<<ENV") : text.index("\nENV\n")]
    written = set(re.findall(r"^(SPOTINFER_[A-Z_]+)=", env_block, flags=re.MULTILINE))
    for source in (COORDINATOR, WORKER, DAEMON):
        taken = {setting.name for setting in source.settings if setting.env in written}
        meant = set(SETTINGS_FROM_THE_ENV_FILE[source.section])
        if template.startswith("aws"):
            meant |= AWS_ONLY_SETTINGS.get(source.section, set())
        assert taken == meant, source.section


def _verify_copy(tmp_path: Path, unit_name: str, text: str) -> subprocess.CompletedProcess[str]:
    # verify wants the ExecStart binary to exist; the real one is installed at boot.
    (tmp_path / unit_name).write_text(
        text.replace("/opt/spotinfer/venv/bin/spotinfer", "/bin/true")
    )
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / unit_name)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("unit_name", UNITS)
def test_units_pass_systemd_analyze_verify(tmp_path: Path, unit_name: str) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    for other in UNITS:  # Wants=/After= name the sibling units
        (tmp_path / other).write_text(
            (BOOT_DIR / other).read_text().replace("/opt/spotinfer/venv/bin/spotinfer", "/bin/true")
        )
    result = _verify_copy(tmp_path, unit_name, (BOOT_DIR / unit_name).read_text())
    # verify exits 0 on settings it ignores, so a warning counts as a failure too.
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_systemd_analyze_catches_a_broken_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    broken = (
        (BOOT_DIR / "spotinfer-daemon.service").read_text().replace("Type=simple", "Type=sometimes")
    )
    result = _verify_copy(tmp_path, "spotinfer-daemon.service", broken)
    assert "Failed to parse service type" in result.stderr


# ---- rendering the boot scripts the way Terraform does ---------------------------------------


def _render(template: str, cloud: str, role: str, units: tuple[str, ...]) -> str:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform is not installed (it renders the boot templates)")
    # Exactly the keys the module passes (its local.boot_settings) plus role and units:
    # templatefile fails on a missing one, so this also checks the module supplies them all.
    settings = hcl.load_module(TERRAFORM_DIR / cloud).locals["boot_settings"]
    values = {key: f'"{key}-value"' for key in settings}
    values["install_script"] = f'file("{BOOT_DIR}/install-spotinfer.sh")'
    values["pip_args"] = '""'
    values["role"] = f'"{role}"'
    values["units"] = (
        "{" + ", ".join(f'"{unit}" = file("{BOOT_DIR}/{unit}")' for unit in units) + "}"
    )
    arguments = ", ".join(f"{key} = {value}" for key, value in values.items())
    expression = f'base64encode(templatefile("{BOOT_DIR}/{template}", {{{arguments}}}))\n'
    result = subprocess.run(
        [terraform, "console"],
        input=expression,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=BOOT_DIR,
    )
    assert result.returncode == 0, result.stderr
    return base64.b64decode(result.stdout.strip().strip('"')).decode()


RENDERINGS = [
    (
        "aws-boot.sh.tftpl",
        "aws",
        "worker",
        ("spotinfer-daemon.service", "spotinfer-worker.service"),
    ),
    ("aws-boot.sh.tftpl", "aws", "coordinator", ("spotinfer-coordinator.service",)),
    (
        "gcp-boot.sh.tftpl",
        "gcp",
        "worker",
        ("spotinfer-daemon.service", "spotinfer-worker.service"),
    ),
    ("gcp-boot.sh.tftpl", "gcp", "coordinator", ("spotinfer-coordinator.service",)),
]


@pytest.mark.parametrize(
    ("template", "cloud", "role", "units"), RENDERINGS, ids=[f"{r[1]}-{r[2]}" for r in RENDERINGS]
)
def test_rendered_boot_script_is_valid_bash_with_units_verbatim(
    tmp_path: Path, template: str, cloud: str, role: str, units: tuple[str, ...]
) -> None:
    script = _render(template, cloud, role, units)

    assert f"SPOTINFER_NOTICE_SOURCE={cloud}\n" in script
    for unit in units:
        assert (BOOT_DIR / unit).read_text() in script  # heredoc'd unchanged
    assert f"SPOTINFER_UNITS='{' '.join(sorted(units))}'" in script
    path = tmp_path / "boot.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if shutil.which("shellcheck"):
        lint = subprocess.run(
            ["shellcheck", "-S", "warning", str(path)], capture_output=True, text=True
        )
        assert lint.returncode == 0, lint.stdout


def test_install_script_is_valid_bash() -> None:
    script = BOOT_DIR / "install-spotinfer.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        lint = subprocess.run(
            ["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True
        )
        assert lint.returncode == 0, lint.stdout


# ---- the pool labels: one boot for spot and on-demand (fallback) VMs ------------------------

# The lines that set $spot, and what the metadata answers on an on-demand / a spot VM.
SPOT_DETECTION = {
    "aws-boot.sh.tftpl": ("imds", "instance-life-cycle", "on-demand", "spot"),
    "gcp-boot.sh.tftpl": ("metadata", "scheduling/preemptible", "FALSE", "TRUE"),
}


@pytest.mark.parametrize("template", sorted(SPOT_DETECTION))
@pytest.mark.parametrize("on_spot", [False, True], ids=["on-demand", "spot"])
def test_a_vm_is_marked_spot_only_when_its_metadata_says_so(template: str, on_spot: bool) -> None:
    # The fallback groups reuse the spot workers' boot script: an on-demand VM must register
    # without --spot (SPOTINFER_SPOT=false), which only the metadata answer can tell.
    function, key, on_demand_answer, spot_answer = SPOT_DETECTION[template]
    text = (BOOT_DIR / template).read_text()
    lines = [line for line in text.splitlines() if re.match(r"(spot=|if .*then spot=)", line)]
    assert lines == [
        "spot=false",
        f'if [ "$({function} {key})" = {spot_answer} ]; then spot=true; fi',
    ]
    answer = spot_answer if on_spot else on_demand_answer
    stub = f'{function}() {{ [ "$1" = {key} ] && echo {answer}; }}'
    script = "\n".join([stub, *lines, 'echo "$spot"'])
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ("true" if on_spot else "false")
    assert "SPOTINFER_SPOT=$spot\n" in text
