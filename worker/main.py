"""Entry point shared by `spotinfer worker` and `python -m worker`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from common.errors import UserError
from common.tuning_file import load_tuning_file
from worker.config import WorkerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    WorkerConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from worker.server import serve

    try:
        config = WorkerConfig.from_args(args)
        if config.tuning_file and getattr(args, "max_num_seqs", None) is None:
            tuned = load_tuning_file(Path(config.tuning_file)).get("worker", {})
            if "max_num_seqs" in tuned:
                config = dataclasses.replace(config, max_num_seqs=int(tuned["max_num_seqs"]))
    except (TypeError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    model_path = Path(config.model)
    if (model_path.is_absolute() or config.model.startswith(".")) and not model_path.exists():
        raise UserError(f"model folder {config.model} does not exist")
    return asyncio.run(serve(config))
