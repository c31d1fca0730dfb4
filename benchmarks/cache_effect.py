"""What the encoder cache and the prefix cache buy, measured in one run on the same engine settings.

1. Time to first token for a picture seen before (hit) vs a new picture (miss), same prompt otherwise.
2. Throughput with caches on vs off for a workload with repeated pictures and a shared system prompt.

    .venv/bin/python benchmarks/cache_effect.py [--model DIR] [--num-requests 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlserve import LLM, SamplingParams  # noqa: E402

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM = ("<|im_start|>system\nYou are a careful assistant that describes pictures for blind users. Mention "
          "colours, objects, text and the layout of the scene, and say when you are unsure.<|im_end|>\n")


def picture(seed: int, size=(448, 448)) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def prompt(question: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{IMG}{question}<|im_end|>\n<|im_start|>assistant\n"


def time_to_first_token(llm: LLM, img: Image.Image, question: str) -> float:
    t0 = time.perf_counter()
    llm.generate({"prompt": prompt(question), "multi_modal_data": {"image": [img]}},
                 SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0


def ttft(llm: LLM, rounds: int) -> tuple[float, float]:
    misses, hits = [], []
    for r in range(rounds):
        img = picture(1000 + r)
        misses.append(time_to_first_token(llm, img, "What is in this picture?"))
        hits.append(time_to_first_token(llm, img, "What is in this picture?"))
    return statistics.median(misses), statistics.median(hits)


def throughput(llm: LLM, n: int) -> tuple[float, int]:
    pictures = [picture(2000 + i, [(448, 448), (336, 252), (224, 224)][i % 3]) for i in range(max(2, n // 3))]
    questions = ["Describe the picture.", "List the colours you see.", "Is there text?", "Tell a story about it."]
    reqs = [{"prompt": prompt(questions[i % 4]), "multi_modal_data": {"image": [pictures[i % len(pictures)]]}}
            for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a medium random Qwen2-VL made in a temp dir)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's where this CPU computes it natively, "
                    "else float32")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from vlserve.tools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "medium", arch="qwen2_vl", size="medium"))

    common = dict(dtype=args.dtype, max_num_seqs=32, kv_cache_memory_gb=1.0)
    cached = LLM(model, **common)
    time_to_first_token(cached, picture(7), "warm-up")
    miss, hit = ttft(cached, args.rounds)
    print(f"TTFT (448x448, median of {args.rounds}): miss {miss * 1e3:7.1f} ms   hit {hit * 1e3:7.1f} ms   "
          f"hit/miss = {hit / miss:.2f}x (target <= 0.3x)")

    dt_on, tok = throughput(cached, args.num_requests)
    m = cached.get_metrics()
    del cached
    plain = LLM(model, enable_prefix_caching=False, encoder_cache_size=0, **common)
    time_to_first_token(plain, picture(7), "warm-up")
    dt_off, _ = throughput(plain, args.num_requests)
    print(f"throughput, {args.num_requests} requests, repeated pictures + shared system prompt:")
    print(f"  caches on : {tok / dt_on:7.1f} tok/s ({dt_on:.2f}s)   prefix hits {m['prefix_cache_hits_total']}/"
          f"{m['prefix_cache_queries_total']} tokens, encoder hits {m['encoder_cache_hits_total']}/"
          f"{m['encoder_cache_queries_total']} items")
    print(f"  caches off: {tok / dt_off:7.1f} tok/s ({dt_off:.2f}s)")
    print(f"  speed-up with caches: {dt_off / dt_on:.2f}x")


if __name__ == "__main__":
    main()
