"""`vlserve <command>`: each command module registers its own subparser."""

from __future__ import annotations

import argparse
import logging
import sys

from vlserve.bench import cli as bench_cli
from vlserve.disagg import bootstrap as disagg_bootstrap
from vlserve.disagg import cli as disagg_cli
from vlserve.entrypoints import demo
from vlserve.entrypoints.openai import cli as serve_cli
from vlserve.errors import VlserveError
from vlserve.tools import tiny_model

COMMANDS = [serve_cli.register_cli, demo.register_cli, tiny_model.register_cli, bench_cli.register_cli,
            disagg_bootstrap.register_cli, disagg_cli.register_cli]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlserve", description="Serve vision-language models.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `serve --disagg` hands the same flags to the processes it starts
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per registry call or media fetch is noise
    try:
        return int(args.func(args) or 0)
    except VlserveError as e:
        logging.getLogger("vlserve").error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
