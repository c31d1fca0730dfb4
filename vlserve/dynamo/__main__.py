"""`python -m vlserve.dynamo ...`: the same as `vlserve dynamo-worker ...` (how Dynamo's backends are started)."""

import argparse
import logging
import sys

from vlserve.core.cpu_budget import short_spin_waits
from vlserve.core.errors import VlserveError, exit_code
from vlserve.core.processes import log_format
from vlserve.dynamo.cli import run_worker
from vlserve.dynamo.flags import add_worker_flags


def main() -> int:
    short_spin_waits()  # before torch loads
    parser = argparse.ArgumentParser(prog="python -m vlserve.dynamo", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_worker_flags(parser)
    ns = parser.parse_args()
    logging.basicConfig(level=ns.log_level, format=log_format())
    try:
        return run_worker(ns)
    except VlserveError as e:
        logging.getLogger("vlserve").error("%s", e)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
