"""The size rule of the process packages: no function over 80 lines, no class over 400.

Past those sizes a function or class does more than one job; the rule holds for every
package a serving process runs (the floor packages too, where they exist). Generated
protobuf modules are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE_PACKAGES = ("coordinator", "worker", "context_daemon", "protos")
FLOOR_PACKAGES = ("store", "common")  # checked once they exist
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def oversized(root: Path, packages: Iterable[str]) -> list[str]:
    """``path: kind name (lines)`` for every function or class over its limit."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    kind, limit = "class", MAX_CLASS_LINES
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    kind, limit = "function", MAX_FUNCTION_LINES
                else:
                    continue
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}: {kind} {node.name} ({lines} lines)")
    return found


def _packages() -> list[str]:
    return [*CORE_PACKAGES, *(name for name in FLOOR_PACKAGES if (ROOT / name).is_dir())]


def test_the_process_packages_are_where_the_rule_looks() -> None:
    missing = [name for name in CORE_PACKAGES if not (ROOT / name / "__init__.py").is_file()]
    assert not missing, f"process packages not found under {ROOT}: {missing}"


def test_no_function_or_class_in_the_process_packages_is_over_its_limit() -> None:
    found = oversized(ROOT, _packages())
    assert not found, (
        f"over {MAX_FUNCTION_LINES} lines per function or {MAX_CLASS_LINES} per class; "
        "split by role:\n" + "\n".join(found)
    )


def test_an_oversized_function_and_class_are_found(tmp_path: Path) -> None:
    package = tmp_path / "worker"
    package.mkdir()
    statements = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    methods = "\n".join(
        f"    def m{i}(self) -> None:\n" + "\n".join("        pass" for _ in range(9))
        for i in range(MAX_CLASS_LINES // 10)
    )
    (package / "planted.py").write_text(
        f"def long() -> None:\n{statements}\n\n\ndef short() -> None:\n    pass\n\n\n"
        f"class Big:\n{methods}\n"
    )
    (package / "planted_pb2.py").write_text(f"def generated() -> None:\n{statements}\n")
    assert oversized(tmp_path, ["worker"]) == [
        f"worker/planted.py: function long ({MAX_FUNCTION_LINES + 1} lines)",
        f"worker/planted.py: class Big ({MAX_CLASS_LINES + 1} lines)",
    ]
