"""`spotinfer coordinator`: the public endpoint (gRPC Inference + Control, OpenAI HTTP front)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from coordinator.main import add_arguments, run

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator: routes requests to workers, OpenAI-compatible HTTP front",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
