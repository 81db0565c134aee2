"""Entry point shared by `spotinfer worker` and `python -m worker`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from common.errors import UserError
from common.tuning_file import load_tuning_file
from worker.config import CONFIG_SOURCE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    CONFIG_SOURCE.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from store.redis_store import refuse_evicting_store
    from worker.server import serve

    try:
        resolved = CONFIG_SOURCE.resolve(args)
        config = resolved.config
        if config.tuning_file and not resolved.explicit("max_num_seqs"):
            tuned = load_tuning_file(Path(config.tuning_file)).get("worker", {})
            if "max_num_seqs" in tuned:
                config = dataclasses.replace(config, max_num_seqs=int(tuned["max_num_seqs"]))
                resolved = resolved.replaced(config, "tuning_file")
    except (TypeError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    if args.print_config:
        print(resolved.render())
        return 0
    model_path = Path(config.model)
    if (model_path.is_absolute() or config.model.startswith(".")) and not model_path.exists():
        raise UserError(f"model folder {config.model} does not exist")
    if config.store.url:
        refuse_evicting_store(config.store)
    return asyncio.run(serve(config))
