"""`python -m worker --model M --port P ...`: one worker process."""

import argparse
import logging
import sys

from common.errors import UserError
from worker.main import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m worker", description="A spotinfer worker.")
    add_arguments(parser)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        sys.exit(run(parser.parse_args()))
    except UserError as exc:
        print(f"worker: error: {exc}", file=sys.stderr)
        sys.exit(2)
