"""Entry point shared by `spotinfer daemon` and `python -m context_daemon`."""

from __future__ import annotations

import argparse
import asyncio

from common.errors import UserError
from context_daemon.config import DaemonConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    DaemonConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from context_daemon.server import serve

    try:
        config = DaemonConfig.from_args(args)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    return asyncio.run(serve(config))
