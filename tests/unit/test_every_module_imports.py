"""Every module of the project's packages imports: the type checker runs with
ignore_missing_imports, so a wrong module path after a move would otherwise surface only at
run time, in whichever process happens to reach it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "common",
    "protos",
    "store",
    "coordinator",
    "worker",
    "context_daemon",
    "spotinfer",
    "benchmarks",
)


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue  # runs its process
            names.append(".".join(p for p in parts if p != "__init__"))
    return names


@pytest.mark.parametrize("module", _modules())
def test_module_imports(module: str) -> None:
    importlib.import_module(module)
