"""`vlserve demo`: generate for a picture offline, on a real model or on a random demo checkpoint."""

from __future__ import annotations

import argparse
import logging
import time

from vlserve.core.config import DEMO
from vlserve.core.options import add_options, options_from
from vlserve.tools.demo_checkpoint import demo_checkpoint

logger = logging.getLogger("vlserve.demo")


def demo_image():
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:224, 0:320]
    rgb = np.stack([x * 255 // 320, y * 255 // 224, (x + y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def run(ns: argparse.Namespace) -> int:
    import dataclasses

    from vlserve import LLM, SamplingParams

    engine_args = options_from(ns, DEMO).engine
    from vlserve.server.cli import tensor_parallel_worker

    if (code := tensor_parallel_worker(engine_args)) is not None:
        return code
    if engine_args.model is None:
        engine_args.model = str(demo_checkpoint())
        logger.warning("no --model given: using a RANDOM demo checkpoint at %s; it answers with random text. "
                       "Run `vlserve demo --model Qwen/Qwen2-VL-2B-Instruct` (or a local folder) for a real model.",
                       engine_args.model)
    kwargs = {k: v for k, v in dataclasses.asdict(engine_args).items() if k not in ("model", "dtype")}
    llm = LLM(engine_args.model, dtype=engine_args.dtype, **kwargs)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": demo_image()},
                                             {"type": "text", "text": ns.prompt}]}]
    t0 = time.perf_counter()
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=ns.max_tokens), use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    completion = out.outputs[0]
    print(f"prompt tokens: {len(out.prompt_token_ids)}  generated: {len(completion.token_ids)}  "
          f"({dt:.2f}s, finish_reason={completion.finish_reason})")
    print(completion.text)
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="offline generation for a picture (random demo model without --model)")
    add_options(p, DEMO)
    p.add_argument("--prompt", default="Describe this picture.", help="the question (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.set_defaults(func=run)
