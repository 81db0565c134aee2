"""Entry point shared by `spotinfer coordinator` and `python -m coordinator`."""

from __future__ import annotations

import argparse
import asyncio

from common.errors import UserError
from coordinator.config import CONFIG_SOURCE, apply_tuning_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CONFIG_SOURCE.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coordinator.failover import FailoverPolicy
    from coordinator.routing import RoutingPolicy
    from coordinator.server import serve
    from store.redis_store import refuse_evicting_store

    try:
        resolved = CONFIG_SOURCE.resolve(args)
        resolved = resolved.replaced(apply_tuning_file(resolved.config), "tuning_file")
    except (TypeError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    if args.print_config:
        print(resolved.render())
        return 0
    config = resolved.config
    if config.routing_policy not in RoutingPolicy.names():
        raise UserError(
            f"unknown routing policy {config.routing_policy!r}; "
            f"known: {', '.join(RoutingPolicy.names())}"
        )
    if config.failover_policy not in FailoverPolicy.names():
        raise UserError(
            f"unknown failover policy {config.failover_policy!r}; "
            f"known: {', '.join(FailoverPolicy.names())}"
        )
    if config.model and not (Path(config.model) / "config.json").exists():
        raise UserError(f"--model {config.model}: not a model folder (no config.json)")
    if config.store.url:
        refuse_evicting_store(config.store)
    return asyncio.run(serve(config))
