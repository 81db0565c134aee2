"""Regenerates the committed Python code of `protos/` (`make protos`).

Run from anywhere: `python -m spotinfer.protogen [--out DIR]`. With `--out`, the code is
written under DIR instead of the repository, which is how the staleness test compares.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/spotinfer/v1")


def proto_files() -> list[Path]:
    return sorted((REPO_ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Writes `_pb2.py`, `_pb2.pyi`, `_pb2_grpc.py` and `_pb2_grpc.pyi` for every proto."""
    from grpc_tools import protoc  # dev dependency only

    mypy_plugin = shutil.which("protoc-gen-mypy") or str(
        Path(sys.executable).parent / "protoc-gen-mypy"
    )
    mypy_grpc_plugin = shutil.which("protoc-gen-mypy_grpc") or str(
        Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    )
    out_root.mkdir(parents=True, exist_ok=True)
    sources = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--plugin=protoc-gen-mypy={mypy_plugin}",
        f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *sources,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted((out_root / PROTO_DIR).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
