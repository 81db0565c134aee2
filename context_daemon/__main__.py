"""`python -m context_daemon --notice-source aws --worker-address unix:/run/w.sock ...`."""

import argparse
import logging
import sys

from common.errors import UserError
from context_daemon.main import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m context_daemon", description="The spotinfer context daemon."
    )
    add_arguments(parser)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        sys.exit(run(parser.parse_args()))
    except UserError as exc:
        print(f"context_daemon: error: {exc}", file=sys.stderr)
        sys.exit(2)
