"""`vlserve <command>`. Each command registers its own flags from light modules: nothing here imports torch or
transformers, so `--help` answers at once; a command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap

from vlserve.bench import cli as bench_cli
from vlserve.core.cpu_budget import short_spin_waits
from vlserve.core.errors import VlserveError, exit_code
from vlserve.core.processes import log_format
from vlserve.disagg import cli as disagg_cli
from vlserve.dynamo import cli as dynamo_cli
from vlserve.router import cli as router_cli
from vlserve.server import cli as server_cli
from vlserve.server import demo, run_batch
from vlserve.tools import cli as tools_cli
from vlserve.tools.tiny_arches import family_names

COMMANDS = [server_cli.register_cli, demo.register_cli, tools_cli.register_cli, bench_cli.register_cli,
            disagg_cli.register_cli, router_cli.register_cli, run_batch.register_cli, dynamo_cli.register_cli]
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, wrapping at spaces only: names such as "LLaVA-OneVision" stay on one line."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlserve", description=f"Serve vision-language models ({family_names()}) "
                                     "with an OpenAI-compatible API.", formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="log verbosity (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    for command in sub.choices.values():  # also accepted after the command; SUPPRESS keeps the top-level value
        if command.formatter_class is argparse.HelpFormatter:
            command.formatter_class = HelpFormatter
        if not any(a.dest == "log_level" for a in command._actions):
            command.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                                 help="log verbosity (default: INFO)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    short_spin_waits()  # before any command imports torch
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=log_format())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per registry call or media fetch is noise
    try:
        return int(args.func(args) or 0)
    except VlserveError as e:
        logging.getLogger("vlserve").error("%s", e)
        return exit_code(e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
