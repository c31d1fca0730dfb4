"""`vlserve demo`: generate for a picture offline, on a real model or on a random demo checkpoint."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vlserve.entrypoints.cli_args import add_engine_args, engine_args_from

logger = logging.getLogger("vlserve.demo")


def demo_checkpoint() -> Path:
    """A small random Qwen2-VL made once and kept in the user's cache dir."""
    from vlserve.tools.tiny_model import make_tiny_model

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vlserve" / "demo-qwen2_vl-small"
    if not (root / "config.json").is_file():
        make_tiny_model(root, arch="qwen2_vl", size="small", seed=0)
    return root


def demo_image() -> Image.Image:
    y, x = np.mgrid[0:224, 0:320]
    rgb = np.stack([x * 255 // 320, y * 255 // 224, (x + y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def run(args: argparse.Namespace) -> int:
    from vlserve import LLM, SamplingParams

    model = args.model
    if model is None:
        model = str(demo_checkpoint())
        logger.warning("no --model given: using a RANDOM demo checkpoint at %s; it answers with random text. "
                       "Run `vlserve demo --model Qwen/Qwen2-VL-2B-Instruct` (or a local folder) for a real model.",
                       model)
    engine_args = engine_args_from(args, model=model)
    kwargs = {k: v for k, v in vars(engine_args).items() if k not in ("model", "dtype")}
    llm = LLM(model, dtype=engine_args.dtype, **kwargs)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": demo_image()},
                                             {"type": "text", "text": args.prompt}]}]
    t0 = time.perf_counter()
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    completion = out.outputs[0]
    print(f"prompt tokens: {len(out.prompt_token_ids)}  generated: {len(completion.token_ids)}  "
          f"({dt:.2f}s, finish_reason={completion.finish_reason})")
    print(completion.text)
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="offline generation for a picture (random demo model without --model)")
    add_engine_args(p, model_required=False)
    p.add_argument("--prompt", default="Describe this picture.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=run)
