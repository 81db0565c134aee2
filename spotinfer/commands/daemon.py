"""`spotinfer daemon`: the context daemon beside one worker (notices, grace-period flush)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from context_daemon.main import add_arguments, run

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "daemon",
        help="run a context daemon: watch termination notices, flush the worker before them",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
