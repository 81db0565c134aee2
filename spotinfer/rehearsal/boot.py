"""A VM's first boot, rehearsed: the rendered boot script runs, as root, inside the VM.

The script is the one Terraform renders from ``infra/boot/*-boot.sh.tftpl`` and runs
unchanged but for four things a rehearsal cannot have:

- its VM paths (/etc/spotinfer, /etc/systemd/system, /etc/cron.d, /var/log, /opt) point into
  the node's own folder (the unit bodies it writes stay verbatim);
- the cloud's secret CLIs (``aws secretsmanager``, ``gcloud secrets``) are stand-ins on PATH
  that serve every secret the script reads: the Redis AUTH token, the role's TLS bundle (with
  the API keys on the coordinator) and the KV MAC keyring (`fleet_secrets`);
- ``useradd`` is a stand-in that makes no user on this machine (so the files stay root's, as
  the processes here run as root);
- the install script (pip, ``systemctl enable --now``) is replaced by one that records which
  units it would enable: the supervisor starts those.

Everything else is real: ``curl`` asks the VM's metadata server (at 169.254.169.254, or
metadata.google.internal through the VM's /etc/hosts) for the instance id, and bash writes
the env file and the unit files.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotinfer.fleet.render import render_template
from spotinfer.local.managed_process import REPO_ROOT
from spotinfer.rehearsal.fleet_secrets import FleetSecrets

BOOT_DIR = REPO_ROOT / "infra" / "boot"
ENV_FILE = "/etc/spotinfer/spotinfer.env"
# VM paths the boot script writes, each mapped into the node's folder (longest first).
VM_PATHS = ("/etc/systemd/system", "/etc/spotinfer", "/etc/cron.d", "/var/log", "/opt")
BOOT_TIMEOUT_SECONDS = 60.0
ENABLED_UNITS_FILE = "enabled-units"
_INSTALL_STAND_IN = """#!/usr/bin/env bash
# Rehearsal stand-in for install-spotinfer.sh: nothing to install; record the units.
set -euo pipefail
: "${SPOTINFER_UNITS:?}"
chmod 0600 /etc/spotinfer/spotinfer.env
echo "$SPOTINFER_UNITS" >/opt/ENABLED_UNITS
"""
_USERADD_STAND_IN = """#!/bin/sh
# Rehearsal stand-in for useradd: a VM's system user is not made on the rehearsing machine.
echo "rehearsal: useradd $* skipped" >&2
"""
# A VM path where a word starts (not inside another path), followed by /, a quote or a space.
_VM_PATH = re.compile(
    r"(?<![\w/.-])(?:" + "|".join(map(re.escape, VM_PATHS)) + r")(?=[/\s'\"]|$)", re.MULTILINE
)


@dataclass(frozen=True)
class BootResult:
    root: Path
    env_file: Path
    units: dict[str, Path]
    enabled: tuple[str, ...]
    log: str

    def map(self) -> dict[str, Path]:
        """VM path → node folder, for the supervisor."""
        return {vm: self.root / vm.lstrip("/") for vm in (*VM_PATHS, "/var/lib/spotinfer")}


def boot(
    template: str,
    values: Mapping[str, Any],
    root: Path,
    secrets: FleetSecrets,
    wrap: Callable[[Sequence[str]], list[str]] = list,
) -> BootResult:
    """Render `template` with Terraform's `values` (spotinfer.fleet.render, Terraform's
    templatefile), run it in the VM (`wrap`) with `secrets` behind its cloud CLIs, and return
    what it wrote under `root`."""
    units: Mapping[str, str] = values["units"]
    placeholders = {name: f"@@UNIT:{name}@@" for name in units}
    install = _INSTALL_STAND_IN.replace("ENABLED_UNITS", ENABLED_UNITS_FILE)
    script = render_template(template, {**values, "units": placeholders, "install_script": install})
    script = _VM_PATH.sub(lambda m: f"{root}{m.group(0)}", script)
    for name, body in units.items():
        script = script.replace(placeholders[name], body.rstrip("\n"))
    for vm_path in (*VM_PATHS, "/var/lib/spotinfer"):
        (root / vm_path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    shims = root / "rehearsal-bin"
    shims.mkdir(exist_ok=True)
    secrets.install_clis(shims)
    (shims / "useradd").write_text(_USERADD_STAND_IN)
    (shims / "useradd").chmod(0o755)
    (root / "boot.sh").write_text(script)
    command = [
        "env",
        f"PATH={shims}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "bash",
        str(root / "boot.sh"),
    ]
    done = subprocess.run(
        wrap(command), capture_output=True, text=True, timeout=BOOT_TIMEOUT_SECONDS
    )
    if done.returncode != 0:
        raise RuntimeError(f"boot script failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    enabled = (root / "opt" / ENABLED_UNITS_FILE).read_text().split()
    return BootResult(
        root=root,
        env_file=root / ENV_FILE.lstrip("/"),
        units={name: root / "etc/systemd/system" / name for name in units},
        enabled=tuple(enabled),
        log=done.stdout + done.stderr,
    )


def unit_bodies(names: Sequence[str]) -> dict[str, str]:
    """The unit files of ``infra/boot`` that Terraform passes as ``units``."""
    return {name: (BOOT_DIR / name).read_text() for name in names}
