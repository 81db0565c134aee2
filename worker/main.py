"""Entry point shared by `spotinfer worker` and `python -m worker`."""

from __future__ import annotations

import argparse
import asyncio

from spotinfer.errors import UserError
from worker.config import WorkerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    WorkerConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from worker.server import serve

    try:
        config = WorkerConfig.from_args(args)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    model_path = Path(config.model)
    if (model_path.is_absolute() or config.model.startswith(".")) and not model_path.exists():
        raise UserError(f"model folder {config.model} does not exist")
    return asyncio.run(serve(config))
