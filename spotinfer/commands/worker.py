"""`spotinfer worker`: one vLLM engine behind the Worker gRPC service."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from worker.main import add_arguments, run

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "worker", help="run a worker (one vLLM engine) serving spotinfer.v1.Worker"
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
