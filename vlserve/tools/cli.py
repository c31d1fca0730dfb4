"""`vlserve make-tiny-model`: flags here, the (torch + transformers) work in tiny_model.py, imported on use."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vlserve.tools.tiny_arches import TINY_ARCHES, family_names

ARCHES = tuple(TINY_ARCHES)
SIZES = ("tiny", "small", "medium")


def _run(args: argparse.Namespace) -> int:
    from vlserve.core.errors import InvalidInputError
    from vlserve.tools.tiny_model import make_tiny_model

    try:
        make_tiny_model(args.out, arch=args.arch, size=args.size, seed=args.seed)
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def register_cli(subparsers: Any) -> None:
    """Add `make-tiny-model OUT --arch ... [--size ...] [--seed N]` to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "make-tiny-model",
        help=f"write a small random checkpoint ({family_names()}; offline)",
        description="Create a random HF-format checkpoint with a freshly trained BPE tokenizer.",
    )
    parser.add_argument("out", metavar="OUT", help="output folder (created if missing)")
    parser.add_argument("--arch", choices=ARCHES, required=True, metavar="ARCH",
                        help="model family: " + ", ".join(f"{name} ({a.family})" for name, a in TINY_ARCHES.items()))
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny, small or medium (~240M params; "
                        "default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    parser.set_defaults(func=_run)
