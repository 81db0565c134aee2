"""The floors of the house: a package imports only from the floors below its own.

    benchmarks                          4
    spotinfer (CLI, client, tools)      3
    coordinator  worker  context_daemon 2   never each other
    protos  store                       1   never each other
    common                              0

Every import counts, at module level or inside a function (a lazy import hides a cycle, it
does not remove it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

LAYERS: dict[str, int] = {
    "common": 0,
    "protos": 1,
    "store": 1,
    "coordinator": 2,
    "worker": 2,
    "context_daemon": 2,
    "spotinfer": 3,
    "benchmarks": 4,
}


@dataclass(frozen=True)
class Import:
    """One import statement of one project package naming another."""

    source: str  # the importing package
    target: str  # the imported package
    where: str  # file:line


def project_imports(root: Path, layers: dict[str, int] = LAYERS) -> list[Import]:
    """Every import between two different packages of `layers` under `root`."""
    found = []
    for package in layers:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    target = name.split(".")[0]
                    if target in layers and target != package:
                        where = f"{path.relative_to(root)}:{node.lineno}"
                        found.append(Import(package, target, where))
    return found


def violations(imports: list[Import], layers: dict[str, int] = LAYERS) -> list[str]:
    """Upward or sideways imports, then any cycle between packages."""
    problems = [
        f"{i.where}: {i.source} (floor {layers[i.source]}) imports {i.target} "
        f"(floor {layers[i.target]})"
        for i in imports
        if layers[i.target] >= layers[i.source]
    ]
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
    problems += [f"circular import: {' -> '.join(cycle)}" for cycle in _cycles(edges)]
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    cycles = []
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    cycles.append([*path, start])
                elif nxt not in path and nxt > start:  # each cycle once, from its least node
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_no_package_imports_upward_or_sideways_or_in_a_circle() -> None:
    imports = project_imports(REPO_ROOT)
    assert imports, "the walk found no imports at all: it is looking in the wrong place"
    assert violations(imports) == []


def test_the_check_fails_on_a_planted_upward_import(tmp_path: Path) -> None:
    """A copy of a tiny tree where the floor imports a process (inside a function, as lazy
    imports do) and two processes import each other: each is reported."""
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "common" / "errors.py").write_text(
        "def status():\n    from coordinator.errors import QueueFull\n    return QueueFull\n"
    )
    (tmp_path / "coordinator" / "relay.py").write_text("import worker.engine\n")
    (tmp_path / "worker" / "engine.py").write_text("from coordinator import relay\n")
    (tmp_path / "spotinfer" / "cli.py").write_text("from common import errors\n")  # allowed

    problems = violations(project_imports(tmp_path))

    assert any(p.startswith("common/errors.py:2: common") for p in problems), problems
    assert any(p.startswith("coordinator/relay.py:1: coordinator") for p in problems), problems
    assert any(p.startswith("worker/engine.py:1: worker") for p in problems), problems
    assert any(p.startswith("circular import:") for p in problems), problems
    assert not any(p.startswith("spotinfer/") for p in problems), problems
