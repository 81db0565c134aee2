"""The `spotinfer` command line: one subcommand per module of `spotinfer.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from common.errors import UserError

COMMAND_MODULES = (
    "spotinfer.commands.model",
    "spotinfer.commands.plan",
    "spotinfer.commands.worker",
    "spotinfer.commands.demo",
    "spotinfer.commands.fleet",
    "spotinfer.commands.tune",
    "spotinfer.commands.generate",
    "spotinfer.commands.batch",
    "spotinfer.commands.coordinator",
    "spotinfer.commands.daemon",
    "spotinfer.commands.drill",
    "spotinfer.commands.certs",
    "spotinfer.commands.keys",
    "spotinfer.commands.rehearse",
    "spotinfer.commands.simulate",
)
# What the `tools` extra installs; a node installed without it still runs its processes.
TOOLS_EXTRA_PACKAGES = frozenset({"rich", "matplotlib", "gguf", "safetensors", "tokenizers"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotinfer",
        description="LLM inference on spot VMs that loses nothing when a VM is taken away.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"spotinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in TOOLS_EXTRA_PACKAGES:
            raise
        print(
            f"spotinfer {args.command}: error: needs {exc.name}, from the tools extra: "
            "pip install 'spotinfer[tools]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
