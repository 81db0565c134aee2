"""`python -m coordinator --port P --http-port H --worker ADDR ... --model M`."""

import argparse
import logging
import sys

from common.errors import UserError
from coordinator.main import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m coordinator", description="The spotinfer coordinator."
    )
    add_arguments(parser)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        sys.exit(run(parser.parse_args()))
    except UserError as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        sys.exit(2)
