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


def _run_adapter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vlserve.tools.tiny_adapter import make_peft_adapter, std_for

    if args.rank < 1 or not args.strength > 0 or not args.alpha > 0:
        print("error: --rank must be at least 1, --strength and --alpha above 0", file=sys.stderr)
        return 2
    if not Path(args.model).is_dir():
        print(f"error: {args.model} is not a checkpoint folder here (a hub id: download it first, e.g. with "
              "`huggingface-cli download`)", file=sys.stderr)
        return 2
    try:
        std = std_for(Path(args.model), args.targets, args.strength, args.rank, args.alpha)
        out = make_peft_adapter(Path(args.model), Path(args.out), args.targets, args.rank, args.alpha, args.seed, std)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"a LoRA adapter of {args.model} in {out} (random, changes answers): serve it with "
          f"--enable-lora --lora-modules NAME={out}, then ask for model NAME")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add `make-tiny-model OUT --arch ... [--size ...] [--seed N]` and `make-tiny-adapter MODEL OUT ...` to an
    argparse subparsers object."""
    adapter = subparsers.add_parser(
        "make-tiny-adapter",
        help="write a random LoRA adapter (PEFT format) for a local checkpoint, to try LoRA with (offline)",
        description="A LoRA adapter whose A and B are random, like a trained one's, so it changes the model's "
        "answers (an adapter fresh from PEFT has B = 0 and changes nothing).",
    )
    adapter.add_argument("model", metavar="MODEL", help="the checkpoint folder the adapter is for")
    adapter.add_argument("out", metavar="OUT", help="output folder (created if missing)")
    adapter.add_argument("--targets", choices=("lm", "tower", "both"), default="lm",
                         help="the language model's linears, the media towers' or both (default: lm)")
    adapter.add_argument("--rank", type=int, default=8, help="LoRA rank (default: 8)")
    adapter.add_argument("--alpha", type=float, default=16, help="LoRA alpha (default: 16)")
    adapter.add_argument("--strength", type=float, default=0.4,
                         help="how far it moves each weight, against the spread of the model's own (default: 0.4)")
    adapter.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    adapter.set_defaults(func=_run_adapter)

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
