"""Entry point shared by `spotinfer daemon` and `python -m context_daemon`."""

from __future__ import annotations

import argparse
import asyncio

from common.errors import UserError
from context_daemon.config import CONFIG_SOURCE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CONFIG_SOURCE.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from context_daemon.malloc_tuning import keep_large_buffers
    from context_daemon.server import serve

    try:
        resolved = CONFIG_SOURCE.resolve(args)
    except (TypeError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    if args.print_config:
        print(resolved.render())
        return 0
    keep_large_buffers()
    return asyncio.run(serve(resolved.config))
