"""checkov over infra/terraform: no failed check, and every skipped one explained.

checkov pins packages that clash with vLLM's, so it lives in its own virtualenv:

    python3 -m venv .venv-checkov && .venv-checkov/bin/pip install checkov

The test finds it there, on PATH, or at $CHECKOV_BIN, and skips (saying so) otherwise.
The open-source checkov reports no severities offline, so the bar is every finding: each
one is fixed or skipped inline with `#checkov:skip=ID:reason`, and listed with its reason in
infra/checkov-exceptions.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.infra.conftest import REPO_ROOT, TERRAFORM_DIR

EXCEPTIONS_FILE = REPO_ROOT / "infra" / "checkov-exceptions.md"
CHECKOV_TIMEOUT_SECONDS = 300


def _checkov() -> str:
    candidates = [
        os.environ.get("CHECKOV_BIN", ""),
        str(REPO_ROOT / ".venv-checkov" / "bin" / "checkov"),
        shutil.which("checkov") or "",
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip(
        "checkov is not installed: python3 -m venv .venv-checkov && "
        ".venv-checkov/bin/pip install checkov (or set CHECKOV_BIN)"
    )


def _scan(directory: Path) -> dict[str, Any]:
    result = subprocess.run(
        [
            _checkov(),
            "--directory",
            str(directory),
            "--framework",
            "terraform",
            "--output",
            "json",
            # Offline: don't fetch guidelines from the vendor's API.
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=CHECKOV_TIMEOUT_SECONDS,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    # checkov exits 1 when a check fails; anything else is a crash.
    assert result.returncode in (0, 1), result.stderr[-2000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return _scan(TERRAFORM_DIR)


def test_no_check_fails(report: dict[str, Any]) -> None:
    failed = [
        f"{check['check_id']} {check['resource']} ({check['file_path']})"
        for check in report["results"]["failed_checks"]
    ]
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 100  # it really read the modules
    assert failed == []


def test_every_skip_has_a_reason_and_is_documented(report: dict[str, Any]) -> None:
    documented = EXCEPTIONS_FILE.read_text()
    for check in report["results"]["skipped_checks"]:
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason) >= 20, f"{check['check_id']} on {check['resource']}: no real reason"
        assert check["check_id"] in documented, (
            f"{check['check_id']} missing from {EXCEPTIONS_FILE}"
        )


def test_checkov_catches_a_weakened_copy(tmp_path: Path) -> None:
    copy_dir = tmp_path / "aws"
    shutil.copytree(TERRAFORM_DIR / "aws", copy_dir)
    workers = copy_dir / "workers.tf"
    workers.write_text(
        workers.read_text().replace(
            'http_tokens                 = "required"', 'http_tokens                 = "optional"'
        )
    )

    failed = {check["check_id"] for check in _scan(copy_dir)["results"]["failed_checks"]}

    assert "CKV_AWS_79" in failed  # "Instance Metadata Service Version 1 is not enabled"
